"""sglang's selection rows (S*, K16/K17), validate rows (V*, K*), MoE and attention split rules (K40, K41), env
rows (E*, deferred finalize) and the command-line flags of a plan (tuning-rules.md 6.1, 6.2). Pure."""

from __future__ import annotations

from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import BLACKWELL
from moe_core.plan import PlanMoE

from ... import engine_rules
from . import quant
from .startup import fi_mxfp4_cutlass_misaligned, moe_tp_size
from ...selection import Builder, Check, Facts, Select, choose_runner, fits_tps, heads_problem, run_checks, truthy, vtuple
from ..archs import DSV4, GPT_OSS
from .vocab import DEEPSEEK_FAMILY, FLASHINFER_PIN, NAME, QWEN3_FAMILY, RUNNERS

RUNNER_FLAG = "--moe-runner-backend"


def _gpt_oss_sm12x(f: Facts) -> str:
    if f.ver >= (0, 5, 17):
        return "flashinfer_mxfp4"
    return "marlin" if f.ver >= (0, 5, 14) else "triton_kernel"


def _dsv4_fi_misaligned(f: Facts) -> str | None:
    return fi_mxfp4_cutlass_misaligned(f.fam, f.version, f.ckpt.hiddenSize, f.ckpt.moeIntermediateSize,
                                       moe_tp_size(f.choices.tp, f.choices.ep, f.a2a))



