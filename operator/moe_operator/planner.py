"""The planner: (checkpoint, GPU class, user choices, engine) -> Plan. Pure: no I/O, no torch.

The tuning rules live here and only here, as tables of rows (tuning-rules.md section 6):
  * Rule 0: an explicit user value is never changed; it is validated, and an impossible one
    becomes an error that says why and what would work.
  * select rows (S*, W*, B*) fill values the user left at `auto`; first matching row wins;
  * validate rows (V*, K*) run on the final values, explicit or selected;
  * env rows (E*) for engine environment variables.
The bundled engine's rows are derived from the kernel-backend registry (`moe_core.registry`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from moe_core import registry, sizing
from moe_core.bundled import parallel_args, resolve_bundled
from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import BLACKWELL, GpuClass
from moe_core.plan import Decision, Plan, PlanCheckpoint, PlanEngine, PlanGpu, PlanMoE

from . import engine_rules

from .engines.sglang import vocab as _sglang
from .engines.vllm import vocab as _vllm
from .engines.vocabulary import ALL_A2A, ALL_RUNNERS, DEFAULT_VERSIONS, ENGINES  # noqa: F401  (re-exported)

SGLANG_FLASHINFER_PIN = _sglang.FLASHINFER_PIN
SGLANG_RUNNERS = _sglang.RUNNERS
SGLANG_A2A = _sglang.A2A
VLLM_MOE_BACKENDS = _vllm.MOE_BACKENDS
DEEPSEEK_FAMILY = _sglang.DEEPSEEK_FAMILY
QWEN3_FAMILY = _sglang.QWEN3_FAMILY
DSV4 = "DeepseekV4ForCausalLM"
GPT_OSS = "GptOssForCausalLM"


def vtuple(v: str | None) -> tuple[int, ...]:
    return registry.version_tuple(v) if v else ()


def truthy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Choices:
    """What the user set in the MoEDeployment spec (or on the CLI)."""

    runner_backend: str = "auto"
    a2a_backend: str = "none"
    deferred_finalize: str = "auto"  # auto | on | off
    env: dict[str, str] = field(default_factory=dict)
    tp: int = 1
    ep: int = 1
    dp: int = 1
    flashinfer_version: str | None = None  # the image's flashinfer; "none" = not installed
    nodes: int = 1  # nodes per replica (a LeaderWorkerSet group when > 1)


@dataclass(frozen=True)
class Facts:
    """Everything a rule predicate may look at."""

    ckpt: CheckpointInfo
    gpu: GpuClass
    choices: Choices
    engine: str
    version: str
    flashinfer: str | None  # version in the image, None if absent/unknown

    @property
    def fam(self) -> str: return self.gpu.family
    @property
    def arch(self) -> str: return self.ckpt.architecture
    @property
    def fmt(self) -> str: return self.ckpt.format
    @property
    def a2a(self) -> str: return self.choices.a2a_backend
    @property
    def rocm(self) -> bool: return self.gpu.is_rocm
    @property
    def ver(self) -> tuple[int, ...]: return vtuple(self.version)
    def env(self, key: str) -> str | None: return self.choices.env.get(key)
    def fi_below(self, v: str) -> bool: return self.flashinfer is not None and vtuple(self.flashinfer) < vtuple(v)
    @property
    def gpu_name(self) -> str: return f"{self.gpu.family} ({self.gpu.product})" if self.gpu.product else self.gpu.family


Pred = Callable[[Facts], bool]


@dataclass(frozen=True)
class Select:
    """A select row: when `when` holds and the user left the value at auto, choose `value`."""

    id: str
    when: Pred
    value: str | Callable[[Facts], str] | None  # None: the row rejects (error = reason)
    reason: str  # formatted with arch, fmt, gpu, value, version
    args: Callable[[Facts], list[str]] | None = None


@dataclass(frozen=True)
class Check:
    """A validate row: runs on the final value (explicit or selected)."""

    id: str
    when: Callable[[Facts, str], bool]  # (facts, runner)
    verdict: str  # "reject" | "warn"
    message: str



# ------------------------------------------------------------------------------------------
# SGLang (tuning-rules.md 6.1, 6.2)

def _gpt_oss_sm12x(f: Facts) -> str:
    if f.ver >= (0, 5, 17):
        return "flashinfer_mxfp4"
    return "marlin" if f.ver >= (0, 5, 14) else "triton_kernel"


def _dsv4_fi_misaligned(f: Facts) -> str | None:
    from .engine_rules.sglang import fi_mxfp4_cutlass_misaligned, moe_tp_size
    return fi_mxfp4_cutlass_misaligned(f.fam, f.version, f.ckpt.hiddenSize, f.ckpt.moeIntermediateSize,
                                       moe_tp_size(f.choices.tp, f.choices.ep, f.a2a))


SGLANG_SELECT: tuple[Select, ...] = (
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
           "mxfp4_flashinfer_cutlass_moe.py:67-74, sglang 0.5.23): Marlin W4A16 runs it"),
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

SGLANG_CHECKS: tuple[Check, ...] = (
    Check("V0", lambda f, r: r not in SGLANG_RUNNERS, "reject",
          "unknown sglang --moe-runner-backend {value}; valid values: " + ", ".join(SGLANG_RUNNERS)),
    Check("V0b", lambda f, r: r in SGLANG_RUNNERS and f.ver < vtuple(SGLANG_RUNNERS[r]), "reject",
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
)


# ------------------------------------------------------------------------------------------
# vLLM (tuning-rules.md 6.3, 3.x)

def _vllm_flag_era(f: Facts) -> bool:
    return f.ver >= (0, 16)  # --moe-backend (PR #33807); env vars removed in 0.23


VLLM_SELECT: tuple[Select, ...] = (
    Select("K31", lambda f: f.fmt in ("nvfp4", "dsv4_nvfp4") and f.arch == DSV4 and f.fam in ("sm120", "sm121"), None,
           "vLLM has no NVFP4 MoE backend for DeepSeek-V4 on {gpu} ('No NvFp4 MoE backend supports the deployment "
           "configuration.'); use the MXFP4 DeepSeek-V4 checkpoint"),
    Select("W4", lambda f: f.fmt == "dsv4_fp4", "auto",
           "vLLM DeepSeek-V4 MXFP4 priority list on {gpu}: TRT-LLM MXFP4xMXFP8 (SM100), DeepGEMM MXFP4 or Marlin (SM12x), Humming/Marlin W4A16 (SM90)"),
    Select("W1", lambda f: f.arch == GPT_OSS and f.fmt == "mxfp4" and f.fam == "sm100", "auto",
           "vLLM GPT-OSS MXFP4 on SM100: auto = FlashInfer TRT-LLM MXFP4 x BF16"),
    Select("W2", lambda f: f.arch == GPT_OSS and f.fmt == "mxfp4" and f.fam == "sm90", "auto",
           "vLLM GPT-OSS MXFP4 on Hopper: auto = Triton (triton_kernels) -> FlashInfer CUTLASS W4A16 -> Humming -> Marlin"),
    Select("W3", lambda f: f.arch == GPT_OSS and f.fmt == "mxfp4" and f.fam in ("sm120", "sm121"), "auto",
           "vLLM GPT-OSS MXFP4 on SM12x: auto = Marlin (Triton is smem-limited)"),
    Select("W5env", lambda f: f.fmt == "nvfp4" and f.fam == "sm100" and not _vllm_flag_era(f), "env",
           "vLLM {version} (env era) NVFP4 on SM100: VLLM_USE_FLASHINFER_MOE_FP4=1 + VLLM_FLASHINFER_MOE_BACKEND=latency "
           "(without it vLLM uses its own CUTLASS FP4 MoE)"),
    Select("W5", lambda f: f.fmt in ("nvfp4", "mixed", "ct_nvfp4"), "auto",
           "vLLM NVFP4 per-arch default on {gpu}: SM100 flashinfer_trtllm, SM12x flashinfer_cutlass, <=SM90 marlin/humming"),
    Select("W6", lambda f: f.fmt in ("fp8", "modelopt_fp8") and f.fam == "sm90", "auto",
           "vLLM Hopper block-FP8 heuristic: Triton for TP, FlashInfer CUTLASS for EP"),
    Select("W0", lambda f: True, "auto", "no tuning rule for {arch} {fmt} on {gpu}: vLLM auto decides at load"),
)

VLLM_CHECKS: tuple[Check, ...] = (
    Check("WV0", lambda f, r: r not in VLLM_MOE_BACKENDS, "reject",
          "unknown vLLM --moe-backend {value}; valid values: " + ", ".join(VLLM_MOE_BACKENDS)),
    Check("K14", lambda f, r: r in ("flashinfer_trtllm", "flashinfer_trtllm_afp8") and f.fam != "sm100", "reject",
          "{value}: trtllm-gen kernels are SM100-family only, not {gpu}; use flashinfer_cutlass (NVFP4 on SM120), marlin, or auto"),
    Check("WV1", lambda f, r: r in ("flashinfer_cutlass",) and f.fam in ("sm110",), "reject",
          "FlashInfer CUTLASS MoE excludes SM110 (flashinfer#3134); use cutlass"),
    Check("WV2", lambda f, r: r != "auto" and not _vllm_flag_era(f) and r not in _VLLM_FLAG_TO_ENV, "reject",
          "vLLM {version} predates --moe-backend; {value} cannot be expressed with its environment variables"),
    Check("K32", lambda f, r: f.fam == "sm121" and f.fmt == "nvfp4", "warn",
          "vLLM NVFP4 MoE on GB10 (SM121) with FlashInfer is known to crash at CUDA-graph capture (flashinfer#2776)"),
)

# vLLM legacy env (<= 0.22) <-> flag (>= 0.23), tuning-rules.md 3.1
_VLLM_LEGACY_ENV = {
    "VLLM_USE_FLASHINFER_MOE_FP4": None, "VLLM_FLASHINFER_MOE_BACKEND": None,
    "VLLM_USE_FLASHINFER_MOE_MXFP4_BF16": None, "VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8": "flashinfer_trtllm_afp8",
    "VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8_CUTLASS": "flashinfer_cutlass_afp8", "VLLM_MXFP4_USE_MARLIN": "marlin",
    "VLLM_USE_FLASHINFER_MOE_FP8": None, "VLLM_USE_FLASHINFER_MOE_FP16": None,
}
_VLLM_FLAG_TO_ENV = {
    "flashinfer_trtllm": {"VLLM_USE_FLASHINFER_MOE_FP4": "1", "VLLM_FLASHINFER_MOE_BACKEND": "latency"},
    "flashinfer_cutlass": {"VLLM_USE_FLASHINFER_MOE_FP4": "1", "VLLM_FLASHINFER_MOE_BACKEND": "throughput"},
    "flashinfer_cutedsl": {"VLLM_USE_FLASHINFER_MOE_FP4": "1", "VLLM_FLASHINFER_MOE_BACKEND": "masked_gemm"},
    "marlin": {"VLLM_MXFP4_USE_MARLIN": "1"},
}


def _vllm_translate_legacy_env(f: Facts) -> str | None:
    """W7: what a leftover legacy env var means as a --moe-backend value (None: nothing to translate)."""
    env = f.choices.env
    if not any(k in env for k in _VLLM_LEGACY_ENV):
        return None
    for k, flag in _VLLM_LEGACY_ENV.items():
        if flag and truthy(env.get(k)):
            return flag
    if truthy(env.get("VLLM_USE_FLASHINFER_MOE_FP4")) or truthy(env.get("VLLM_USE_FLASHINFER_MOE_MXFP4_BF16")):
        mode = env.get("VLLM_FLASHINFER_MOE_BACKEND", "latency")
        if truthy(env.get("VLLM_USE_FLASHINFER_MOE_MXFP4_BF16")):
            return "flashinfer_trtllm" if f.fam == "sm100" else "flashinfer_cutlass"
        return {"throughput": "flashinfer_cutlass", "latency": "flashinfer_trtllm",
                "masked_gemm": "flashinfer_cutedsl"}.get(mode, "flashinfer_trtllm")
    return None


# ------------------------------------------------------------------------------------------
# Shared machinery


class _Builder:
    def __init__(self, f: Facts):
        self.f = f
        self.env: dict[str, str] = {}
        self.args: list[str] = []
        self.reasons: list[str] = []
        self.warnings: list[str] = []
        self.errors: list[str] = []
        self.decisions: list[Decision] = []

    def decide(self, key: str, value: str, rule: str, reason: str) -> None:
        self.decisions.append(Decision(key=key, value=value, rule=rule, reason=reason))
        self.reasons.append(f"[{rule}] {reason}")

    def set_env(self, key: str, value: str, rule: str, reason: str) -> None:
        """Planner env; a user value for the same key wins (Rule 0) and is reported instead."""
        if key in self.f.choices.env:
            self.decide(f"env.{key}", self.f.choices.env[key], "user",
                        f"{key}={self.f.choices.env[key]} set explicitly by the user (planner would set {value}: {reason})")
            return
        self.env[key] = value
        self.decide(f"env.{key}", value, rule, reason)


def _select(rows: tuple[Select, ...], f: Facts, skipped: list | None = None) -> tuple[Select, str | None]:
    for row in rows:
        if row.when(f):
            value = row.value(f) if callable(row.value) else row.value
            if skipped is not None and _needs_absent_flashinfer(f, value):
                skipped.append((row, value))
                continue
            return row, value
    raise AssertionError("select tables end with a catch-all row")


def _needs_absent_flashinfer(f: Facts, value: str | None) -> bool:
    """FI0: a FlashInfer runner for an sglang image without FlashInfer (engine.flashinferVersion none) is one sglang
    refuses (engine row SG-FI-ABSENT): such a select row is passed over, the next one decides."""
    return (f.engine == "sglang" and f.choices.flashinfer_version == "none" and isinstance(value, str)
            and value.startswith("flashinfer"))


def _run_checks(b: _Builder, checks: tuple[Check, ...], runner: str) -> None:
    f = b.f
    first_error = len(b.errors)
    fired: set[str] = set()
    for c in checks:
        if c.when(f, runner):
            msg = c.message.format(value=runner, gpu=f.gpu_name, a2a=f.a2a, fmt=f.fmt, version=f.version,
                                   fi=f.flashinfer or "none", arch=f.arch)
            (b.errors if c.verdict == "reject" else b.warnings).append(f"[{c.id}] {msg}")
            if c.verdict == "reject":
                fired.add(c.id)
    # explicit: the spec's runner/a2a, or a runner translated from the user's own env (E2 SGLANG_CUTLASS_MOE, W7 VLLM_*)
    from_env = any(d.key == "moe.runnerBackend" and d.rule in ("E2", "W7") for d in b.decisions)
    note = engine_rules.coverage_note(f.engine, f.version)
    if note:  # every plan for a release not read says its start-up checks are not judged (no rule is guessed)
        b.warnings.append(f"[ER0] {note}")
    if f.engine in ("sglang", "vllm") and (f.choices.runner_backend != "auto" or f.a2a != "none" or from_env):
        _engine_start_checks(b, checks, runner, frozenset(fired), first_error)


def _engine_case(f: Facts, runner: str, args: list[str] | None = None) -> engine_rules.Case:
    args = args or []
    deepep_mode = args[args.index("--deepep-mode") + 1] if "--deepep-mode" in args[:-1] else "auto"
    return engine_rules.Case(
        engine=f.engine, version=f.version, fmt=f.fmt, arch=f.arch, family=f.fam, runner=runner, a2a=f.a2a,
        tp=f.choices.tp, ep=f.choices.ep, dp=f.choices.dp, cc=f.gpu.computeCapability,
        driver=getattr(f.gpu, "driverVersion", None) or (str(f.gpu.driverMajor) if f.gpu.driverMajor else None),
        flashinfer="none" if f.choices.flashinfer_version == "none" else f.flashinfer,
        quant_method=f.ckpt.quantMethod, env=dict(f.choices.env),
        hidden=f.ckpt.hiddenSize, moe_inter=f.ckpt.moeIntermediateSize, deepep_mode=deepep_mode)


def _engine_start_checks(b: _Builder, checks: tuple[Check, ...], runner: str, fired: frozenset[str],
                         first_error: int) -> None:
    """Explicit sglang/vLLM choices against the engine version's own start-up checks (engine_rules),
    then every refusal of the explicit choice says what works instead (issue 16)."""
    f = b.f
    case = _engine_case(f, runner, b.args)
    b.errors.extend(r.text for r in engine_rules.check(case, skip_same_as=fired))
    if len(b.errors) == first_error:
        return

    def planner_ok(c: engine_rules.Case) -> bool:  # a value the spec can hold and the planner's own rows accept
        if c.runner not in ALL_RUNNERS or c.a2a not in ALL_A2A:
            return False
        g = f if c.a2a == f.a2a else dataclasses.replace(f, choices=dataclasses.replace(f.choices, a2a_backend=c.a2a))
        return not any(k.verdict == "reject" and k.when(g, c.runner) for k in checks)

    flag = "--moe-runner-backend" if f.engine == "sglang" else "--moe-backend"
    alts = engine_rules.describe_alternatives(case, engine_rules.alternatives(case, planner_ok), flag)
    for i in range(first_error, len(b.errors)):
        b.errors[i] = f"{b.errors[i]} {alts}"


def _reason(row: Select, f: Facts, value: str) -> str:
    return row.reason.format(arch=f.arch, fmt=f.fmt, gpu=f.gpu_name, value=value, version=f.version,
                             shape=(_dsv4_fi_misaligned(f) or "the image has no FlashInfer") if "{shape}" in row.reason else "",
                             fi=f.flashinfer or "none", a2a=f.a2a)


def _choose_runner(b: _Builder, rows: tuple[Select, ...], flag_name: str) -> tuple[str, Select | None]:
    """Rule 0, then the select table. Returns (runner, row that chose it or None for user)."""
    f = b.f
    user = f.choices.runner_backend
    if user != "auto":
        b.decide("moe.runnerBackend", user, "user", f"{flag_name} {user} set explicitly by the user (validated, never changed)")
        return user, None
    skipped: list = []
    row, value = _select(rows, f, skipped)
    for r, v in skipped:
        b.warnings.append(f"[FI0] {r.id} would pick {v}, but the image has no FlashInfer (engine.flashinferVersion "
                          f"none): passed over, {row.id} decides")
    if value is None:
        b.errors.append(f"[{row.id}] {_reason(row, f, '')}")
        return "auto", row
    b.decide("moe.runnerBackend", value, row.id, _reason(row, f, value))
    if row.args:
        b.args.extend(row.args(f))
    return value, row


# ------------------------------------------------------------------------------------------
# Engines


def _deepseek_shared_unfused(f: Facts) -> bool:
    return f.arch in DEEPSEEK_FAMILY and (f.ckpt.numSharedExperts or 0) > 0 and f.a2a == "none"


def _fits_tps(f: Facts, tps: list[int]) -> tuple[list[int], str]:
    """The tps of a "works instead" list whose weights fit the GPU (moe_core.sizing.estimate at one KV token, so a
    layout is left out only when its weights and workspace alone exceed the usable memory), and a note naming those
    left out. Unknown GPU memory or checkpoint size: every tp is kept (nothing is judged)."""
    memory = sizing.memory_bytes(f.gpu)
    if memory is None or not f.ckpt.totalBytes:
        return tps, ""
    fits = {t: sizing.estimate(f.ckpt, memory, t, max_len=1, concurrency=1) for t in tps}
    out = [t for t in tps if fits[t].fits]
    gone = [t for t in tps if not fits[t].fits]
    if not gone:
        return out, ""
    worst = fits[gone[-1]]
    return out, (f" (left out: tp {', '.join(map(str, gone))}, whose weights do not fit {f.gpu_name}: tp {worst.gpus} "
                 f"needs {sizing.gib(worst.need)} per GPU before any KV cache > {sizing.gib(worst.usable)} usable)")


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
    tps, left = _fits_tps(f, [t for t in (1, 2, 4, 8, 16, 32, 64)
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


# WK41: vLLM's config check covers every architecture; these model files (vLLM 0.33.0) assert the same split in
# their attention classes, cited with the row when the release is 0.33.0 or later (read in 0.33.0 only)
_VLLM_ATTN_SPLIT = {
    "Llama4ForCausalLM": "model_executor/models/llama4.py:189-199 Llama4Attention.__init__",
    "Llama4ForConditionalGeneration": "model_executor/models/llama4.py:189-199 Llama4Attention.__init__ (mllama4.py:780-785 "
                                      "builds Llama4ForCausalLM)",
    "Qwen3NextForCausalLM": "model_executor/models/qwen3_next.py:296-306 Qwen3NextAttention.__init__",
    "KimiK25ForConditionalGeneration": "model_executor/models/deepseek_v2.py:1041 DeepseekV2MLAAttention.__init__ "
                                       "(kimi_k25.py:376-380 builds DeepseekV2ForCausalLM)",
    **{a: "model_executor/models/deepseek_v2.py:1041 DeepseekV2MLAAttention.__init__"
       for a in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")},
    "DeepseekV4ForCausalLM": "models/deepseek_v4/attention.py:218 DeepseekV4Attention.__init__",
}

def _heads_problem(ck: CheckpointInfo, attn_tp: int, kv: bool) -> str | None:
    heads, kv_heads = ck.numAttentionHeads, ck.numKeyValueHeads
    if attn_tp <= 1 or not heads:
        return None
    if heads % attn_tp:
        return f"{heads} attention heads % {attn_tp} (attention tensor-parallel size) != 0"
    if kv and kv_heads and not ck.kvLoraRank and (kv_heads % attn_tp if kv_heads >= attn_tp else attn_tp % kv_heads):
        return (f"{kv_heads} KV heads neither split over nor replicate evenly on {attn_tp} attention tensor-parallel "
                f"ranks")
    return None


def attention_split_refusal(f: Facts) -> str | None:
    """K41 (sglang) / WK41 (vLLM): the attention heads do not split over the layout's attention tensor-parallel
    ranks. vLLM: ModelConfig.verify_with_parallel_config raises 'Total number of attention heads (H) must be divisible
    by tensor parallel size (T).' (vllm/config/model.py:1557-1564 in 0.33.0, :1195-1202 in 0.22.1) and
    QKVParallelLinear.__init__ divides the KV heads (model_executor/layers/linear.py:1064-1071 in 0.33.0,
    :1027-1032 in 0.22.1); its data parallel ranks are whole replicas, so the attention group is tp. sglang: the
    asserts of _SGLANG_ATTN_SPLIT's attention classes (models it lists only)."""
    ck, tp, dp = f.ckpt, f.choices.tp, f.choices.dp
    if f.engine == "sglang":
        row = _SGLANG_ATTN_SPLIT.get(f.arch)
        if row is None or f.ver < (0, 5, 10):
            return None
        where, fn, dp_attn = row
        size = (lambda t: t // dp if dp > 1 and t % dp == 0 else t) if dp_attn else (lambda t: t)
        msg = _heads_problem(ck, size(tp), True)
        if msg is None:
            return None
        tps, left = _fits_tps(f, [t for t in (1, 2, 4, 8, 16, 32, 64)
                                  if t != tp and t % dp == 0 and _heads_problem(ck, size(t), True) is None])
        return (f"[K41] sglang {f.version} refuses this layout at start-up: AssertionError in {fn}: {msg} "
                f"(srt/{where}, sglang 0.5.23; the same asserts in every release read from 0.5.10). Works instead: "
                f"{'tp ' + ', '.join(map(str, tps)) if tps else 'no tp of this checkpoint'}"
                f"{f' with dp {dp}' if dp > 1 and tps else ''}{left}.")
    if f.engine == "vllm":
        if f.ver < (0, 22, 1):
            return None
        msg = _heads_problem(ck, tp, True)
        if msg is None:
            return None
        tps, left = _fits_tps(f, [t for t in (1, 2, 4, 8, 16, 32, 64) if t != tp and _heads_problem(ck, t, True) is None])
        cite = ("vllm/config/model.py:1557-1564 ModelConfig.verify_with_parallel_config and model_executor/layers/"
                "linear.py:1064-1071 QKVParallelLinear.__init__, vLLM 0.33.0; config/model.py:1195-1202, linear.py:1027-1032"
                " in 0.22.1")
        if f.ver >= (0, 33, 0) and f.arch in _VLLM_ATTN_SPLIT:
            cite += f"; the model asserts it too: vllm/{_VLLM_ATTN_SPLIT[f.arch]}, vLLM 0.33.0"
        return (f"[WK41] vLLM {f.version} refuses this layout at start-up: {msg} ('Total number of attention heads "
                f"({ck.numAttentionHeads}) must be divisible by tensor parallel size ({tp}).' / '... is not divisible by "
                f"...') ({cite}). Works instead: {'tp ' + ', '.join(map(str, tps)) if tps else 'no tp of this checkpoint'}{left}.")
    return None


def _plan_sglang(b: _Builder) -> PlanMoE:
    f = b.f
    runner, _ = _choose_runner(b, SGLANG_SELECT, "--moe-runner-backend")
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
    _run_checks(b, SGLANG_CHECKS, runner)
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


def _vllm_pick_runner(b: _Builder) -> str:
    """The --moe-backend value vLLM gets: the user's, W7's translation of legacy env, or the select table's
    ("env": W5env's env-era FlashInfer TRT-LLM)."""
    f = b.f
    legacy = _vllm_translate_legacy_env(f)
    if legacy and f.choices.runner_backend == "auto" and f.ver >= (0, 23):
        b.decide("moe.runnerBackend", legacy, "W7", f"VLLM_* MoE env vars were removed in vLLM 0.23 and are silently ignored; "
                                                     f"translated the user's env to --moe-backend {legacy}")
        b.warnings.append(f"[W7] legacy VLLM_* MoE env vars have no effect on vLLM {f.version}; use moe.runnerBackend instead")
        return legacy
    return _choose_runner(b, VLLM_SELECT, "--moe-backend")[0]


def _vllm_auto_without_flashinfer(f: Facts) -> str | None:
    """FI0 for vLLM: where --moe-backend auto would take a FlashInfer backend first (vLLM 0.33.0's oracle priority
    lists) and the image has none (engine.flashinferVersion none), vLLM passes over it (its experts class's
    _supports_current_device needs has_flashinfer_*, VL-FI-ABSENT) and the next backend of the list runs."""
    if f.choices.flashinfer_version != "none" or f.rocm or f.ver < (0, 33, 0):  # lists read in 0.33.0 only
        return None
    if f.fmt in ("nvfp4", "ct_nvfp4", "mixed", "dsv4_nvfp4") and f.fam in ("sm100", "sm120", "sm121"):
        return ("vLLM auto's NvFP4 list starts with FlashInfer TRT-LLM, CuTeDSL and CUTLASS (select_nvfp4_moe_backend, "
                "model_executor/layers/fused_moe/oracle/nvfp4.py:203-212, vLLM 0.33.0); without FlashInfer it takes "
                "vLLM's own CUTLASS FP4 MoE (CutlassExpertsFp4, experts/cutlass_moe.py:716-722)")
    if f.fmt == "mxfp4" and f.arch == GPT_OSS and f.fam == "sm100":
        return ("vLLM auto's GPT-OSS MXFP4 list starts with FlashInfer TRT-LLM MXFP4 x BF16 (_get_priority_backends_for_"
                "gpt_oss, oracle/mxfp4.py:405-425, vLLM 0.33.0); without FlashInfer it takes the OpenAI Triton MXFP4 kernels")
    if f.fmt == "dsv4_fp4" and f.fam == "sm100":
        return ("vLLM auto's DeepSeek-V4 MXFP4 list starts with FlashInfer TRT-LLM MXFP4 x MXFP8 (oracle/mxfp4.py:452-461, "
                "vLLM 0.33.0); without FlashInfer it takes DeepGEMM MXFP4")
    if f.fmt == "fp8" and f.ckpt.weightBlockSize and (f.fam == "sm100" or (f.fam == "sm90" and f.choices.ep > 1)):
        first = ("FlashInfer TRT-LLM (_get_priority_backends, oracle/fp8.py:88-104" if f.fam == "sm100" else
                 "FlashInfer CUTLASS, moved to the front for expert parallelism on Hopper (oracle/fp8.py:122-131")
        return (f"vLLM auto's block-FP8 list starts with {first}, vLLM 0.33.0); without FlashInfer the next backend of "
                "that list that supports the layer runs (DeepGEMM, Triton, ...)")
    return None


def _plan_vllm(b: _Builder) -> PlanMoE:
    f = b.f
    runner = _vllm_pick_runner(b)
    if runner == "auto" and (why := _vllm_auto_without_flashinfer(f)):
        b.warnings.append(f"[FI0] the image has no FlashInfer (engine.flashinferVersion none): {why}")
    if runner == "env":  # W5 env era: express the choice with env vars
        for k, v in _VLLM_FLAG_TO_ENV["flashinfer_trtllm"].items():
            b.set_env(k, v, "W5", "vLLM env-era FlashInfer TRT-LLM NVFP4 MoE on SM100")
        runner = "flashinfer_trtllm"
    elif runner != "auto":
        _run_checks(b, VLLM_CHECKS, runner)
        if _vllm_flag_era(f):
            b.args[:0] = ["--moe-backend", runner]
        elif runner in _VLLM_FLAG_TO_ENV:
            for k, v in _VLLM_FLAG_TO_ENV[runner].items():
                b.set_env(k, v, "W7r", f"vLLM {f.version} predates --moe-backend: {runner} expressed as {k}={v}")
    else:
        _run_checks(b, VLLM_CHECKS, runner)
    if wk40 := moe_split_refusal(f, runner):  # the predicate placement sizes with too
        b.errors.append(wk40)
    if wk41 := attention_split_refusal(f):
        b.errors.append(wk41)
    if f.choices.tp > 1:
        b.args += ["--tensor-parallel-size", str(f.choices.tp)]
    if f.choices.dp > 1:
        b.args += ["--data-parallel-size", str(f.choices.dp)]
    if f.choices.ep > 1:
        b.args += ["--enable-expert-parallel"]
    if f.a2a != "none":
        b.args += ["--all2all-backend", f.a2a]
    if f.choices.deferred_finalize == "on":
        b.errors.append("[DF4] moe.deferredFinalize=on: vLLM has no deferred-finalize switch; use engine sglang or bundled")
    return PlanMoE(runnerBackend=runner, a2aBackend=f.a2a, deferredFinalize=False)


def _vllm_moe_shape_problem(ck: CheckpointInfo, tp: int, dp: int, ep: int, runner: str) -> str | None:
    """vLLM 0.33.0's MoE split checks for one layout: the message it raises, or None.

    Without expert parallelism the MoE layer is tensor-parallel over tp x dp (FusedMoEParallelConfig.make,
    model_executor/layers/fused_moe/config.py:1198-1225, flatten_tp_across_dp_and_pcp :1112); with it, tp 1."""
    inter, hidden, block = ck.moeIntermediateSize, ck.hiddenSize, ck.weightBlockSize
    moe_tp = 1 if ep > 1 and tp * dp > 1 else tp * dp
    if inter is None or moe_tp == 1:
        return None
    if inter % moe_tp:  # FusedMoEConfig.__post_init__, fused_moe/config.py:1352
        return f"AssertionError in FusedMoEConfig.__post_init__: intermediate_size {inter} % tp_size {moe_tp} == 0"
    if not block or len(block) != 2 or ck.format != "fp8" or hidden is None:
        return None
    bn, bk = block
    ispp = inter // moe_tp
    if ispp % bn == 0 and ispp % bk == 0:
        return None
    # refine_fp8_moe_block_shape (oracle/fp8.py:292-321): a finer block gcd(bn, bk, ispp, hidden) >= 32
    refinable = math.gcd(bn, bk, ispp, hidden) >= 32
    if runner == "auto":
        # resolve_fp8_moe_weight_block_shape (oracle/fp8.py:355-395): under auto only the refinement; without one,
        # Fp8MoEMethod.create_weights -> validate_fp8_block_shape_moe raises (quantization/fp8.py:545-557,
        # quantization/utils/fp8_utils.py:1347-1373)
        if refinable:
            return None
        which = ("output_size of gate's and up's weight", bn) if ispp % bn else ("input_size of down's weight", bk)
        return (f"The {which[0]} = {ispp} is not divisible by weight quantization block_{'n' if which[1] == bn else 'k'} "
                f"= {which[1]}.")
    # an explicit backend: the refinement when its kernels take it, else whole-block padding of the TP shard
    # (pad_tp_shard_to_weight_blocks, oracle/fp8.py:324-352), which needs block-aligned global dims and pure TP
    if not refinable and (bn != bk or inter % bn or hidden % bn or ep != 1):
        return (f"Block-aligned FP8 TP sharding requires {bn}-aligned global expert dimensions, pure TP, and no LoRA "
                f"or expert bias. (intermediate {inter}, hidden {hidden}, ep {ep})")
    return None


def _vllm_0221_moe_shape_problem(ck: CheckpointInfo, tp: int, dp: int, ep: int) -> str | None:
    """vLLM 0.22.1's MoE split checks for one layout (any --moe-backend): the message it raises, or None.

    The MoE layer is tensor-parallel over tp x dp without expert parallelism, tp 1 with it
    (FusedMoEParallelConfig.make, model_executor/layers/fused_moe/config.py:1097-1220, flatten_tp_across_dp_and_pcp
    :1086); FusedMoE.__init__ asserts the split (fused_moe/layer.py:266). A block-FP8 checkpoint's shard must be whole
    blocks: Fp8MoEMethod.create_weights raises for intermediate_size_per_partition % block_n, and for % block_k when
    the tensor-parallel world (tp) is > 1 (quantization/fp8.py:624-647). 0.22.1 has neither 0.33.0's block refinement
    nor its shard padding (its oracle/fp8.py has no refine_fp8_moe_block_shape / pad_tp_shard_to_weight_blocks)."""
    inter, block = ck.moeIntermediateSize, ck.weightBlockSize
    moe_tp = 1 if ep > 1 and tp * dp > 1 else tp * dp
    if inter is None:
        return None
    if moe_tp > 1 and inter % moe_tp:
        return f"AssertionError in FusedMoE.__init__: intermediate_size {inter} % self.tp_size {moe_tp} == 0"
    if not block or len(block) != 2 or ck.format != "fp8":
        return None
    bn, bk = block
    ispp = inter // moe_tp
    if ispp % bn:
        return f"The output_size of gate's and up's weight = {ispp} is not divisible by weight quantization block_n = {bn}."
    if tp > 1 and ispp % bk:
        return f"The input_size of down's weight = {ispp} is not divisible by weight quantization block_k = {bk}."
    return None


_WK40_CITE = {
    "0.33.0": "vllm/model_executor/layers/fused_moe/oracle/fp8.py:292-395 and quantization/utils/fp8_utils.py:1347-1373, "
              "vLLM 0.33.0",
    "0.22.1": "vllm/model_executor/layers/fused_moe/layer.py:266 FusedMoE.__init__ and quantization/fp8.py:624-647 "
              "Fp8MoEMethod.create_weights, vLLM 0.22.1 (no block refinement or shard padding in that release)",
}


def _vllm_split_problem(ck: CheckpointInfo, tp: int, dp: int, ep: int, runner: str, ver: tuple[int, ...]) -> str | None:
    """The MoE split check of the vLLM release read at or below `ver`: 0.33.0's from 0.33.0, 0.22.1's for 0.22.1.
    Between them (releases not read) only what both refuse is refused (no refusal is guessed); before 0.22.1
    nothing is judged."""
    if ver >= (0, 33, 0):
        return _vllm_moe_shape_problem(ck, tp, dp, ep, runner)
    if ver < (0, 22, 1):
        return None
    old = _vllm_0221_moe_shape_problem(ck, tp, dp, ep)
    if ver[:3] == (0, 22, 1) or old is None:
        return old
    return old if _vllm_moe_shape_problem(ck, tp, dp, ep, runner) is not None else None


def vllm_moe_shape_errors(f: Facts, runner: str) -> list[str]:
    """WK40: vLLM refuses an MoE split it cannot shard (any runner): 0.33.0's checks from 0.33.0, 0.22.1's in 0.22.1
    (and what both refuse between them); releases before 0.22.1 are not judged."""
    tp, dp, ep, v = f.choices.tp, f.choices.dp, f.choices.ep, f.ver
    msg = _vllm_split_problem(f.ckpt, tp, dp, ep, runner, v)
    if msg is None:
        return []
    alts = [a for a, ok in (
        (f"parallelism.ep {tp * dp} (--enable-expert-parallel)", _vllm_split_problem(f.ckpt, tp, dp, tp * dp, runner, v) is None),
        ("--moe-backend triton (moe.runnerBackend)", runner == "auto" and _vllm_split_problem(f.ckpt, tp, dp, ep, "triton", v) is None),
    ) if ok]
    tps, left = _fits_tps(f, [t for t in (1, 2, 4, 8, 16, 32, 64)
                              if t != tp and _vllm_split_problem(f.ckpt, t, dp, ep, runner, v) is None])
    if tps:
        alts.append(f"tp {', '.join(map(str, tps))}")
    cite = _WK40_CITE["0.33.0" if v >= (0, 33, 0) else "0.22.1"]
    if (0, 22, 1) < v[:3] < (0, 33, 0):
        cite += f"; vLLM {f.version} was not read: refused because 0.22.1 and 0.33.0 both refuse it"
    return [f"[WK40] vLLM {f.version} refuses this layout at start-up: {msg} ({cite}). Works instead: "
            f"{'; '.join(alts) or 'no tp/ep split of this checkpoint'}{left}."]


def _plan_bundled(b: _Builder) -> PlanMoE:
    """The bundled runtime's rules: moe_core.resolve_bundled over the runtime capability table and the
    kernel-backend registry, the same call the runtime's plan check makes. The plan (plan.json) is
    the only channel to the pod: no MOE_* env is rendered for the runtime, the user's env passes
    through as it is."""
    f = b.f
    installed = {"flashinfer-python": f.flashinfer, "triton": "3.6" if not f.rocm else None}
    env_df = f.env("MOE_DEFERRED_FINALIZE")
    if env_df is not None:
        deferred, deferred_from = ("on" if truthy(env_df) else "off"), "MOE_DEFERRED_FINALIZE set explicitly by the user"
    else:
        deferred, deferred_from = f.choices.deferred_finalize, None
    user = f.choices.runner_backend
    r = resolve_bundled(family=f.fam, where=f.gpu_name, architecture=f.arch, checkpoint_format=f.fmt,
                        shared_experts=f.ckpt.numSharedExperts or 0, installed=installed, backend=user,
                        explicit=user != "auto", deferred=deferred, deferred_from=deferred_from,
                        tp=f.choices.tp, dp=f.choices.dp, ep=f.choices.ep, a2a=f.a2a, rocm=f.rocm,
                        nodes=f.choices.nodes)
    b.errors += r.errors
    b.warnings += r.warnings
    for d in r.decisions:
        b.decide(d.key, d.value, d.rule, d.reason)
    b.reasons += r.notes
    tp, ep, nodes = f.choices.tp, f.choices.ep, f.choices.nodes
    if max(tp, ep) > 1 and not r.errors:
        # moe-runtime serve --tp/--ep: one process per GPU (moe_runtime.parallel), over the nodes of a
        # LeaderWorkerSet group when nodes > 1
        args, why = parallel_args(tp, ep, nodes)
        b.args += args
        b.decide("parallel", f"tp={tp} ep={ep}" + (f" nodes={nodes}" if nodes > 1 else ""), "B6", why)
    return PlanMoE(runnerBackend=r.backend or user, a2aBackend=f.a2a, deferredFinalize=r.deferred)


# ------------------------------------------------------------------------------------------
# Where `auto` falls back (admission warnings, issue 16 item 3)

# Decision rule id -> (does this value fall back, what is given up). A fallback is an automatic
# choice made because the preferred path is unavailable for this format on this GPU (or in this
# engine release / image): the plan runs, slower or without a default optimisation.
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


def auto_fallbacks(p: Plan) -> list[str]:
    """Where this plan's automatic choices fall back (pure: plan in, messages out). Explicit values
    are never fallbacks (Rule 0); a plan with errors has no choices to judge (the caller reports those)."""
    if p.errors:
        return []
    out = []
    for d in p.decisions:
        fb = FALLBACKS.get(d.rule)
        if fb and fb[0](d.value):
            out.append(f"[{d.rule}] {d.key}={d.value}: {fb[1]}")
    # the release was not read: its start-up checks are not judged (engine_rules.coverage_note)
    out += [w for w in p.warnings if w.startswith(("[FI0] ", "[ER0] "))]
    auto = [d for d in p.decisions if d.key == "moe.runnerBackend" and d.rule == "B2"]
    if p.engine.name == "bundled" and auto:
        from moe_core.formats import expert_format
        wfmt = expert_format(p.checkpoint.format)
        ranked = [b.name for b in registry.candidates(p.gpu.family, wfmt)] if wfmt else []
        chosen = auto[-1].value
        better = ranked[:ranked.index(chosen)] if chosen in ranked else []
        for r in p.reasons:  # "[B3] NAME not used: WHY" (moe_core.bundled.resolve_bundled)
            name, _, why = r.removeprefix("[B3] ").partition(" not used: ")
            if r.startswith("[B3] ") and name in better:
                out.append(f"[B3] moe.runnerBackend={chosen}: {name} ranks above it for {wfmt} experts but is not "
                           f"used here: {why}")
    return out


def default_flashinfer(engine: str, version: str, gpu: GpuClass) -> str | None:
    """flashinfer-python in the engine's image when the user did not say."""
    if engine == "sglang":
        read = engine_rules.read_as("sglang", version)
        if read is not None:  # a release read (post releases are their own: 0.5.10.post1 pins another)
            return SGLANG_FLASHINFER_PIN.get(read)
        # not read: the planner assumes the pin of the newest release read below it (the plan warns ER0)
        key = ".".join(str(x) for x in vtuple(version)[:3])
        known = sorted(SGLANG_FLASHINFER_PIN, key=vtuple)
        below = [k for k in known if vtuple(k) <= vtuple(key)]
        return SGLANG_FLASHINFER_PIN[below[-1]] if below else None
    if engine == "bundled":
        from .images import bundled_image_flashinfer
        return bundled_image_flashinfer(gpu)
    return None


def _facts(checkpoint: CheckpointInfo, gpu: GpuClass, choices: Choices | None, engine: str,
           engine_version: str | None) -> Facts:
    choices = choices or Choices()
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")
    version = engine_version or DEFAULT_VERSIONS[engine]
    if engine == "bundled" and choices.runner_backend == "auto" and choices.env.get("MOE_RUNNER_BACKEND"):
        # The runtime's own env switch is an explicit choice too: validate it like the spec field.
        choices = dataclasses.replace(choices, runner_backend=choices.env["MOE_RUNNER_BACKEND"])
    fi = choices.flashinfer_version
    fi = None if fi == "none" else (fi or default_flashinfer(engine, version, gpu))
    return Facts(ckpt=checkpoint, gpu=gpu, choices=choices, engine=engine, version=version, flashinfer=fi)


def moe_split_refusal(f: Facts, runner: str = "auto") -> str | None:
    """The one predicate for an MoE tensor-parallel split that the chosen engine version refuses at start-up,
    whatever the runner: K40's text for sglang (sglang_moe_shape_errors), WK40's for vLLM (vllm_moe_shape_errors,
    with the --moe-backend value vLLM gets), None when the engine accepts the split (and for the bundled engine,
    whose own layout rules are resolve_bundled's). The planner's rows and placement's layout choice
    (split_refusal, placement.size_layout) both call it."""
    if f.engine == "sglang":
        return next(iter(sglang_moe_shape_errors(f)), None)
    if f.engine == "vllm":
        return next(iter(vllm_moe_shape_errors(f, "flashinfer_trtllm" if runner == "env" else runner)), None)
    return None


def split_refusal(checkpoint: CheckpointInfo, gpu: GpuClass, choices: Choices, engine: str,
                  engine_version: str | None = None) -> str | None:
    """moe_split_refusal, then attention_split_refusal (K41/WK41), for a layout the planner has not planned yet
    (placement sizes tp with it): the runner is the one plan() would give the engine (vLLM: the user's, W7's
    translation or the select table's)."""
    f = _facts(checkpoint, gpu, choices, engine, engine_version)
    return (moe_split_refusal(f, _vllm_pick_runner(_Builder(f)) if engine == "vllm" else "auto")
            or attention_split_refusal(f))


def plan(checkpoint: CheckpointInfo, gpu: GpuClass, choices: Choices | None = None,
         engine: str = "bundled", engine_version: str | None = None) -> Plan:
    """Plan the MoE backend/env/args for one checkpoint on one GPU class. Pure."""
    f = _facts(checkpoint, gpu, choices, engine, engine_version)
    choices, version = f.choices, f.version
    b = _Builder(f)
    if not checkpoint.is_moe:
        b.warnings.append(f"[M0] {checkpoint.architecture} has no routed experts in config.json: MoE rules do not apply")
    moe = {"bundled": _plan_bundled, "sglang": _plan_sglang, "vllm": _plan_vllm}[engine](b)
    if choices.a2a_backend != "none" and choices.ep <= 1 and engine != "bundled":
        b.errors.append(f"[A1] moe.a2aBackend={choices.a2a_backend} needs expert parallelism (parallelism.ep > 1)")
    env = {**b.env, **choices.env}  # user env last: the user always wins
    return Plan(
        gpu=PlanGpu(family=gpu.family, product=gpu.product),
        checkpoint=PlanCheckpoint(architecture=checkpoint.architecture, format=checkpoint.format),
        engine=PlanEngine(name=engine, version=version),
        moe=moe, env=env, args=b.args, reasons=b.reasons, warnings=b.warnings,
        errors=list(dict.fromkeys(b.errors)), decisions=b.decisions,
    )
