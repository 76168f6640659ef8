"""The planner never promises the bundled runtime what it cannot serve (issue 15, item 3).

A walk over the whole table, every architecture the planner knows x every checkpoint format:
- every (architecture, format) the bundled planner accepts: the project's checkpoint writer makes a
  tiny checkpoint of it, the checkpoint is classified as that pair, and the runtime loads it on CPU
  and runs a forward with finite logits;
- every one it refuses: the runtime refuses it too, in its plan check and, where a checkpoint can
  carry that pair, in its loader (before any weight data is read), and the planner's reason names
  what would work (engine sglang/vllm, or a format the runtime loads).
"""

import json
import os

import pytest
import torch

from moe_core.checkpoint import CheckpointInfo, inspect_dir
from moe_core.formats import FORMATS
from moe_core.gpu import from_name
from moe_core.runtime import BUNDLED
from moe_operator import planner
from moe_runtime.errors import RuntimeFailure

ARCHITECTURES = sorted(planner.DEEPSEEK_FAMILY | planner.QWEN3_FAMILY | {planner.DSV4, planner.GPT_OSS}
                       | {"Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "LlamaForCausalLM"} | set(BUNDLED.architectures))
PAIRS = [(a, f) for a in ARCHITECTURES for f in FORMATS]
INSTALLED = {"triton": "3.6.0", "flashinfer-python": None}

# config.json quantization_config (and extra config keys) that moe_core.checkpoint.classify reads as
# each format; tests/unit/core/test_checkpoint.py covers the classification itself
_MIXED = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
RECIPES = {
    "bf16": (None, {}),
    "fp8": ({"quant_method": "fp8", "weight_block_size": [128, 128]}, {}),
    "modelopt_fp8": ({"quant_method": "modelopt", "quant_algo": "FP8"}, {}),
    "mxfp8": ({"quant_method": "mxfp8"}, {}),
    "nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, {}),
    "ct_nvfp4": ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, {}),
    "mixed": ({**_MIXED, "quantized_layers": {"model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
                                              "model.layers.1.mlp.experts.0.up_proj": {"quant_algo": "NVFP4"}}}, {}),
    "mixed_w4a16": ({**_MIXED, "quantized_layers": {"model.layers.1.mlp.experts.0.up_proj":
                                                    {"quant_algo": "W4A16_NVFP4"}}}, {}),
    "w4afp8": ({"quant_method": "w4afp8"}, {}),
    "mxfp4": ({"quant_method": "mxfp4"}, {}),
    "ct_int4_g32": ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}}}, {}),
    "ct_mxfp4_pack": ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}, {}),
    "dsv4_fp4": ({"quant_method": "fp8", "routed_experts_quant_method": "mxfp4"}, {}),
    "dsv4_fp8": ({"quant_method": "fp8"}, {"expert_dtype": "fp8"}),
    "dsv4_nvfp4": ({"quant_method": "fp8", "moe_quant_algo": "NVFP4"}, {}),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}, {}),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, {}),
    "ct_wna16": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}}, {}),
    "other": ({"quant_method": "bitsandbytes"}, {}),
}


def test_recipes_cover_every_format():
    assert set(RECIPES) == set(FORMATS)


def bundled_plan(arch, fmt):
    info = CheckpointInfo(architecture=arch, format=fmt, formatSource="test", numExperts=8, numSharedExperts=1)
    return info, planner.plan(info, from_name("H200"), engine="bundled")


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def made(tmp_path_factory, one_thread):
    """The project's tiny checkpoints, made once per (runtime model module, format)."""
    from moe_runtime.checkpoint_writer import make_checkpoint

    cache = {}

    def get(module, fmt):
        if (module, fmt) not in cache:
            cache[module, fmt] = make_checkpoint(tmp_path_factory.mktemp("cap") / f"{module}-{fmt}", module, fmt, "tiny")
        return cache[module, fmt]
    return get


def relabeled(base, tmp_path, arch, fmt):
    """A checkpoint directory whose config.json says (arch, fmt); the weight shards are links to base's."""
    d = tmp_path / "relabeled"
    d.mkdir()
    for f in base.iterdir():
        if f.suffix == ".safetensors":
            os.symlink(f, d / f.name)
    cfg = json.loads((base / "config.json").read_text())
    cfg.pop("quantization_config", None)
    q, extra = RECIPES[fmt]
    cfg.update(extra, architectures=[arch])
    if q is not None:
        cfg["quantization_config"] = q
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def load_and_forward(d):
    from moe_kernels.reference import TorchExperts
    from moe_runtime.loader import build_model, load_checkpoint, validate_checkpoint

    ck = load_checkpoint(d, "cpu", torch.bfloat16, log=lambda *a, **k: None, validated=validate_checkpoint(d))
    model = build_model(ck, TorchExperts, deferred=True)
    model.allocate_kv(3, 2)
    ids = torch.tensor([[3, 4, 5, 6]])
    logits = model(ids, torch.arange(4)[None], torch.tensor([[2, 0]]))
    assert logits.shape == (1, 4, ck.config["vocab_size"]) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch,fmt", PAIRS, ids=[f"{a}-{f}" for a, f in PAIRS])