SELECT: tuple[Select, ...] = (
    Select("S1", lambda f: f.arch == DSV4 and f.fmt == "dsv4_nvfp4" and f.fam == "sm100",
           "flashinfer_trtllm_routed",
           "Hybrid FP8+NVFP4 DeepSeek-V4 checkpoint on {gpu}: routed TRT-LLM NVFP4 MoE (sglang >=0.5.14 default)"),
    Select("K16", lambda f: f.arch == DSV4 and f.fmt == "dsv4_nvfp4" and f.fam != "sm100", None,
           "NVFP4 DeepSeek-V4 (hybrid FP8+NVFP4) needs B200/GB200/B300/GB300 (SM100): sglang picks "
           "flashinfer_trtllm_routed without an architecture check and it fails on {gpu}; use the MXFP4 "
           "(FP4-expert) DeepSeek-V4 checkpoint on Hopper/RTX-Blackwell"),
    Select("S3", lambda f: f.arch == DSV4 and f.fmt == "dsv4_fp4" and f.a2a in ("deepep", "deepep_v2", "pplx", "megamoe"),
           "auto", "DeepSeek-V4 FP4 experts with expert-parallel A2A ({a2a}) use DeepGEMM; flashinfer_mxfp4 has no A2A path"),
    Select("S2d", lambda f: f.arch == DSV4 and f.fmt == "dsv4_fp4" and truthy(f.env("SGLANG_DSV4_FP4_DEQUANT")),
           "auto", "SGLANG_DSV4_FP4_DEQUANT=1 dequantizes the FP4 experts to FP8 at load: runner stays auto (FP8 path)"),
    Select("K17", lambda f: f.arch == DSV4 and f.fmt == "dsv4_fp4" and not f.rocm and f.a2a == "none"
           and f.fam == "sm90" and f.fi_below("0.6.11"), None,
           "flashinfer_mxfp4 on SM90 needs FlashInfer >= 0.6.11 (interleave helpers, flashinfer#3084); "
           "this image has {fi}: use sglang >= 0.5.14 or set moe.runnerBackend=marlin"),
    # S2e: the SM90/SM12x FlashInfer CUTLASS MXFP4 method needs 128-aligned hidden and per-rank intermediate
    # sizes (mxfp4_flashinfer_cutlass_moe.py:67-74 create_weights, 0.5.23); sglang's own override would still
    # pick flashinfer_mxfp4 (model_overrides/deepseek_v4.py:75-89) and fail. Marlin pads both
    # (Mxfp4MarlinMoEMethod.create_weights: hidden round_up 256, intermediate round_up 128 off SM90 and
    # tile padding in the Hopper repack, mxfp4_marlin_moe.py:83-90 and check_moe_marlin_supports_layer(...,
    # allow_tile_padding=True), 0.5.23) and runs on SM90/SM120 (:160).
    # Without FlashInfer in the image flashinfer_mxfp4 cannot load either (SG-FI-ABSENT), and sglang's override
    # picks it regardless (deepseek_v4.py:75-89 has no is_flashinfer_available check): marlin on SM90/SM12x,
    # a refusal on SM100 (S2f), where marlin raises (mxfp4_marlin_moe.py:160).
    Select("S2e", lambda f: f.arch == DSV4 and f.fmt == "dsv4_fp4" and not f.rocm and f.a2a == "none"
           and f.fam in ("sm90", "sm120", "sm121") and f.ver >= (0, 5, 14)
           and (_dsv4_fi_misaligned(f) is not None or f.choices.flashinfer_version == "none"),
           "marlin", "DeepSeek-V4 FP4 experts on {gpu}: flashinfer_mxfp4 cannot run this layout ({shape}; the CUTLASS "
           "method needs hidden and per-rank intermediate sizes that are multiples of 128, "
           "mxfp4_flashinfer_cutlass_moe.py:67-74, sglang 0.5.23): Marlin W4A16 runs it",
           fields=lambda f: {"shape": _dsv4_fi_misaligned(f) or "the image has no FlashInfer"}),
    Select("S2f", lambda f: f.arch == DSV4 and f.fmt == "dsv4_fp4" and not f.rocm and f.a2a == "none"
           and f.fam == "sm100" and f.choices.flashinfer_version == "none", None,
           "DeepSeek-V4 FP4 experts on {gpu} need FlashInfer (flashinfer_mxfp4, TRT-LLM) and the image has none "
           "(engine.flashinferVersion none); marlin raises 'MXFP4 Marlin requires SM90 or SM120.' "
           "(mxfp4_marlin_moe.py:160, sglang 0.5.23). Works instead: an image with FlashInfer (the sglang image's pin), "
           "or SGLANG_DSV4_FP4_DEQUANT=1 (FP8 experts, twice the expert memory)"),
    Select("S2", lambda f: f.arch == DSV4 and f.fmt == "dsv4_fp4" and not f.rocm and f.a2a == "none"
           and f.fam in ("sm90", "sm100", "sm120", "sm121"),
           "flashinfer_mxfp4",
           "Use flashinfer_mxfp4 as MoE runner backend for DeepseekV4ForCausalLM: MXFP4 experts -> FlashInfer "
           "MXFP4 MoE (TRT-LLM on SM100, CUTLASS MXFP8xMXFP4 on SM120, CUTLASS W4A16 on SM90) on {gpu}; sglang PR #35919"),
    # S2b used to pick marlin here. sglang refuses that: Mxfp4MarlinMoEMethod.process_weights_after_loading
    # raises "MXFP4 Marlin requires SM90 or SM120." unless is_sm90/is_sm120 (major 9 / 12):
    # sglang/srt/layers/quantization/mxfp4_marlin_moe.py:116-117 in 0.5.14 (utils/common.py:276-296
    # is_sm90_supported/is_sm120_supported), :160-161 in 0.5.23 (get_platform().is_sm90/is_sm120); the runner
    # does not exist before 0.5.14. Left at auto, Fp8Config.get_quant_method keeps Fp8MoEMethod
    # (fp8.py:445-475, 0.5.23), whose create_moe_runner takes triton below SM90 (fp8.py:2962-2972) and
    # get_triton_quant_info passes the packed FP4 weights as use_fp8_w8a8 (fp8.py:3018-3038), so
    # fused_experts_impl asserts "Hidden size mismatch" (moe_runner/triton_utils/fused_moe.py:1118-1121).
    # The deepseek_v4 override sets flashinfer_mxfp4 only on SM90/SM100/SM120
    # (arg_groups/model_overrides/deepseek_v4.py:67-89). No automatic runner serves FP4 experts here.
    Select("S2b", lambda f: f.arch == DSV4 and f.fmt == "dsv4_fp4" and not f.rocm and f.a2a == "none"
           and f.fam in ("sm80", "sm89", "sm110"),
           None, "DeepSeek-V4 FP4 (MXFP4) experts cannot run on {gpu} with sglang {version}: flashinfer_mxfp4 needs "
           "SM90/SM100/SM120, marlin raises 'MXFP4 Marlin requires SM90 or SM120.' "
           "(srt/layers/quantization/mxfp4_marlin_moe.py:160 Mxfp4MarlinMoEMethod.process_weights_after_loading, "
           "sglang 0.5.14-0.5.23) and auto runs the packed FP4 weights on FP8 Triton ('Hidden size mismatch', "
           "moe_runner/triton_utils/fused_moe.py:1118 fused_experts_impl). Works instead: SM90/SM100/SM120 GPUs "
           "(H100/H200, B200/GB200, RTX PRO 6000) where auto picks flashinfer_mxfp4, or env "
           "SGLANG_DSV4_FP4_DEQUANT=1 (sglang dequantizes the experts to FP8 at load, twice the expert memory; "
           "not verified on {gpu})"),
    Select("S15", lambda f: f.fmt == "nvfp4" and f.a2a == "deepep", "flashinfer_cutedsl",
           "Only the CuTeDSL NVFP4 runner has a DeepEP (low-latency) path",
           args=lambda f: ["--deepep-mode", "low_latency"]),
    Select("S4", lambda f: f.arch in DEEPSEEK_FAMILY and f.arch != "LongcatFlashForCausalLM" and f.fam == "sm100"
           and f.a2a in ("none", "flashinfer") and f.fmt in ("fp8", "modelopt_fp8", "nvfp4", "mixed", "bf16", "ct_int4_g32"),
           "flashinfer_trtllm", "Blackwell SM100: TRT-LLM-gen fused MoE for DeepSeek-family {fmt} checkpoints on {gpu}",
           args=lambda f: ["--attention-backend", "trtllm_mla"] if f.arch == "DeepseekV3ForCausalLM" else []),
    Select("S5", lambda f: f.fmt == "nvfp4" and f.fam in ("sm110", "sm120", "sm121"), "flashinfer_cutlass",
           "NVFP4 on SM110/SM12x ({gpu}): trtllm-gen MoE kernels are SM100-only -> FlashInfer CUTLASS"),
    Select("S5b", lambda f: f.fmt == "ct_nvfp4" and f.fam in BLACKWELL, "auto",
           "compressed-tensors NVFP4 MoE: auto already uses FlashInfer CUTLASS inside the scheme "
           "(sglang rejects an explicit flashinfer_cutlass for compressed-tensors)"),
    Select("S5c", lambda f: f.fmt == "ct_nvfp4" and f.fam not in BLACKWELL, None,
           "compressed-tensors NVFP4 MoE is Blackwell-only ('Current platform does not support NVFP4 quantization. "
           "Please use Blackwell and above.'); {gpu} cannot run it"),
    Select("S6", lambda f: f.fmt == "nvfp4" and f.fam in ("sm80", "sm89", "sm90"), "marlin",
           "No FP4 tensor cores before Blackwell ({gpu}): NVFP4 runs weight-only (W4A16) on Marlin"),
    Select("V8", lambda f: f.fmt in ("mxfp4", "ct_mxfp4_pack", "dsv4_fp4") and f.fam == "gfx942", None,
           "MXFP4 is not supported on {gpu} ('Current platform gfx942 not support mxfp4 computation'); use MI350X/MI355X (gfx950) or an FP8 checkpoint"),
    Select("S7a", lambda f: f.arch == GPT_OSS and f.fmt == "mxfp4" and f.fam == "sm100", "flashinfer_mxfp4",
           "GPT-OSS MXFP4: flashinfer_mxfp4 is the sglang default for {gpu}"),
    Select("S7b", lambda f: f.arch == GPT_OSS and f.fmt == "mxfp4" and f.fam in ("sm120", "sm121"), _gpt_oss_sm12x,
           "GPT-OSS MXFP4: {value} is the sglang {version} default for {gpu}"),
    Select("S7c", lambda f: f.arch == GPT_OSS and f.fmt == "mxfp4" and f.fam == "sm90" and f.choices.ep == 1,
           "triton_kernel", "GPT-OSS MXFP4 on Hopper ({gpu}), ep=1: OpenAI triton_kernels (bf16 x mxfp4) is the sglang default"),
    Select("S7d", lambda f: f.arch == GPT_OSS and f.fmt == "mxfp4" and f.fam == "gfx950", "auto",
           "GPT-OSS MXFP4 on ROCm gfx950: auto resolves to aiter MXFP4 (needs SGLANG_USE_AITER=1)"),
    Select("S8", lambda f: f.arch == GPT_OSS and f.fmt == "bf16" and f.fam in BLACKWELL and (f.gpu.driverMajor or 0) >= 595,
           "triton", "triton_kernels segfaults on Blackwell with NVIDIA driver >= 595"),
    Select("S9", lambda f: f.arch in QWEN3_FAMILY and f.fam == "sm100" and f.a2a in ("none", "flashinfer")
           and f.fmt in ("mixed_w4a16", "fp8", "modelopt_fp8", "nvfp4", "mixed", "bf16"),
           lambda f: "marlin" if f.fmt == "mixed_w4a16" else "flashinfer_trtllm",
           "Qwen3-family MoE on SM100 ({gpu}) -> TRT-LLM-gen MoE (W4A16 NVFP4 experts -> Marlin)"),
    Select("S10", lambda f: f.arch == "Glm4MoeForCausalLM" and f.fam == "sm100" and f.a2a in ("none", "flashinfer")
           and f.fmt in ("nvfp4", "bf16"), "flashinfer_trtllm", "GLM-4.x MoE NVFP4/BF16 on SM100 -> TRT-LLM-gen MoE"),
    Select("S11", lambda f: f.arch == "KimiK3ForConditionalGeneration" and f.fmt == "ct_mxfp4_pack"
           and f.gpu.computeCapability in ("10.0", "10.3", "10.7"), "flashinfer_mxfp4",
           "Kimi-K3 MXFP4 on SM100/103/107 -> FlashInfer trtllm-gen MXFP4"),
    Select("S12a", lambda f: f.arch == "MiniMaxM2ForCausalLM" and f.fmt == "nvfp4" and f.fam == "sm100",
           "flashinfer_trtllm_routed", "sglang per-model default for {arch} on {gpu}"),
    Select("S12b", lambda f: f.arch.startswith("Llama4") and f.fmt in ("fp8", "modelopt_fp8") and f.fam == "sm100",
           "flashinfer_trtllm", "sglang per-model default for {arch} on {gpu}"),
    Select("S13", lambda f: f.fmt == "mxfp8" and f.fam in ("sm100", "gfx950"),
           lambda f: "triton" if f.rocm else "flashinfer_trtllm", "MXFP8 MoE default runner on {gpu}"),
    Select("S14", lambda f: f.fmt in ("fp8", "modelopt_fp8") and f.a2a in ("deepep", "mooncake", "nixl")
           and f.fam in ("sm90", "sm100"), "auto", "FP8 with expert-parallel A2A ({a2a}) uses DeepGEMM (auto)"),
    Select("S17", lambda f: True, "auto", "no tuning rule for {arch} {fmt} on {gpu}: sglang auto decides at load"),
)

