"""Admission refuses a tp/gpusPerReplica that cannot hold the checkpoint on any GPU the spec allows
(moe_core.sizing.layout_refusal, wired into the webhook's verdict), with the numbers; what it cannot
judge (size or memory unknown, a first hf:// model) is admitted and left to the reconcile."""

import pytest

from moe_core import sizing
from moe_core.checkpoint import CheckpointInfo, inspect_dir
from moe_operator import inspection
from moe_operator.policy import Policy
from moe_operator.reconcile import Config
from moe_operator.sample_checkpoints import write_full_size
from moe_operator.webhook import verdict

SHA = "a" * 40


@pytest.fixture(autouse=True)
def _fresh_inspections():
    """file:// facts are cached by uri: another test file's file:///models/dsv3 (a different checkpoint
    under another models dir) must not answer for this one's."""
    inspection.reset()
    yield
    inspection.reset()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_full_size("deepseek-v3-nvfp4", root / "dsv3")  # 380.8 GiB of weights, sparse
    return root


@pytest.fixture(scope="module")
def dsv3(models):
    return inspect_dir(models / "dsv3")


def test_the_largest_gpu_of_each_allowed_family_or_the_pinned_product():
    assert [g.product for g in sizing.largest_gpus(None, ["sm90", "sm100"])] == ["NVIDIA-H200", "NVIDIA-B300"]
    assert [g.product for g in sizing.largest_gpus("H100", ["sm100"])] == ["NVIDIA-H100-80GB-HBM3"]
    assert len(sizing.largest_gpus(None, None)) == 9  # every family
    thor = sizing.largest_gpus(None, ["sm110"])[0]
    assert thor.memoryMiB is None and sizing.bound_bytes(thor) == 128 * 1024 ** 3  # unified memory: a bound
    assert sizing.bound_bytes(sizing.largest_gpus("NVIDIA-H999", None)[0]) is None  # unknown product


def test_refusal_carries_the_numbers_and_the_tp_that_would_fit(dsv3):
    msg = sizing.layout_refusal(dsv3, sizing.largest_gpus(None, ["sm90"]), 2)
    assert msg.startswith("tp=2 (2 GPUs per replica) cannot hold 380.8 GiB of weights on any allowed GPU")
    assert "per GPU 191.4 GiB weights" in msg and "KV cache" in msg and "workspace" in msg
    assert "NVIDIA-H200 126.4 GiB" in msg and "tp=4 would fit on NVIDIA-H200 (100.5 GiB per GPU)" in msg
    assert sizing.layout_refusal(dsv3, sizing.largest_gpus(None, ["sm90"]), 4) is None
    # L40S: even a full node does not; the hint spans nodes
    msg = sizing.layout_refusal(dsv3, sizing.largest_gpus("L40S", None), 8)
    assert "53.2 GiB > usable" in msg and "NVIDIA-L40S 40.5 GiB" in msg and "tp=16 (2 nodes x 8 GPUs) would fit" in msg
    assert sizing.layout_refusal(dsv3, sizing.largest_gpus("L40S", None), 16, 2) is None
    # unrestricted: one GPU fits none of them, two fit the 288 GiB parts
    msg = sizing.layout_refusal(dsv3, sizing.largest_gpus(None, None), 1)
    assert "AMD-Instinct-MI355X 259.2 GiB" in msg and "NVIDIA-Thor 115.2 GiB (of unified memory)" in msg
    assert sizing.layout_refusal(dsv3, sizing.largest_gpus(None, None), 2) is None


def test_the_kv_cache_the_spec_asks_for_counts(dsv3):
    h200 = sizing.largest_gpus("H200", None)
    assert sizing.layout_refusal(dsv3, h200, 4) is None
    msg = sizing.layout_refusal(dsv3, h200, 4, max_len=163840, concurrency=64)
    assert msg and "10485760 tokens" in msg


def test_what_cannot_be_judged_is_admitted(dsv3):
    assert sizing.layout_refusal(CheckpointInfo(architecture="X", format="bf16", formatSource="spec"), sizing.largest_gpus("H200", None), 1) is None
    assert sizing.layout_refusal(dsv3, sizing.largest_gpus("NVIDIA-H999", None), 1) is None
    assert sizing.layout_refusal(dsv3, sizing.largest_gpus(None, ["sm80", "sm110"]), 1) is not None  # 128 GiB bound
    assert sizing.layout_refusal(dsv3, [], 1) is None


def cfg(models):
    return Config(local_models_dir=str(models), policy=Policy(allowed_host_paths=("/models",)))


def test_webhook_refuses_a_file_model_layout_that_does_not_fit(models):
    c = cfg(models)
    spec = {"model": {"uri": "file:///models/dsv3"}, "engine": {"name": "sglang"}, "gpu": {"product": "H200"}}
    assert verdict(spec, c) is None  # no layout given: the operator sizes it
    msg = verdict({**spec, "parallelism": {"tp": 2}}, c)
    assert msg and "tp=2" in msg and "NVIDIA-H200 126.4 GiB" in msg and "(checkpoint file:///models/dsv3)" in msg
    assert "tp=2" in verdict({**spec, "gpusPerReplica": 2}, c)
    assert verdict({**spec, "parallelism": {"tp": 4}}, c) is None
    assert verdict({**spec, "parallelism": {"tp": 2}, "model": {"uri": "file:///models/dsv3", "format": "nvfp4"}}, c) is None
    # policy first: a path the admin does not allow is refused for that, never read
    assert "not under an allowed host path" in verdict({**spec, "parallelism": {"tp": 2}},
                                                       Config(local_models_dir=str(models),
                                                              policy=Policy(allowed_host_paths=("/data",))))


def test_webhook_judges_hf_models_only_from_an_inspection_already_made(dsv3, monkeypatch):
    monkeypatch.setattr(inspection, "_cache", {})
    monkeypatch.setattr(inspection, "_resolved", {})
    spec = {"model": {"uri": "hf://org/dsv3"}, "engine": {"name": "sglang"}, "gpu": {"product": "H200"},
            "parallelism": {"tp": 2}}
    assert verdict(spec, Config()) is None  # first use: only the reconcile can know the size
    inspection._cache[f"hf://org/dsv3@{SHA}"] = dsv3
    assert verdict(spec, Config()) is None  # another revision may be what it resolves to
    status = {"revision": SHA, "revisionUri": "hf://org/dsv3"}
    msg = verdict(spec, Config(), status)  # an UPDATE of an object pinned at SHA
    assert msg and "tp=2" in msg and f"(checkpoint hf://org/dsv3@{SHA})" in msg
    assert verdict(spec, Config(), {"revision": SHA, "revisionUri": "hf://org/other"}) is None
    inspection._resolved["hf://org/dsv3"] = (__import__("time").monotonic(), SHA)  # another MoEDeployment's
    assert "tp=2" in verdict(spec, Config())
    assert "tp=2" in verdict({**spec, "model": {"uri": f"hf://org/dsv3@{SHA}"}}, Config())  # a sha in the uri
    assert verdict({**spec, "parallelism": {"tp": 4}}, Config()) is None
