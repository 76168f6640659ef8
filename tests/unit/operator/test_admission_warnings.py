"""Admission warnings where `auto` falls back (issue 16 item 3): pure functions, plan in -> warnings out.

planner.auto_fallbacks(plan) names the automatic choices made because the preferred path is not
available for the format on that GPU (or in that release / image); webhook.auto_warnings(plans)
combines one spec's plans on the GPU classes it may be placed on, with the classes it cannot run on.
"""

import pytest

from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import from_name, from_node_labels
from moe_operator.inventory import NodeInfo
from moe_operator.planner import FALLBACKS, Choices, auto_fallbacks, plan
from moe_operator.policy import Policy
from moe_operator.reconcile import Config
from moe_operator.sample_checkpoints import write_sample
from moe_operator.webhook import WARNING_CHARS, admission_handler, auto_warnings, candidate_classes, fallback_warnings

DSV3_NVFP4 = CheckpointInfo(architecture="DeepseekV3ForCausalLM", format="nvfp4", formatSource="test", numExperts=256,
                            numSharedExperts=1, expertsFp4=True)
DSV4_FP4 = CheckpointInfo(architecture="DeepseekV4ForCausalLM", format="dsv4_fp4", formatSource="test", numExperts=256,
                          numSharedExperts=1, expertsFp4=True)
GPTOSS_BF16 = CheckpointInfo(architecture="GptOssForCausalLM", format="bf16", formatSource="test", numExperts=128)


def sg(ck, gpu, **kw):
    version = kw.pop("version", None)
    return plan(ck, gpu if not isinstance(gpu, str) else from_name(gpu), Choices(**kw), engine="sglang",
                engine_version=version)


@pytest.mark.parametrize("gpu", ["A100", "L40S", "H200"])
def test_nvfp4_before_blackwell_falls_back_to_marlin_w4a16(gpu):
    [w] = auto_fallbacks(sg(DSV3_NVFP4, gpu))
    assert w.startswith("[S6] moe.runnerBackend=marlin:") and "W4A16" in w


def test_preferred_path_is_no_fallback():
    assert auto_fallbacks(sg(DSV3_NVFP4, "B200")) == []           # S4 flashinfer_trtllm, deferred finalize on
    assert auto_fallbacks(sg(DSV4_FP4, "H200")) == []             # S2 flashinfer_mxfp4


def test_explicit_values_are_never_fallbacks():
    p = sg(DSV3_NVFP4, "H200", runner_backend="marlin")
    assert not p.errors and auto_fallbacks(p) == []


def test_deferred_finalize_off_for_an_old_flashinfer_is_a_fallback():
    [w] = auto_fallbacks(sg(DSV3_NVFP4, "B200", flashinfer_version="0.6.7"))
    assert w.startswith("[E4] env.SGLANG_ENABLE_MOE_DEFERRED_FINALIZE=0") and "flashinfer#3595" in w
    # the user's own env value is theirs, not a fallback
    assert auto_fallbacks(sg(DSV3_NVFP4, "B200", flashinfer_version="0.6.7",
                             env={"SGLANG_ENABLE_MOE_DEFERRED_FINALIZE": "0"})) == []


def test_gpt_oss_on_blackwell_with_driver_595_falls_back_to_triton():
    b200 = from_name("B200").model_copy(update={"driverMajor": 595})
    [w] = auto_fallbacks(sg(GPTOSS_BF16, b200))
    assert w.startswith("[S8] moe.runnerBackend=triton:") and "595" in w


def test_gpt_oss_sm12x_before_flashinfer_mxfp4_existed():
    gptoss = GPTOSS_BF16.model_copy(update={"format": "mxfp4", "expertsFp4": True})
    assert auto_fallbacks(sg(gptoss, "rtx-pro-6000", version="0.5.23")) == []          # flashinfer_mxfp4
    [w] = auto_fallbacks(sg(gptoss, "rtx-pro-6000", version="0.5.14"))
    assert w.startswith("[S7b] moe.runnerBackend=marlin:")


def test_a_plan_with_errors_has_no_fallbacks():
    p = sg(DSV4_FP4, "A100")
    assert p.errors and auto_fallbacks(p) == []


def test_every_fallback_row_is_a_planner_row():
    from moe_operator.planner import SGLANG_SELECT, VLLM_SELECT
    ids = {r.id for r in SGLANG_SELECT + VLLM_SELECT} | {"E4"}
    assert set(FALLBACKS) <= ids


# ---- one spec on its GPU classes -----------------------------------------------------------

def test_warnings_per_class_with_the_classes_it_cannot_run_on():
    plans = {g.key(): sg(DSV4_FP4, g) for g in (from_name("A100"), from_name("H200"))}
    ws = auto_warnings(plans)
    assert len(ws) == 1 and ws[0].startswith("cannot run on sm80/NVIDIA-A100") and "placement skips it" in ws[0]
    assert "[S2b]" in ws[0] and len(ws[0]) <= WARNING_CHARS
    a100 = from_name("A100").key()
    only = auto_warnings({a100: plans[a100]})
    assert "it will not be placed" in only[0]
    ws = auto_warnings({g: sg(DSV3_NVFP4, g) for g in ("H200", "B200")})
    assert len(ws) == 1 and ws[0].startswith("auto on H200 falls back: [S6]")