_SM100_ONLY_RUNNERS = ("flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutedsl", "flashinfer_megamoe")

CHECKS: tuple[Check, ...] = (
    Check("V0", lambda f, r: r not in RUNNERS, "reject",
          "unknown sglang --moe-runner-backend {value}; valid values: " + ", ".join(RUNNERS)),
    Check("V0b", lambda f, r: r in RUNNERS and f.ver < vtuple(RUNNERS[r]), "reject",
          "--moe-runner-backend {value} does not exist in sglang {version} (first in a later release)"),
    Check("V1", lambda f, r: r in _SM100_ONLY_RUNNERS and f.fam != "sm100", "reject",
          "{value}: trtllm-gen / CuTeDSL MoE kernels require SM100-family (B200/GB200/B300/GB300), not {gpu}; "
          "use flashinfer_cutlass (NVFP4 on SM120), flashinfer_mxfp4 (MXFP4) or marlin/triton/deep_gemm"),
    Check("V2", lambda f, r: r == "flashinfer_mxfp4" and (f.fam not in ("sm90", "sm100", "sm120", "sm121") or f.a2a != "none"),
          "reject", "flashinfer_mxfp4 supports SM90/SM100/SM120 with --moe-a2a-backend none only (here {gpu}, a2a {a2a}); use marlin"),
    Check("V3", lambda f, r: f.fmt == "dsv4_fp4" and r == "flashinfer_trtllm", "reject",
          "flashinfer_trtllm is an FP8/NVFP4 runner; DeepSeek-V4 MXFP4 experts need flashinfer_mxfp4 "
          "(or marlin / deep_gemm with DeepEP)"),
    Check("V4", lambda f, r: truthy(f.env("SGLANG_DSV4_FP4_DEQUANT")) and r != "auto", "reject",
          "SGLANG_DSV4_FP4_DEQUANT=1 requires --moe-runner-backend auto ('{value} is not compatible with SGLANG_DSV4_FP4_DEQUANT=1')"),
    Check("V5", lambda f, r: f.a2a == "deepep" and r in ("flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutlass",
                                                       "flashinfer_mxfp4", "triton", "triton_kernel", "marlin"),
          "reject", "{value} has no DeepEP dispatch path; use deep_gemm (FP8/DSV4-FP4), flashinfer_cutedsl (NVFP4, low_latency) or humming"),
    Check("V7", lambda f, r: f.fmt == "nvfp4" and f.fam in ("sm80", "sm89", "sm90") and r not in ("marlin", "auto"), "reject",
          "Current platform does not support NVFP4 quantization with the selected MoE backend ({value} on {gpu}). "
          "Please use Blackwell and above, or use moe_runner_backend=marlin on SM80+."),
    Check("V8b", lambda f, r: f.fmt == "ct_nvfp4" and r == "flashinfer_cutlass", "reject",
          "Invalid quantization 'compressed-tensors' for FlashInfer Cutlass MOE; leave the runner at auto"),
    Check("K13", lambda f, r: r == "triton_kernel" and f.arch == GPT_OSS and f.fam in BLACKWELL and (f.gpu.driverMajor or 0) >= 595,
          "reject", "triton_kernels segfaults on Blackwell with NVIDIA driver >= 595; use triton"),
    Check("K17", lambda f, r: r == "flashinfer_mxfp4" and f.fam == "sm90" and f.fi_below("0.6.11"), "reject",
          "moe_runner_backend=flashinfer_mxfp4 on SM90 requires FlashInfer >= 0.6.11 (this image: {fi})"),
    Check("K22", lambda f, r: r == "cutlass" and f.fmt in ("fp8", "mxfp8", "modelopt_fp8") and f.choices.ep > 1, "reject",
          "FP8/MXFP8 Cutlass MoE is only supported with ep_size == 1"),
    Check("K23", lambda f, r: r == "flashinfer_cutlass" and f.fmt not in ("nvfp4", "modelopt_fp8", "mixed", "bf16"), "reject",
          "Invalid quantization '{fmt}'. FlashInfer Cutlass MOE supports only: modelopt_fp4, modelopt_fp8, modelopt_mixed, bf16"),
    Check("VR", lambda f, r: f.rocm and r.startswith("flashinfer"), "reject",
          "{value} is a CUDA (FlashInfer) runner; {gpu} is ROCm: use auto (aiter) or triton"),
    Check("K25", lambda f, r: f.a2a == "flashinfer" and f.choices.dp != f.choices.tp, "reject",
          "Flashinfer MoE A2A requires --attn-dp-size equal to --tp-size"),
    # K28: SGLANG_DEEPEP_MODE is not an sglang setting: no release read (0.5.10-0.5.23) has it in srt/environ.py or
    # anywhere in the package; the mode is the --deepep-mode argument (srt/arg_groups/fields/exec_.py:898-901, 0.5.23).
    Check("K28", lambda f, r: f.env("SGLANG_DEEPEP_MODE") is not None, "warn",
          "SGLANG_DEEPEP_MODE is not read by sglang (no such environment variable in 0.5.10-0.5.23); the DeepEP mode "
          "is --deepep-mode, which the planner sets only to low_latency for flashinfer_cutedsl (S15/S15b)"),
    # GPTQ / AWQ / compressed-tensors WNA16 MoE paths (engines/sglang/quant.py, sglang 0.5.23)
    *quant.CHECKS,
)