def test_bundled_planner_and_runtime_agree(arch, fmt, made, tmp_path):
    from moe_runtime.plan_check import resolve

    info, p = bundled_plan(arch, fmt)
    if not p.errors:
        # accepted: the runtime serves this architecture and the project can make and load such a checkpoint
        assert arch in BUNDLED.architectures, f"bundled plan accepted {arch}, which the runtime does not serve"
        module = BUNDLED.architectures[arch]
        d = made(module, fmt)  # raises for a format the writer (and so the loader) does not know
        got = inspect_dir(d)
        assert (got.architecture, got.format) == (arch, fmt)
        plan = json.loads(p.model_dump_json())
        r = resolve(plan, "sm90", "NVIDIA-H200", got, {}, INSTALLED)  # the planner's plan, re-checked on an H200
        assert r.backends[0] == p.moe.runnerBackend and r.deferred == p.moe.deferredFinalize
        assert resolve(None, "cpu", "cpu", got, {}, INSTALLED).backends == ["torch"]
        load_and_forward(d)
        return
    # refused: the reason names what works, and the runtime refuses it too
    joined = " ".join(p.errors)
    assert "engine sglang or vllm" in joined, p.errors
    if fmt not in BUNDLED.checkpoint_formats:
        assert any(f in joined for f in BUNDLED.checkpoint_formats), p.errors
    with pytest.raises(RuntimeFailure):
        resolve(None, "sm90", "NVIDIA-H200", info, {}, INSTALLED)
    from moe_runtime.loader import validate_checkpoint

    d = relabeled(made("deepseek_v3", "bf16"), tmp_path, arch, fmt)
    got = inspect_dir(d)
    if (got.architecture, got.format) == (arch, fmt):  # this pair can be written in a checkpoint
        with pytest.raises(RuntimeFailure, match="unsupported (architecture|checkpoint format)"):
            validate_checkpoint(d)


def test_every_served_pair_is_accepted():
    """The other direction: the planner does not refuse what the runtime serves."""
    for arch in BUNDLED.architectures:
        for fmt in BUNDLED.formats_for(arch):  # per architecture (gpt-oss: bf16, mxfp4)
            assert not bundled_plan(arch, fmt)[1].errors, (arch, fmt)


# (gpt-oss MXFP4 was refused here until the runtime served gpt-oss: tests/unit/operator/test_gpt_oss_capability.py)
@pytest.mark.parametrize("arch,fmt", [("DeepseekV3ForCausalLM", "modelopt_fp8"), ("DeepseekV3ForCausalLM", "mixed"),
                                      ("DeepseekV3ForCausalLM", "ct_nvfp4"), ("DeepseekV4ForCausalLM", "dsv4_fp4"),
                                      ("GptOssForCausalLM", "fp8")])
def test_issue_examples_are_refused_with_what_works(arch, fmt):
    _, p = bundled_plan(arch, fmt)
    assert p.errors and all("engine sglang or vllm" in e for e in p.errors if e[:4] in ("[B0]", "[B8]"))
    assert any(e.startswith("[B0]") for e in p.errors)
    if arch == "GptOssForCausalLM":
        assert any("in bf16 or mxfp4" in e for e in p.errors), p.errors
    if fmt in ("modelopt_fp8", "mixed", "ct_nvfp4"):
        want = {"modelopt_fp8": "fp8", "mixed": "nvfp4", "ct_nvfp4": "nvfp4"}[fmt]
        assert any(f"a checkpoint of the model in {want}" in e for e in p.errors), p.errors


def test_no_sample_puts_on_the_bundled_engine_what_the_runtime_cannot_serve():
    """`make demo` applies every sample: none may ask the bundled runtime for an architecture or a
    format it cannot serve (the gpt-oss sample did, and its pod would have exited at start)."""
    from pathlib import Path

    import yaml

    from moe_core.runtime import problems
    from moe_operator.api import MoEDeploymentSpec

    root = Path(__file__).resolve().parents[3] / "deploy" / "samples"
    bundled = []
    for f in sorted((root / "demo").glob("*.yaml")):  # what `make demo` applies
        spec = MoEDeploymentSpec.model_validate(yaml.safe_load(f.read_text())["spec"])
        info = inspect_dir(root / "checkpoints" / spec.model.uri.rsplit("/", 1)[1])
        if spec.engine.name == "bundled":
            bundled.append(f.name)
            assert problems(info.architecture, info.format) == [], f.name
        elif info.architecture not in BUNDLED.architectures:
            assert problems(info.architecture, info.format)  # and the bundled planner would refuse it
