"""The node's NVIDIA driver version: GFD labels -> GPU class -> inventory -> planner (issue 16 item 4)."""

import pytest

from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import GpuClassError, from_name, from_node_labels, with_driver
from moe_operator.inventory import NodeInfo, build
from moe_operator.planner import Choices, plan

B200 = {"nvidia.com/gpu.product": "NVIDIA-B200", "nvidia.com/gpu.compute.major": "10",
        "nvidia.com/gpu.compute.minor": "0", "nvidia.com/gpu.count": "8"}


@pytest.mark.parametrize("labels,version,major", [
    ({"nvidia.com/cuda.driver-version.full": "595.58.03", "nvidia.com/cuda.driver-version.major": "595",
      "nvidia.com/cuda.driver-version.minor": "58", "nvidia.com/cuda.driver-version.revision": "03"}, "595.58.03", 595),
    ({"nvidia.com/cuda.driver-version.major": "580", "nvidia.com/cuda.driver-version.minor": "82",
      "nvidia.com/cuda.driver-version.revision": "07"}, "580.82.07", 580),
    # older GFD releases
    ({"nvidia.com/cuda.driver.major": "570", "nvidia.com/cuda.driver.minor": "124", "nvidia.com/cuda.driver.rev": "06"},
     "570.124.06", 570),
    ({"nvidia.com/cuda.driver.major": "570"}, "570", 570),
    ({}, None, None),
])
def test_driver_version_from_gfd_labels(labels, version, major):
    g = from_node_labels({**B200, **labels}).gpu_class
    assert g is not None and g.driverVersion == version and g.driverMajor == major


def test_cuda_runtime_major_from_new_and_old_labels():
    assert from_node_labels({**B200, "nvidia.com/cuda.runtime-version.major": "13"}).gpu_class.cudaMajor == 13
    assert from_node_labels({**B200, "nvidia.com/cuda.runtime.major": "12"}).gpu_class.cudaMajor == 12


@pytest.mark.parametrize("labels", [
    {"nvidia.com/cuda.driver-version.full": "595.58.03", "nvidia.com/cuda.driver.major": "570"},
    {"nvidia.com/cuda.driver-version.major": "595", "nvidia.com/cuda.driver.major": "570"},
    {"nvidia.com/cuda.driver-version.full": "latest"},
])
def test_contradictory_or_bad_driver_labels_are_a_reason(labels):
    facts = from_node_labels({**B200, **labels})
    assert facts.gpu_class is None and "driver" in facts.reason


def test_cli_driver_flag_value():
    g = with_driver(from_name("B200"), "595.0")
    assert g.driverVersion == "595.0" and g.driverMajor == 595
    with pytest.raises(GpuClassError):
        with_driver(from_name("B200"), "r595")


def test_inventory_class_keeps_the_newest_driver_of_its_nodes():
    old = from_node_labels({**B200, "nvidia.com/cuda.driver.major": "570"}).gpu_class
    new = from_node_labels({**B200, "nvidia.com/cuda.driver-version.full": "595.58.03"}).gpu_class
    classes = build([NodeInfo("a", old, "", 8, True), NodeInfo("b", new, "", 8, True)], {})
    (inv,) = classes.values()
    assert inv.gpu_class.driverVersion == "595.58.03" and inv.gpu_class.driverMajor == 595
    classes = build([NodeInfo("b", new, "", 8, True), NodeInfo("a", old, "", 8, True)], {})
    assert next(iter(classes.values())).gpu_class.driverVersion == "595.58.03"


def test_driver_reaches_the_planner():
    """sglang model_overrides/gpt_oss.py:108-115 (0.5.23): triton_kernels SIGSEGV on Blackwell with driver >= 595."""
    ck = CheckpointInfo(architecture="GptOssForCausalLM", format="bf16", formatSource="test", numExperts=32)
    node = from_node_labels({**B200, "nvidia.com/cuda.driver-version.full": "595.58.03"}).gpu_class
    p = plan(ck, node, Choices(runner_backend="triton_kernel"), engine="sglang")
    assert any(e.startswith("[K13]") and "Works instead:" in e for e in p.errors)
    older = from_node_labels({**B200, "nvidia.com/cuda.driver-version.full": "580.82.07"}).gpu_class
    assert not plan(ck, older, Choices(runner_backend="triton_kernel"), engine="sglang").errors
    assert plan(ck, node, Choices(), engine="sglang").moe.runnerBackend == "triton"  # S8


def test_plan_cli_driver_flag(tmp_path, capsys):
    import argparse
    import json
    import struct

    from moe_operator import plan_cli
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                                                      "num_local_experts": 32, "num_experts_per_tok": 4}))
    header = json.dumps({"model.layers.0.mlp.experts.0.gate_proj.weight": {
        "dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 32)

    def run(*extra):
        ap = argparse.ArgumentParser()
        plan_cli.add_arguments(ap)
        return plan_cli.run(ap.parse_args(["--checkpoint", str(tmp_path), "--gpu", "B200", "--engine", "sglang", *extra]))

    assert run("--set", "moe.runnerBackend=triton_kernel") == 0
    capsys.readouterr()
    assert run("--driver", "595.0", "--set", "moe.runnerBackend=triton_kernel") == 2
    assert "[K13]" in capsys.readouterr().out
    assert run("--driver", "r595") == 1