def test_warnings_stay_short_and_few():
    plans = {f"class-{i}": sg(DSV4_FP4, "A100") for i in range(30)}
    ws = auto_warnings(plans)
    assert len(ws) == 10 and ws[-1].startswith("21 more") and all(len(w) <= WARNING_CHARS for w in ws)
    assert all(w.isascii() and w.isprintable() for w in ws)


def _node(name, product, major, minor):
    facts = from_node_labels({"nvidia.com/gpu.product": product, "nvidia.com/gpu.compute.major": str(major),
                              "nvidia.com/gpu.compute.minor": str(minor), "nvidia.com/gpu.count": "8"})
    return NodeInfo(name=name, gpu_class=facts.gpu_class, reason="", allocatable=8, schedulable=True)


def _spec(**gpu):
    from moe_operator.api import MoEDeploymentSpec
    return MoEDeploymentSpec.model_validate({"model": {"uri": "file:///models/x"}, "engine": {"name": "sglang"},
                                             "gpu": gpu})


def test_candidate_classes_are_the_clusters_allowed_ones_else_the_allowed_families():
    nodes = [_node("h", "NVIDIA-H200", 9, 0), _node("b", "NVIDIA-B200", 10, 0)]
    assert sorted(g.family for g in candidate_classes(_spec(), nodes).values()) == ["sm100", "sm90"]
    assert [g.family for g in candidate_classes(_spec(allowedArchitectures=["sm90"]), nodes).values()] == ["sm90"]
    # nothing in the cluster is allowed (or no nodes yet): the allowed families themselves
    assert [g.family for g in candidate_classes(_spec(allowedArchitectures=["sm80"]), nodes).values()] == ["sm80"]
    assert [g.product for g in candidate_classes(_spec(product="NVIDIA-A100-SXM4-80GB"), []).values()] \
        == ["NVIDIA-A100-SXM4-80GB"]
    assert candidate_classes(_spec(), []) == {}  # no nodes, no constraint: nothing to warn about


@pytest.fixture
def models(tmp_path):
    write_sample("deepseek-v4-flash-fp4", tmp_path / "dsv4")
    write_sample("deepseek-v3-nvfp4", tmp_path / "dsv3")
    return tmp_path


def _doc(uri, **gpu):
    return {"model": {"uri": uri}, "engine": {"name": "sglang"}, "gpu": gpu}


def test_fallback_warnings_from_a_file_checkpoint(models):
    cfg = Config(local_models_dir=str(models), policy=Policy(allowed_host_paths=("/models",)))
    ws = fallback_warnings(_doc("file:///models/dsv3", allowedArchitectures=["sm90", "sm100"]), cfg)
    assert len(ws) == 1 and ws[0].startswith("auto on sm90/") and "[S6]" in ws[0]
    ws = fallback_warnings(_doc("file:///models/dsv4", allowedArchitectures=["sm80", "sm90"]), cfg)
    assert len(ws) == 1 and ws[0].startswith("cannot run on sm80/") and "[S2b]" in ws[0]
    # a first hf:// model is not inspected at admission: no warnings, no network call
    assert fallback_warnings(_doc("hf://deepseek-ai/DeepSeek-V4-Flash", allowedArchitectures=["sm80"]), cfg) == []


def test_the_handler_adds_warnings_to_an_admitted_object_and_refuses_an_impossible_one(models):
    import kopf
    cfg = Config(local_models_dir=str(models), policy=Policy(allowed_host_paths=("/models",)))
    handler = admission_handler(cfg)
    warnings: list[str] = []
    nodes = {"h": [_node("h", "NVIDIA-H200", 9, 0)], "b": [_node("b", "NVIDIA-B200", 10, 0)]}
    handler(spec=_doc("file:///models/dsv3"), warnings=warnings, gpu_nodes=nodes)
    assert len(warnings) == 1 and warnings[0].startswith("auto on sm90/NVIDIA-H200 falls back: [S6]")
    warnings.clear()
    with pytest.raises(kopf.AdmissionError):
        handler(spec={**_doc("file:///models/dsv4", allowedArchitectures=["sm80"]),
                      "moe": {"runnerBackend": "marlin"}}, warnings=warnings, gpu_nodes=nodes)
    assert warnings == []


def test_a_layout_sglang_refuses_is_a_warning_when_the_runner_is_auto(tmp_path):
    """Qwen3-235B-FP8 (moe_intermediate_size 1536, weight_block_size [128, 128]) at tp 8: sglang's
    check_quantized_moe_compatibility refuses it on every class (K40); with the runner at auto the object is
    admitted, and the warning says it will not be placed and which tp/ep would be."""
    write_sample("qwen3-moe-235b-fp8", tmp_path / "q")
    cfg = Config(local_models_dir=str(tmp_path), policy=Policy(allowed_host_paths=("/models",)))
    doc = {**_doc("file:///models/q", allowedArchitectures=["sm90"]), "parallelism": {"tp": 8}}
    [w] = fallback_warnings(doc, cfg)
    assert w.startswith("cannot run on sm90/") and "[K40]" in w and "it will not be placed" in w
    assert fallback_warnings({**doc, "parallelism": {"tp": 8, "ep": 2}}, cfg) == []
