"""The capability table serves gpt-oss per architecture (issue 18 item 4): the operator's bundled
planner now accepts GptOssForCausalLM in bf16 and MXFP4, on one GPU or sharded over tp/ep like the
other families, on the backends that compute its experts (the clamped SwiGLU with biases: Triton,
torch), and still refuses what the runtime cannot serve (other formats, a backend that cannot compute
those experts; serve: a split the checkpoint's sizes do not allow). The runtime refuses the same from the same table: its plan check, its loader (before any
weight data is read) and the checkpoint writer. Other architectures keep every format.
"""

import json
import shutil

import pytest
import torch

from moe_core.checkpoint import CheckpointInfo, inspect_dir
from moe_core.gpu import from_name
from moe_core.runtime import BUNDLED, problems
from moe_operator.planner import Choices, plan
from moe_runtime.errors import RuntimeFailure

GPT_OSS = "GptOssForCausalLM"
INSTALLED = {"triton": "3.6.0", "flashinfer-python": None}


def info(fmt, arch=GPT_OSS):
    return CheckpointInfo(architecture=arch, format=fmt, formatSource="test", numExperts=32, numSharedExperts=0,
                          expertsFp4=fmt == "mxfp4")


def bundled(fmt, gpu="H200", arch=GPT_OSS, **kw):
    return plan(info(fmt, arch), from_name(gpu), Choices(**kw), engine="bundled")


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("gpu", ["H200", "B200", "L40S"])
def test_planner_puts_bundled_gpt_oss_on_a_backend_computing_its_experts(fmt, gpu):
    p = bundled(fmt, gpu)
    assert not p.errors, p.errors
    assert p.moe.runnerBackend == "triton" and p.moe.deferredFinalize is False
    why = next(d.reason for d in p.decisions if d.key == "moe.runnerBackend")
    assert "compute GptOssForCausalLM's experts (swiglu_oai with biases)" in why
    # flashinfer's MXFP4 wrapper (sm90, priority above Triton) adds no biases: never a candidate
    assert p.provenance["moe.runnerBackend"].candidates == ["triton", "torch"]


def test_without_triton_gpt_oss_falls_to_its_torch_path():
    from moe_core.bundled import resolve_bundled

    r = resolve_bundled(family="sm90", where="sm90", architecture=GPT_OSS, checkpoint_format="mxfp4",
                        shared_experts=0, installed={"triton": None, "flashinfer-python": "0.6.15"})
    assert r.backends == ["torch"] and (r.activation, r.bias) == ("swiglu_oai", True)
    assert any(n.startswith("[B3] triton not used") for n in r.notes), r.notes


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "modelopt_fp8", "ct_mxfp4_pack", "other"])
def test_planner_refuses_gpt_oss_formats_the_runtime_does_not_read(fmt):
    p = bundled(fmt)
    b0 = [e for e in p.errors if e.startswith("[B0]")]
    assert b0 and "engine sglang or vllm" in b0[0] and "bf16" in b0[0] and "mxfp4" in b0[0], p.errors


