"""One test per branch of the two seed PRs (sglang #35919, #33618) plus the S/V/W/B rows."""

import pytest

from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import from_name
from moe_operator.planner import Choices, plan


def ckpt(arch="DeepseekV4ForCausalLM", fmt="dsv4_fp4", shared=1, experts=256):
    return CheckpointInfo(architecture=arch, format=fmt, formatSource="test", numExperts=experts,
                          numSharedExperts=shared, expertsFp4=fmt in ("dsv4_fp4", "nvfp4", "mxfp4"))


def sg(c, gpu, version=None, **kw):
    return plan(c, from_name(gpu), Choices(**kw), engine="sglang", engine_version=version)


def rules(p):
    return {d.rule for d in p.decisions}


# --- sglang PR #35919: DeepSeek-V4 FP4 experts -> flashinfer_mxfp4 -------------------------

@pytest.mark.parametrize("gpu", ["H200", "H100", "B200", "GB200", "rtx-pro-6000"])
def test_dsv4_fp4_auto_selects_flashinfer_mxfp4(gpu):
    p = sg(ckpt(), gpu)
    assert p.moe.runnerBackend == "flashinfer_mxfp4"
    assert "S2" in rules(p) and not p.errors
    assert p.args[:2] == ["--moe-runner-backend", "flashinfer_mxfp4"]
    assert any("Use flashinfer_mxfp4 as MoE runner backend for DeepseekV4ForCausalLM" in r for r in p.reasons)


def test_dsv4_explicit_choice_wins():
    p = sg(ckpt(), "H200", runner_backend="marlin")
    assert p.moe.runnerBackend == "marlin" and not p.errors
    assert [d.rule for d in p.decisions if d.key == "moe.runnerBackend"] == ["user"]


@pytest.mark.parametrize("a2a", ["deepep", "deepep_v2", "pplx"])
def test_dsv4_with_a2a_stays_auto(a2a):
    p = sg(ckpt(), "B200", a2a_backend=a2a, ep=8, tp=8, dp=8)
    assert p.moe.runnerBackend == "auto" and "S3" in rules(p)
    assert "--moe-a2a-backend" in p.args


def test_dsv4_flashinfer_mxfp4_with_a2a_is_rejected():
    p = sg(ckpt(), "B200", runner_backend="flashinfer_mxfp4", a2a_backend="deepep", ep=8, tp=8)
    assert any(e.startswith("[V2]") for e in p.errors)


def test_dsv4_rocm_not_selected():
    p = sg(ckpt(), "mi355x")
    assert p.moe.runnerBackend == "auto" and not p.errors
    p = sg(ckpt(), "mi300x")
    assert any("gfx942" in e for e in p.errors)


def test_dsv4_fp4_dequant_env_keeps_auto_and_rejects_explicit():
    p = sg(ckpt(), "H200", env={"SGLANG_DSV4_FP4_DEQUANT": "1"})
    assert p.moe.runnerBackend == "auto" and "S2d" in rules(p) and not p.errors
    assert p.env["SGLANG_DSV4_FP4_DEQUANT"] == "1"
    p = sg(ckpt(), "H200", env={"SGLANG_DSV4_FP4_DEQUANT": "1"}, runner_backend="flashinfer_mxfp4")
    assert any(e.startswith("[V4]") for e in p.errors)


def test_dsv4_fp8_experts_not_switched():
    p = sg(ckpt(fmt="dsv4_fp8"), "H200")
    assert p.moe.runnerBackend == "auto" and "S17" in rules(p)