def passes_over(f: Facts, value: str | None) -> bool:
    """FI0: a FlashInfer runner for an sglang image without FlashInfer (engine.flashinferVersion none) is one sglang
    refuses (engine row SG-FI-ABSENT): such a select row is passed over, the next one decides."""
    return (f.choices.flashinfer_version == "none" and isinstance(value, str)
            and value.startswith("flashinfer"))



def _deepseek_shared_unfused(f: Facts) -> bool:
    return f.arch in DEEPSEEK_FAMILY and (f.ckpt.numSharedExperts or 0) > 0 and f.a2a == "none"



def _sglang_moe_shape_problem(ck: CheckpointInfo, tp: int, ep: int, env: dict[str, str], rocm: bool) -> str | None:
    """sglang's check_quantized_moe_compatibility for one (tp, ep): the message it raises, or None."""
    block = ck.weightBlockSize
    inter = ck.moeIntermediateSize
    if not block:
        # check_quantized_moe_compatibility runs only with quantization_config.weight_block_size; every MoE layer
        # asserts the split itself (FusedMoE.__init__, layers/moe/fused_moe_triton/layer.py:427, 0.5.23; :207 in 0.5.10)
        if inter is not None and tp % ep == 0 and inter % (tp // ep):
            return (f"AssertionError in FusedMoE.__init__: intermediate_size % self.moe_tp_size == 0 "
                    f"(moe_intermediate_size {inter}, moe_tp_size {tp // ep} = tp {tp} / ep {ep})")
        return None
    if tp % ep:
        return f"tp_size {tp} must be divisible by ep_size {ep}"
    moe_tp = tp // ep  # --moe-dp-size is never passed: 1
    if inter is None:
        return None
    if inter % moe_tp:
        return (f"moe_intermediate_size {inter} must be divisible by moe_tp_size ({moe_tp}) which is tp_size ({tp}) "
                f"divided by moe_ep_size ({ep}).")
    exempt = truthy(env.get("SGLANG_SHARED_EXPERT_TP1")) or (rocm and truthy(env.get("SGLANG_USE_AITER")))
    if (inter // moe_tp) % block[0] and not exempt:
        return (f"For quantized MoE models, please make sure (moe_intermediate_size={inter} / moe_tp_size={moe_tp}) % "
                f"weight_block_size_n={block[0]} == 0 where moe_tp_size is equal to tp_size ({tp}) divided by ep_size ({ep}).")
    return None


def sglang_moe_shape_errors(f: Facts) -> list[str]:
    """K40: sglang refuses a block-quantized MoE checkpoint whose MoE intermediate size does not split
    into whole weight blocks per tensor-parallel rank (any runner, auto included). Read in
    check_quantized_moe_compatibility: sglang/srt/model_executor/model_runner.py:855-886 (0.5.10),
    model_runner.py:1107-1143 (0.5.14), model_runner_components/moe_ep_setup.py:107-149 (0.5.17) and
    :134-176 (0.5.23), run by ModelRunner.__init__ before the weights load. From 0.5.14 the
    SGLANG_SHARED_EXPERT_TP1 env and ROCm aiter (SGLANG_USE_AITER=1) skip the block check.
    An all-to-all backend makes ep = tp (handle_a2a_moe), so moe_tp_size is 1 there."""
    if f.ver < (0, 5, 10) or f.ckpt.moeIntermediateSize is None and not f.ckpt.weightBlockSize:
        return []
    tp = f.choices.tp
    ep = tp if f.a2a not in ("none", "ascend_tp") else f.choices.ep
    env = dict(f.choices.env)
    if f.ver < (0, 5, 14):  # 0.5.10 has no exemption
        env.pop("SGLANG_SHARED_EXPERT_TP1", None), env.pop("SGLANG_USE_AITER", None)
    msg = _sglang_moe_shape_problem(f.ckpt, tp, ep, env, f.rocm)
    if msg is None:
        return []
    eps = [e for e in range(2, tp + 1) if tp % e == 0 and _sglang_moe_shape_problem(f.ckpt, tp, e, env, f.rocm) is None]
    tps, left = fits_tps(f, [t for t in (1, 2, 4, 8, 16, 32, 64)
                              if t != tp and _sglang_moe_shape_problem(f.ckpt, t, 1, env, f.rocm) is None])
    works = "; ".join(x for x in (
        f"parallelism.ep {', '.join(map(str, eps))} with tp {tp}" if eps else "",
        f"tp {', '.join(map(str, tps))} with ep 1" if tps else "") if x)
    where = ("FusedMoE.__init__, srt/layers/moe/fused_moe_triton/layer.py:427" if msg.startswith("AssertionError")
             else "check_quantized_moe_compatibility, srt/model_executor/model_runner_components/moe_ep_setup.py:134-176")
    return [f"[K40] sglang {f.version} refuses this layout at start-up: {msg} ({where}, sglang 0.5.23; in every "
            f"release read from 0.5.10). Works instead: {works or 'no tp/ep split of this checkpoint'}{left}."]


# K41 / WK41: the attention layers split the query heads over the attention tensor-parallel group and assert it; GQA
# layers also split the KV heads or replicate them evenly. sglang's per-model attention classes (0.5.23 lines; the same
# asserts in every release read, 0.5.10-0.5.23); the attention group is attn_tp_size = tp / dp with
# --enable-dp-attention (derive_attn_tp_size, srt/runtime_context.py:73-76), MixtralAttention uses tp.
_SGLANG_ATTN_SPLIT = {
    "Qwen3MoeForCausalLM": ("models/qwen3_moe.py:506-516", "Qwen3MoeAttention.__init__", True),
    "Qwen2MoeForCausalLM": ("models/qwen2_moe.py:914-924", "Qwen2MoeAttention.__init__", True),
    "Glm4MoeForCausalLM": ("models/glm4_moe.py:237-247", "Glm4MoeAttention.__init__", True),
    "GptOssForCausalLM": ("models/gpt_oss.py:394-404", "GptOssAttention.__init__", True),
    "MiniMaxM2ForCausalLM": ("models/minimax_m2.py:647-658", "MiniMaxM2Attention.__init__", True),
    "MixtralForCausalLM": ("models/mixtral.py:139-149", "MixtralAttention.__init__", False),
    **{a: ("models/deepseek_v2.py:2057", "DeepseekV2AttentionMLA.__init__", True)
       for a in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")},
    # Kimi-K2 ships as DeepseekV3ForCausalLM (above); Kimi-K2.5's language model is sglang's DeepseekV3ForCausalLM
    # (KimiK25ForConditionalGeneration.__init__, models/kimi_k25.py:693; :711 in 0.5.10), so the MLA assert applies
    "KimiK25ForConditionalGeneration": ("models/deepseek_v2.py:2057 via models/kimi_k25.py:693",
                                        "DeepseekV2AttentionMLA.__init__", True),
    # Llama4Attention asserts heads % attn_tp_size and the KV split/replication (llama4.py:224-234; :221 in 0.5.10);
    # Llama4ForConditionalGeneration's language model is Llama4ForCausalLM (mllama4.py:496; :477 in 0.5.10)
    "Llama4ForCausalLM": ("models/llama4.py:224-234", "Llama4Attention.__init__", True),
    "Llama4ForConditionalGeneration": ("models/llama4.py:224-234 via models/mllama4.py:496", "Llama4Attention.__init__",
                                       True),
    # the full-attention layers (Qwen3HybridAttentionDecoderLayer.__init__, qwen3_next.py:624-634; :538 in 0.5.10)
    "Qwen3NextForCausalLM": ("models/qwen3_next.py:624-634", "Qwen3HybridAttentionDecoderLayer.__init__", True),
    # DeepSeek-V4 (models/deepseek_v4.py, MqaAttentionBase.__init__:1035-1037) floor-divides n_heads and o_groups by
    # attn_tp_size without an assert: no start-up refusal is proven there, so it is not listed
}



def attention_split_refusal(f: Facts) -> str | None:
    """K41: the attention heads do not split over the layout's attention tensor-parallel ranks: the asserts of
    _SGLANG_ATTN_SPLIT's attention classes (models it lists only)."""
    ck, tp, dp = f.ckpt, f.choices.tp, f.choices.dp
    row = _SGLANG_ATTN_SPLIT.get(f.arch)
    if row is None or f.ver < (0, 5, 10):
        return None
    where, fn, dp_attn = row
    size = (lambda t: t // dp if dp > 1 and t % dp == 0 else t) if dp_attn else (lambda t: t)
    msg = heads_problem(ck, size(tp), True)
    if msg is None:
        return None
    tps, left = fits_tps(f, [t for t in (1, 2, 4, 8, 16, 32, 64)
                             if t != tp and t % dp == 0 and heads_problem(ck, size(t), True) is None])
    return (f"[K41] sglang {f.version} refuses this layout at start-up: AssertionError in {fn}: {msg} "
            f"(srt/{where}, sglang 0.5.23; the same asserts in every release read from 0.5.10). Works instead: "
            f"{'tp ' + ', '.join(map(str, tps)) if tps else 'no tp of this checkpoint'}"
            f"{f' with dp {dp}' if dp > 1 and tps else ''}{left}.")


def moe_split_refusal(f: Facts, runner: str = "auto") -> str | None:
    """K40's text (sglang_moe_shape_errors) whatever the runner, None when sglang accepts the split."""
    return next(iter(sglang_moe_shape_errors(f)), None)


def plan_moe(b: Builder) -> PlanMoE:
    f = b.f
    runner, _ = choose_runner(b, SELECT, RUNNER_FLAG, passes_over)
    # S16: FlashInfer A2A dispatch supplies top-k ids -> routed TRT-LLM runner.
    if f.a2a == "flashinfer" and runner == "flashinfer_trtllm" and f.choices.runner_backend == "auto":
        runner = "flashinfer_trtllm_routed"
        b.decide("moe.runnerBackend", runner, "S16", "FlashInfer A2A dispatch supplies top-k ids -> routed TRT-LLM runner")
    # E2/K29: SGLANG_CUTLASS_MOE is ignored since 0.5.18 -> translate to the flag.
    if truthy(f.env("SGLANG_CUTLASS_MOE")) and f.ver >= (0, 5, 18) and f.choices.runner_backend == "auto":
        runner = "cutlass"
        b.decide("moe.runnerBackend", runner, "E2", "SGLANG_CUTLASS_MOE is ignored since sglang 0.5.18; using --moe-runner-backend cutlass")
    if runner == "flashinfer_cutedsl" and f.a2a == "deepep" and "--deepep-mode" not in b.args:
        # S15b: the CuTeDSL FP4 runner has only a DeepEP low-latency handler; sglang < 0.5.17 does not force the
        # mode and --deepep-mode auto sends prefill through normal dispatch (engine row SG-CUTEDSL-DEEPEP-AUTO)
        b.args += ["--deepep-mode", "low_latency"]
        b.decide("args.--deepep-mode", "low_latency", "S15b",
                 "flashinfer_cutedsl has only a DeepEP low-latency (masked) handler (moe_runner/flashinfer_cutedsl.py "
                 "fused_experts_deepep_to_flashinfer_cutedsl_fp4); sglang >= 0.5.17 forces the same (moe_hook.py:363-375)")
    _aiter_env(b, runner)  # before the checks: the start-up rows see the env the plan renders (SG-FP8-AITER)
    run_checks(b, CHECKS, runner, RUNNER_FLAG)
    _quant_plan(b, runner)
    if k40 := moe_split_refusal(f):  # the predicate placement sizes with too
        b.errors.append(k40)
    if k41 := attention_split_refusal(f):
        b.errors.append(k41)
    if runner != "auto":
        b.args[:0] = ["--moe-runner-backend", runner]
    if f.a2a != "none":
        b.args += ["--moe-a2a-backend", f.a2a]
        if f.a2a != "ascend_tp" and f.choices.ep != f.choices.tp:
            b.warnings.append(f"[A2A] --moe-a2a-backend {f.a2a} forces ep_size = tp_size ({f.choices.tp}); ep={f.choices.ep} is overridden by sglang")
    if f.choices.tp > 1:
        b.args += ["--tp-size", str(f.choices.tp)]
    if f.choices.ep > 1:
        b.args += ["--ep-size", str(f.choices.ep)]
    if f.choices.dp > 1:
        b.args += ["--dp-size", str(f.choices.dp), "--enable-dp-attention"]

    # Deferred finalize (seed PR #33618; tuning-rules.md 1.7).
    env_key = "SGLANG_ENABLE_MOE_DEFERRED_FINALIZE"
    applicable = runner == "flashinfer_trtllm" and f.fmt in ("nvfp4", "mixed") and _deepseek_shared_unfused(f)
    default_on = f.ver >= (0, 5, 18)
    old_fi = f.fi_below("0.6.15")
    want = f.choices.deferred_finalize
    deferred = False
    why_not = (f"deferred finalize needs runner flashinfer_trtllm with NVFP4 experts, a DeepSeek-family model with an "
               f"unfused shared expert and a2a none (here: runner {runner}, format {f.fmt}, {f.arch}, a2a {f.a2a})")
    if env_key in f.choices.env:
        deferred = applicable and truthy(f.env(env_key))
        b.decide("moe.deferredFinalize", str(deferred).lower(), "user",
                 f"{env_key}={f.env(env_key)} set explicitly by the user")
    elif want == "on":
        if not applicable:
            b.errors.append(f"[DF1] moe.deferredFinalize=on is impossible: {why_not}")
        elif old_fi:
            b.errors.append(f"[K7] moe.deferredFinalize=on needs FlashInfer >= 0.6.15 (this image: {f.flashinfer}): older "
                            "versions mislabel trtllm-gen expert_weights as fp32 (flashinfer#3595) -> garbage output")
        else:
            deferred = True
            b.set_env(env_key, "1", "DF2", "deferred finalize requested explicitly (moe.deferredFinalize=on)")
    elif want == "off":
        b.set_env(env_key, "0", "DF3", "deferred finalize turned off explicitly (moe.deferredFinalize=off)")
    elif applicable and default_on and old_fi:
        b.set_env(env_key, "0", "E4", f"flashinfer {f.flashinfer} < 0.6.15 returns mislabeled expert_weights for fp32 routing "
                                      "logits (flashinfer#3595, K7): deferred finalize off")
    elif applicable and default_on:
        deferred = True
        cap = " (up to SGLANG_MOE_DEFERRED_FINALIZE_MAX_TOKENS=192 tokens per batch)" if f.ver >= (0, 5, 21) else ""
        b.decide("moe.deferredFinalize", "true", "S4-DF",
                 f"MoE deferred finalize on (sglang >= 0.5.18 default, PR #33618): moe_finalize_fuse_shared folds the top-k "
                 f"reduction into the shared-expert add{cap}; flashinfer {f.flashinfer or 'pinned'} >= 0.6.15")
    elif applicable:
        b.decide("moe.deferredFinalize", "false", "S4-DF", f"sglang {f.version} < 0.5.18: deferred finalize is off by default")

    if f.choices.env.get("SGLANG_FLASHINFER_MOE_FUSED_FINALIZE") is None and (0, 5, 18) <= f.ver < (0, 5, 21) \
            and runner in ("flashinfer_cutlass", "flashinfer_cutedsl"):
        b.warnings.append("[E5] sglang 0.5.18-0.5.20 default SGLANG_FLASHINFER_MOE_FUSED_FINALIZE=True (atomic finalize) "
                          "was turned off in 0.5.21 for numerical accuracy (PR #40105)")
    if (0, 5, 16) <= f.ver < (0, 5, 18) and runner == "flashinfer_mxfp4" and f.fam == "sm100":
        b.warnings.append("[E3] PDL hang risk on trtllm-gen MXFP4 MoE before sglang 0.5.18 (PR #34789): keep "
                          "--chunked-prefill-size <= 8192 or upgrade")
    b.set_env("SGLANG_CACHE_DIR", "/var/cache/moe/sglang", "E1",
              "reuse FlashInfer autotune results across restarts (cache path includes flashinfer version and sm arch)")
    return PlanMoE(runnerBackend=runner, a2aBackend=f.a2a, deferredFinalize=deferred)



def _quant_plan(b: Builder, runner: str) -> None:
    """The WNA16 rows' per-case reasons (into their refusals, before 'Works instead'), --quantization where sglang
    needs it, the SQ0 note for releases they were not read for, what auto runs (engines/sglang/quant.py)."""
    f = b.f
    b.explain(quant.detail(f, runner))
    warnings, args, decisions = quant.plan_notes(f, runner)
    b.warnings.extend(warnings)
    b.args += args
    for key, value, rule, reason in decisions:
        b.decide(key, value, rule, reason)


def _aiter_env(b: Builder, runner: str) -> None:
    """SGLANG_USE_AITER for an explicit aiter runner on ROCm, where sglang gates the path on it (engines/sglang/quant.py)."""
    warnings, env = quant.aiter_env(b.f, runner)
    b.warnings.extend(warnings)
    for key, value, rule, reason in env:
        b.set_env(key, value, rule, reason)


# Where `auto` falls back (admission warnings, issue 16 item 3): decision rule id -> (does this value fall back,
# what is given up). A fallback is an automatic choice made because the preferred path is unavailable for this
# format on this GPU (or in this engine release / image): the plan runs, slower or without a default optimisation.
FALLBACKS: dict[str, tuple[Callable[[str], bool], str]] = {
    "S2e": (lambda v: True, "flashinfer_mxfp4 (the DeepSeek-V4 FP4 default) cannot run this layout (128-aligned "
                            "hidden and per-rank intermediate sizes, FlashInfer in the image): W4A16 on Marlin"),
    "S6": (lambda v: True, "no FP4 tensor cores before Blackwell: NVFP4 experts run weight-only (W4A16) on Marlin, "
                           "slower than the FP4 MoE kernels of SM100/SM12x"),
    "S7b": (lambda v: v != "flashinfer_mxfp4", "flashinfer_mxfp4 (the SM12x GPT-OSS default from sglang 0.5.17) is "
                                               "not in this release"),
    "S8": (lambda v: True, "triton_kernel (the GPT-OSS default) segfaults on Blackwell with NVIDIA driver >= 595, "
                           "so the slower triton runner is used"),
    "E4": (lambda v: v == "0", "MoE deferred finalize (sglang >= 0.5.18 default) is off: the image's FlashInfer < "
                               "0.6.15 mislabels expert_weights (flashinfer#3595)"),
}



def default_flashinfer(version: str, gpu) -> str | None:
    """flashinfer-python in the sglang image when the user did not say: the pin of the release."""
    read = engine_rules.read_as(NAME, version)
    if read is not None:  # a release read (post releases are their own: 0.5.10.post1 pins another)
        return FLASHINFER_PIN.get(read)
    # not read: the planner assumes the pin of the newest release read below it (the plan warns ER0)
    key = ".".join(str(x) for x in vtuple(version)[:3])
    known = sorted(FLASHINFER_PIN, key=vtuple)
    below = [k for k in known if vtuple(k) <= vtuple(key)]
    return FLASHINFER_PIN[below[-1]] if below else None


# What the user's env already chooses (moe-operator plan warns where --set contradicts it; the env wins in the pod).
DEFERRED_ENV = "SGLANG_ENABLE_MOE_DEFERRED_FINALIZE"


def env_runner(env: dict[str, str], family: str) -> list[tuple[str, str]]:
    """(env description, runner it selects): SGLANG_CUTLASS_MOE selects cutlass (E2)."""
    return [(f"SGLANG_CUTLASS_MOE={env['SGLANG_CUTLASS_MOE']}", "cutlass")] if truthy(env.get("SGLANG_CUTLASS_MOE")) else []