def test_other_architectures_keep_every_format():
    for arch in ("DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert BUNDLED.formats_for(arch) == BUNDLED.checkpoint_formats
        for fmt in BUNDLED.checkpoint_formats:
            assert not bundled(fmt, arch=arch).errors, (arch, fmt)
    assert BUNDLED.formats_for(GPT_OSS) == ("bf16", "mxfp4")


@pytest.mark.parametrize("kw", [{"tp": 2}, {"ep": 2}, {"tp": 8, "ep": 8}])
def test_planner_accepts_sharded_gpt_oss(kw):
    """gpt-oss shards like the other families (moe_runtime.dist; test_gpt_oss_parallel): no [B6]."""
    p = bundled("mxfp4", **kw)
    assert not any(e.startswith("[B6]") for e in p.errors), p.errors
    assert not problems(GPT_OSS, "mxfp4", tp=kw.get("tp", 1), ep=kw.get("ep", 1))
    assert problems(GPT_OSS, "mxfp4", tp=2, ep=3)  # the layout rules of every architecture still apply


def test_an_explicit_backend_that_cannot_compute_gpt_oss_experts_is_refused():
    p = bundled("mxfp4", runner_backend="flashinfer_mxfp4")
    assert any(e.startswith("[B1]") and "does not compute GptOssForCausalLM's experts (swiglu_oai with biases)" in e
               for e in p.errors), p.errors
    assert not bundled("mxfp4", runner_backend="triton").errors
    assert bundled("mxfp4", runner_backend="torch").moe.runnerBackend == "torch"


def test_runtime_plan_check_agrees():
    from moe_runtime.plan_check import resolve

    p = bundled("mxfp4")
    r = resolve(json.loads(p.model_dump_json()), "sm90", "NVIDIA-H200", info("mxfp4"), {}, INSTALLED)
    assert r.backends == ["triton", "torch"] and r.expert_format == "mxfp4"
    assert (r.activation, r.bias) == ("swiglu_oai", True)  # what serve's self-test runs
    with pytest.raises(RuntimeFailure, match="GptOssForCausalLM fp8"):
        resolve(None, "sm90", "NVIDIA-H200", info("fp8"), {}, INSTALLED)
    with pytest.raises(RuntimeFailure, match="does not compute GptOssForCausalLM's experts"):
        resolve(None, "sm90", "NVIDIA-H200", info("mxfp4"), {"MOE_RUNNER_BACKEND": "flashinfer_mxfp4"},
                {**INSTALLED, "flashinfer-python": "0.6.15"})


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from moe_runtime.checkpoint_writer import make_checkpoint

    return {fmt: make_checkpoint(tmp_path_factory.mktemp(f"gpt_oss-{fmt}"), "gpt_oss", fmt, "tiny")
            for fmt in ("bf16", "mxfp4")}


def test_writer_gives_the_release_layout_and_refuses_other_formats(written, tmp_path):
    from safetensors import safe_open

    from moe_runtime.checkpoint_writer import make_checkpoint

    d = written["mxfp4"]
    got = inspect_dir(d)
    assert (got.architecture, got.format) == (GPT_OSS, "mxfp4")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    shapes = {}
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            shapes.update({k: (tuple(h.get_slice(k).get_shape()), h.get_slice(k).get_dtype()) for k in h.keys()})
    E, H, inter = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    m = "model.layers.0.mlp.experts."
    assert shapes[m + "gate_up_proj_blocks"] == ((E, 2 * inter, H // 32, 16), "U8")
    assert shapes[m + "gate_up_proj_scales"] == ((E, 2 * inter, H // 32), "U8")
    assert shapes[m + "down_proj_blocks"] == ((E, H, inter // 32, 16), "U8")
    assert shapes[m + "down_proj_bias"] == ((E, H), "BF16") and m + "gate_up_proj" not in shapes
    assert inspect_dir(written["bf16"]).format == "bf16"
    with pytest.raises(RuntimeFailure, match="not fp8"):
        make_checkpoint(tmp_path / "fp8", "gpt_oss", "fp8", "tiny")


def test_loader_refuses_what_the_table_refuses(written, tmp_path):
    from moe_runtime.loader import validate_checkpoint

    d = tmp_path / "relabeled"
    shutil.copytree(written["bf16"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    assert inspect_dir(d).format == "fp8"
    with pytest.raises(RuntimeFailure, match="unsupported checkpoint format 'fp8'.*bf16, mxfp4 for GptOssForCausalLM"):
        validate_checkpoint(d)
    from moe_runtime import serve
    from moe_runtime.dist import layout as parallel

    # serve --tp 2 on MXFP4 experts of intermediate 32 (one 32-block of down's input): TP inside the
    # experts cannot split it, refused before ranks spawn with what works; --ep 2 (whole experts) passes
    v = validate_checkpoint(written["mxfp4"])
    with pytest.raises(RuntimeFailure, match="intermediate_size 32 split 2 ways.*1 blocks.*use --ep 2"):
        serve._shard_plan(v, parallel.Layout(2, 1))
    assert serve._shard_plan(v, parallel.Layout(2, 2)).local_experts == 4


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_written_checkpoints_load_and_run(written, fmt):
    """The project's own tiny gpt-oss checkpoints (the capability walk in test_core_capabilities
    loads them too): bf16 and packed MXFP4 experts, a forward over the paged cache."""
    from moe_runtime.loader import build_model, load_checkpoint

    ck = load_checkpoint(written[fmt], "cpu", torch.bfloat16, log=lambda *a, **k: None)
    m = build_model(ck, None, False)
    assert m.layers[0].mlp.experts.weights.format == fmt
    m.allocate_kv(4, 8)
    logits = m(torch.arange(3, 23)[None], torch.arange(20)[None], torch.tensor([[3, 0, 2]]))
    assert logits.shape == (1, 20, 512) and torch.isfinite(logits).all()