@pytest.mark.parametrize("version", ["0.5.14", "0.5.17", "0.5.19", "0.5.21", "0.5.22", "0.5.23"])
@pytest.mark.parametrize("gpu", ["a100", "l40s", "thor"])
def test_dsv4_unsupported_arch_does_not_get_flashinfer_mxfp4(gpu, version):
    """This seed test used to expect marlin (S2b). The released code refuses it on SM80/SM89/SM110:
    Mxfp4MarlinMoEMethod.process_weights_after_loading raises "MXFP4 Marlin requires SM90 or SM120."
    (sglang/srt/layers/quantization/mxfp4_marlin_moe.py:117 in 0.5.14, :144 in 0.5.17, :146 in 0.5.19 and
    0.5.21, :152 in 0.5.22, :161 in 0.5.23), and auto takes FP8 Triton with the packed FP4 weights
    ('Hidden size mismatch', moe_runner/triton_utils/fused_moe.py:1118-1121 fused_experts_impl, 0.5.23).
    So auto refuses with what works instead, and never plans a runner sglang refuses at start-up."""
    p = sg(ckpt(), gpu, version=version)
    assert p.moe.runnerBackend != "marlin" and "flashinfer_mxfp4" not in p.args
    assert any(e.startswith("[S2b]") and "MXFP4 Marlin requires SM90 or SM120" in e and "Works instead" in e
               and "SGLANG_DSV4_FP4_DEQUANT=1" in e for e in p.errors)
    # the explicit marlin is refused by the engine row too
    p = sg(ckpt(), gpu, version=version, runner_backend="marlin")
    assert any("SG-FP4EXPERT-MARLIN" in e for e in p.errors)
    # with the dequant switch the experts are FP8 and auto stays auto (S2d)
    p = sg(ckpt(), gpu, version=version, env={"SGLANG_DSV4_FP4_DEQUANT": "1"})
    assert p.moe.runnerBackend == "auto" and not p.errors


def test_dsv4_hybrid_nvfp4_first_on_sm100_and_rejected_elsewhere():
    p = sg(ckpt(fmt="dsv4_nvfp4"), "B200")
    assert p.moe.runnerBackend == "flashinfer_trtllm_routed" and "S1" in rules(p)
    p = sg(ckpt(fmt="dsv4_nvfp4"), "H200")
    assert any(e.startswith("[K16]") and "MXFP4" in e for e in p.errors)


def test_dsv4_explicit_flashinfer_trtllm_rejected_with_reason():
    p = sg(ckpt(), "B200", runner_backend="flashinfer_trtllm")
    assert any(e.startswith("[V3]") and "flashinfer_mxfp4" in e for e in p.errors)


def test_dsv4_old_flashinfer_on_sm90_rejected():
    p = sg(ckpt(), "H200", flashinfer_version="0.6.7")
    assert any(e.startswith("[K17]") for e in p.errors)


# --- sglang PR #33618: deferred finalize for NVFP4 + flashinfer_trtllm -------------------------

DSV3_NVFP4 = dict(arch="DeepseekV3ForCausalLM", fmt="nvfp4")


def test_deferred_finalize_on_by_default_for_dsv3_nvfp4_on_b200():
    p = sg(ckpt(**DSV3_NVFP4), "B200")
    assert p.moe.runnerBackend == "flashinfer_trtllm" and p.moe.deferredFinalize is True
    assert "SGLANG_ENABLE_MOE_DEFERRED_FINALIZE" not in p.env  # engine default already on
    assert "--attention-backend" in p.args


def test_deferred_finalize_off_before_0_5_18():
    p = sg(ckpt(**DSV3_NVFP4), "B200", version="0.5.17")
    assert p.moe.deferredFinalize is False


def test_deferred_finalize_old_flashinfer_falls_back_with_env():
    p = sg(ckpt(**DSV3_NVFP4), "B200", flashinfer_version="0.6.14")
    assert p.moe.deferredFinalize is False
    assert p.env["SGLANG_ENABLE_MOE_DEFERRED_FINALIZE"] == "0" and "E4" in rules(p)


def test_deferred_finalize_explicit_on_is_validated():
    assert not sg(ckpt(**DSV3_NVFP4), "B200", deferred_finalize="on").errors
    p = sg(ckpt(**DSV3_NVFP4), "H200", deferred_finalize="on")  # marlin: no deferred path
    assert any(e.startswith("[DF1]") for e in p.errors)
    p = sg(ckpt(**DSV3_NVFP4), "B200", deferred_finalize="on", flashinfer_version="0.6.12")
    assert any(e.startswith("[K7]") for e in p.errors)


def test_deferred_finalize_needs_shared_expert_and_no_a2a():
    assert sg(ckpt(shared=0, **DSV3_NVFP4), "B200").moe.deferredFinalize is False


def test_deferred_finalize_user_env_wins():
    p = sg(ckpt(**DSV3_NVFP4), "B200", env={"SGLANG_ENABLE_MOE_DEFERRED_FINALIZE": "False"})
    assert p.moe.deferredFinalize is False and p.env["SGLANG_ENABLE_MOE_DEFERRED_FINALIZE"] == "False"


def test_deferred_finalize_off_writes_env():
    p = sg(ckpt(**DSV3_NVFP4), "B200", deferred_finalize="off")
    assert p.env["SGLANG_ENABLE_MOE_DEFERRED_FINALIZE"] == "0" and p.moe.deferredFinalize is False


# --- other S / V rows -------------------------------------------------------------------------

def test_s5_nvfp4_on_sm120_flashinfer_cutlass():
    assert sg(ckpt(**DSV3_NVFP4), "rtx-pro-6000").moe.runnerBackend == "flashinfer_cutlass"


def test_s6_nvfp4_on_hopper_marlin_and_v7_rejects_others():
    assert sg(ckpt(**DSV3_NVFP4), "H200").moe.runnerBackend == "marlin"
    p = sg(ckpt(**DSV3_NVFP4), "H200", runner_backend="triton")
    assert any(e.startswith("[V7]") for e in p.errors)


def test_v1_trtllm_off_sm100_rejected_with_alternatives():
    p = sg(ckpt(**DSV3_NVFP4), "rtx-pro-6000", runner_backend="flashinfer_trtllm")
    err = next(e for e in p.errors if e.startswith("[V1]"))
    assert "SM100" in err and "flashinfer_cutlass" in err


def test_s7_gpt_oss_per_gpu():
    c = ckpt(arch="GptOssForCausalLM", fmt="mxfp4", shared=0)
    assert sg(c, "B200").moe.runnerBackend == "flashinfer_mxfp4"
    assert sg(c, "H100").moe.runnerBackend == "triton_kernel"
    assert sg(c, "rtx-pro-6000").moe.runnerBackend == "flashinfer_mxfp4"
    assert sg(c, "rtx-pro-6000", version="0.5.15").moe.runnerBackend == "marlin"


def test_s9_qwen3_on_b200_and_unknown_runner_rejected():
    c = ckpt(arch="Qwen3MoeForCausalLM", fmt="fp8", shared=0)
    assert sg(c, "B200").moe.runnerBackend == "flashinfer_trtllm"
    assert sg(c, "H200").moe.runnerBackend == "auto"
    assert any(e.startswith("[V0]") for e in sg(c, "H200", runner_backend="no_such").errors)


def test_runner_not_in_old_release_rejected():
    p = sg(ckpt(**DSV3_NVFP4), "B200", version="0.5.18", runner_backend="flashinfer_megamoe")
    assert any(e.startswith("[V0b]") for e in p.errors)


def test_e2_cutlass_env_translated():
    p = sg(ckpt(arch="DeepseekV3ForCausalLM", fmt="fp8"), "H200", env={"SGLANG_CUTLASS_MOE": "1"})
    assert p.moe.runnerBackend == "cutlass" and "E2" in rules(p)


# --- vLLM W rows ------------------------------------------------------------------------------

def vl(c, gpu, version=None, **kw):
    return plan(c, from_name(gpu), Choices(**kw), engine="vllm", engine_version=version)


def test_w7_legacy_env_translated_on_new_vllm():
    p = vl(ckpt(**DSV3_NVFP4), "B200", env={"VLLM_USE_FLASHINFER_MOE_FP4": "1", "VLLM_FLASHINFER_MOE_BACKEND": "throughput"})
    assert p.moe.runnerBackend == "flashinfer_cutlass" and "--moe-backend" in p.args
    assert any(w.startswith("[W7]") for w in p.warnings)


def test_w5_env_form_on_old_vllm():
    p = vl(ckpt(**DSV3_NVFP4), "B200", version="0.11.0")
    assert p.env["VLLM_USE_FLASHINFER_MOE_FP4"] == "1" and "--moe-backend" not in p.args


def test_vllm_flag_form_and_k14():
    p = vl(ckpt(**DSV3_NVFP4), "B200", runner_backend="flashinfer_trtllm")
    assert p.args[:2] == ["--moe-backend", "flashinfer_trtllm"] and not p.errors
    assert any(e.startswith("[K14]") for e in vl(ckpt(**DSV3_NVFP4), "H200", runner_backend="flashinfer_trtllm").errors)


def test_k31_vllm_dsv4_nvfp4_on_sm120():
    assert any(e.startswith("[K31]") for e in vl(ckpt(fmt="dsv4_nvfp4"), "rtx-pro-6000").errors)


# --- bundled engine (from the kernel registry) -----------------------------------------------

def bd(c, gpu, **kw):
    return plan(c, from_name(gpu), Choices(**kw), engine="bundled")


def test_bundled_fp4_on_hopper_runs_triton_w4a16_with_deferred_finalize():
    p = bd(ckpt(**DSV3_NVFP4), "H200")
    assert p.moe.runnerBackend == "triton" and p.moe.deferredFinalize is True
    # plan.json is the only channel to the pod: no MOE_* env rendered for the runtime
    assert "MOE_RUNNER_BACKEND" not in p.env and "MOE_DEFERRED_FINALIZE" not in p.env


def test_bundled_blackwell_prefers_verified_triton_over_unverified_flashinfer():
    for gpu in ("B200", "rtx-pro-6000"):
        p = bd(ckpt(**DSV3_NVFP4), gpu)
        assert p.moe.runnerBackend == "triton" and not p.errors
        why = next(d.reason for d in p.decisions if d.key == "moe.runnerBackend")
        assert "flashinfer" in why and "unverified" not in why  # still a self-test fallback, after torch
    assert bd(ckpt(**DSV3_NVFP4), "B200", flashinfer_version="none").moe.runnerBackend == "triton"
    # an explicit unverified choice is kept (validated) and the reason says it is unverified
    p = bd(ckpt(**DSV3_NVFP4), "B200", runner_backend="flashinfer_trtllm")
    assert p.moe.runnerBackend == "flashinfer_trtllm" and not p.errors
    assert "unverified" in next(d.reason for d in p.decisions if d.key == "moe.runnerBackend")


def test_bundled_impossible_explicit_backend_says_what_works():
    p = bd(ckpt(**DSV3_NVFP4), "H200", runner_backend="flashinfer_trtllm")
    err = next(e for e in p.errors if e.startswith("[B1]"))
    assert "sm100" in err and "triton" in err and "torch" in err


def test_bundled_rejects_unloadable_format_and_a2a():
    assert any(e.startswith("[B0]") for e in bd(ckpt(fmt="w4afp8"), "H200").errors)
    assert any(e.startswith("[B5]") for e in bd(ckpt(**DSV3_NVFP4), "H200", a2a_backend="deepep", ep=8, tp=8).errors)


def test_user_env_always_wins():
    p = bd(ckpt(**DSV3_NVFP4), "H200", env={"MOE_RUNNER_BACKEND": "torch", "FOO": "1"})
    assert p.env["MOE_RUNNER_BACKEND"] == "torch" and p.env["FOO"] == "1"
    assert p.moe.runnerBackend == "torch" and p.env == {"MOE_RUNNER_BACKEND": "torch", "FOO": "1"}
