"""sglang's integer weight-only (GPTQ / AWQ / compressed-tensors WNA16) MoE paths: which `--quantization` the
plan must pass, which runners the layer methods accept, what auto runs. Validate rows over the plan's facts
(they need CheckpointInfo.quantScheme, which engine_rules.Case does not carry). Pure.

Read from the released wheel sglang==0.5.23 (PyPI); paths are inside the wheel (sglang/srt/...), lines are
0.5.23's. The functions the GPTQ / AWQ rows read (GPTQConfig / GPTQMarlinConfig / AWQConfig / AWQMarlinConfig /
MoeWNA16Config methods, AWQMoEScheme, the GPTQ Marlin kernel's create_moe_runner, marlin_utils' type and group
checks) have the same AST in the wheels of 0.5.14-0.5.22 (0.5.15.post1 included; marlin_utils differs only in a
missing-capability guard), and ModelConfig._verify_quantization differs there only in methods and draft-model cases
these rows do not use, except that 0.5.14-0.5.19 still list 'gptq' as ROCm-supported (removed in 0.5.20): there a
non-Marlin GPTQ checkpoint on ROCm reaches GPTQConfig's MoE TypeError instead. 0.5.13 and older differ (the GPTQ
Marlin MoE runner, AWQMoEScheme; no gptq/ package before 0.5.13). The compressed-tensors rows
(CompressedTensorsConfig.get_moe_scheme's WNA16 branch, CompressedTensorsWNA16MoE) hold for 0.5.15-0.5.23 (0.5.15-0.5.18
branch identical to 0.5.17's; 0.5.14 takes the scheme from the "Linear" target group and is not judged): 0.5.19-0.5.21
differ only in NPU paths, log lines and (0.5.21 and older) _is_wNa16_group_channel not requiring integer weights,
which integer checkpoints do not notice; 0.5.15-0.5.18 have no Triton scheme gate (an explicit triton takes any
WNA16 scheme) and no SM100 auto-Triton (auto runs Marlin). Releases outside those ranges are not judged by these
rows (SQ0 says so).

How sglang 0.5.23 resolves a WNA16 checkpoint:
  * `--quantization`: ModelConfig._verify_quantization (configs/model_config.py:2000-2171) asks every method's
    override_quantization_method with the user's value: GPTQ becomes gptq_marlin when
    GPTQMarlinConfig.is_gptq_marlin_compatible (layers/quantization/gptq/gptq.py:414-482: bits/group_size/sym/
    desc_act present, (bits, sym) in {(4, True), (8, True)}, Marlin group sizes -1/32/64/128), AWQ becomes
    awq_marlin when AWQMarlinConfig.is_awq_marlin_compatible (awq/awq.py:333-424: CUDA, 4 bits with zero
    points); moe_wna16 only when asked (moe_wna16.py:164-192). The SM100 model overrides of the DeepSeek, Qwen3
    and GLM-4 families copy config.json's quant_method into --quantization when it is unset
    (arg_groups/overrides.py:764-810, model_overrides/qwen3_moe.py:37-49, glm4_moe.py:15-33), and an explicit
    'gptq' / 'awq' keeps the non-Marlin config, whose MoE layers fail (below); so the plan always passes the
    value sglang would pick by itself, which no override replaces;
  * ROCm: gptq, gptq_marlin and moe_wna16 are not in rocm_supported_quantization (model_config.py:2002-2016,
    2156-2160); AWQ stays 'awq' there (no Marlin off CUDA) and AWQConfig has no MoE method off NPU;
  * layer: GPTQMarlinMoEScheme / AWQMoEScheme assert the runner is auto and run Marlin
    (hardware_backend/gpu/quantization/gptq_kernels.py:306-311, awq/schemes/awq_moe.py:129-134); MoeWNA16Method
    runs Triton whatever the runner (moe_wna16.py:379-383); compressed-tensors WNA16 picks MxInt4 (flashinfer_trtllm,
    symmetric INT4 group 32), Triton (ROCm, an explicit triton, or auto on SM100 for symmetric INT4 group 32/128
    without actorder) or Marlin (compressed_tensors/compressed_tensors.py:912-951).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_core.checkpoint import QuantScheme

from ... import engine_rules
from ...engine_rules import vt
from ...selection import Check, Facts
from .startup import FP8_METHOD

# releases whose code these rows were read from, per method (see above)
_FROM_15 = ("0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
READ = {"gptq": ("0.5.14",) + _FROM_15, "awq": ("0.5.14",) + _FROM_15, "compressed-tensors": _FROM_15}
# the Triton WNA16 scheme gate and the SM100 auto-Triton default of compressed-tensors (compressed_tensors.py:925-947)
_CT_TRITON_GATE = (0, 5, 19)
_METHOD = {"gptq": "gptq", "awq": "awq", "ct_wna16": "compressed-tensors", "ct_int4_g32": "compressed-tensors"}
WNA16_FORMATS = frozenset({"gptq", "awq", "ct_wna16", "ct_int4_g32"})
MARLIN_GROUPS = (-1, 32, 64, 128)  # layers/quantization/marlin_utils.py:44 MARLIN_SUPPORTED_GROUP_SIZES
_Q = "sglang/srt/layers/quantization/"


def judged(fmt: str, version: str) -> bool:
    return engine_rules.read_as("sglang", version) in READ.get(_METHOD.get(fmt, ""), ())


@dataclass(frozen=True)
class Layer:
    fmt: str
    s: QuantScheme
    family: str
    version: str = "0.5.23"

    @property
    def rocm(self) -> bool:
        return self.family.startswith("gfx")

    @property
    def ct(self) -> bool:
        return self.s.method == "compressed-tensors"


def layer(f: Facts) -> Layer | None:
    s = f.ckpt.quantScheme
    if f.fmt not in WNA16_FORMATS or s is None or not judged(f.fmt, f.version):
        return None
    return Layer(f.fmt, s, f.fam, f.version)


def gptq_marlin_compatible(s: QuantScheme) -> bool:
    """GPTQMarlinConfig.is_gptq_marlin_compatible (gptq/gptq.py:459-482) on an SM80+ GPU."""
    if None in (s.bits, s.groupSize, s.sym, s.descAct):
        return False
    return (s.bits, s.sym) in ((4, True), (8, True)) and s.groupSize in MARLIN_GROUPS


def awq_marlin_compatible(s: QuantScheme) -> bool:
    """AWQMarlinConfig.is_awq_marlin_compatible (awq/awq.py:402-424) on CUDA SM80+: Marlin has a zero-point type for
    4 bits only (marlin_utils.py:93-95 query_marlin_supported_quant_types)."""
    return s.bits == 4 and s.zeroPoint is True and s.groupSize in MARLIN_GROUPS


def resolve(x: Layer) -> tuple[str | None, str]:
    """(the --quantization value sglang builds the MoE layers with, or None: the checkpoint cannot start; the reason
    with its source)."""
    s = x.s
    if x.ct:
        if s.bits not in (4, 8) or (s.checkpointFormat or "pack-quantized") != "pack-quantized":
            return None, (f"For Fused MoE layers, only pack-quantized is supported for the following bits: [4, 8] "
                          f"(here {s.bits}-bit, format {s.checkpointFormat}; CompressedTensorsWNA16MoE.__init__, "
                          f"{_Q}compressed_tensors/schemes/compressed_tensors_wNa16_moe.py:86-93). Works instead: a 4- or 8-bit "
                          "pack-quantized export")
        return "compressed-tensors", "config.json quant_method (no override changes it)"
    if x.rocm:
        if s.method == "gptq":
            q = "gptq_marlin" if gptq_marlin_compatible(s) else "gptq"
            if q == "gptq" and vt(x.version) < (0, 5, 20):  # 'gptq' still in the ROCm list (0.5.14-0.5.19)
                return None, ("GPTQ Method does not support MoE, please use gptq_marlin (GPTQConfig.get_quant_method, "
                              f"{_Q}gptq/gptq.py:173-179; sglang 0.5.14-0.5.19 list 'gptq' as ROCm-supported, "
                              "gptq_marlin and moe_wna16 are not). Works instead: an NVIDIA GPU")
            return None, (f"{q} quantization is currently not supported in ROCm. (ModelConfig._verify_quantization, "
                          "sglang/srt/configs/model_config.py:2156-2160; moe_wna16 is not in its ROCm list either, :2002-2016). "
                          "Works instead: an NVIDIA GPU")
        return None, ("AWQ MoE has no ROCm path: AWQ stays 'awq' off CUDA (is_awq_marlin_compatible, "
                      f"{_Q}awq/awq.py:409-410), AWQConfig.get_quant_method builds no MoE method off NPU (awq.py:136-160), "
                      "so FusedMoE falls back to the unquantized method (layers/moe/fused_moe_triton/layer.py:499-504) "
                      "with no parameters for the checkpoint's qweight/qzeros/scales; moe_wna16 is not in ROCm's list "
                      "(configs/model_config.py:2002-2016, 2156-2160). Works instead: an NVIDIA GPU")
    if s.method == "gptq":
        if gptq_marlin_compatible(s):
            return "gptq_marlin", (f"GPTQMarlinConfig.is_gptq_marlin_compatible ({_Q}gptq/gptq.py:459-482): what sglang "
                                   "resolves itself (override_quantization_method, :414-438)")
        if not s.descAct and s.bits in (4, 8):
            return "moe_wna16", (f"not Marlin-compatible ({s.bits}-bit, sym={s.sym}, group {s.groupSize}): without it "
                                 "sglang keeps GPTQConfig, which raises 'GPTQ Method does not support MoE, please use "
                                 f"gptq_marlin' ({_Q}gptq/gptq.py:173-179); MoeWNA16Config takes it "
                                 "(is_moe_wna16_compatible, moe_wna16.py:164-192)")
        return None, (f"GPTQ Method does not support MoE, please use gptq_marlin (GPTQConfig.get_quant_method, "
                      f"{_Q}gptq/gptq.py:173-179): not Marlin-compatible ({s.bits}-bit, sym={s.sym}, group "
                      f"{s.groupSize}, desc_act={s.descAct}; gptq.py:459-482) and not moe_wna16-compatible (desc_act, "
                      "bits 4/8; moe_wna16.py:170-192). Works instead: a GPTQ export with sym=true (Marlin) or "
                      "desc_act=false (moe_wna16)")
    if awq_marlin_compatible(s):
        return "awq_marlin", f"AWQMarlinConfig.is_awq_marlin_compatible ({_Q}awq/awq.py:402-424): what sglang resolves itself"
    if s.bits == 4:
        return "moe_wna16", (f"not Marlin-compatible (zero_point={s.zeroPoint}, group {s.groupSize}): AWQConfig builds no "
                             f"MoE method on CUDA ({_Q}awq/awq.py:136-160); MoeWNA16Config takes 4-bit AWQ "
                             "(is_moe_wna16_compatible, moe_wna16.py:170-192)")
    return None, (f"AWQ {s.bits}-bit MoE: not Marlin-compatible (awq/awq.py:402-424), AWQConfig builds no MoE method on "
                  f"CUDA ({_Q}awq/awq.py:136-160) and moe_wna16 takes 4-bit AWQ only (moe_wna16.py:186-190). Works instead: "
                  "a 4-bit AWQ export")


def ct_triton_supported(s: QuantScheme) -> bool:
    """CompressedTensorsConfig._is_wna16_triton_moe_supported (compressed_tensors.py:653-661)."""
    return (s.bits == 4 and s.strategy == "group" and s.groupSize in (32, 128) and s.sym is True
            and not s.actorder)


def ct_mxint4(s: QuantScheme) -> bool:
    """_is_mxint4a16 (compressed_tensors.py:663-674): symmetric INT4 group 32."""
    return s.bits == 4 and s.strategy == "group" and s.groupSize == 32 and s.sym is True


def runner_problem(x: Layer, runner: str) -> str | None:
    """Why the layer refuses an explicit runner (None: accepted, perhaps ignored: runner_ignored)."""
    q, _ = resolve(x)
    if q is None or runner == "auto":
        return None
    if q in ("gptq_marlin", "awq_marlin"):
        where = ("GPTQMarlinMoEKernel.create_moe_runner, sglang/srt/hardware_backend/gpu/quantization/gptq_kernels.py:306-311"
                 if q == "gptq_marlin" else f"AWQMoEScheme.create_moe_runner, {_Q}awq/schemes/awq_moe.py:129-134")
        return f"AssertionError: get_moe_runner_backend().is_auto() ({q} MoE runs Marlin only; {where})"
    if runner in ("flashinfer_cutlass", "flashinfer_cutedsl"):
        name = ("FlashInfer Cutlass MOE supports only" if runner == "flashinfer_cutlass"
                else "FlashInfer CuteDSL MOE currently supports only")
        return (f"Invalid quantization '{q}'. {name}: 'modelopt_fp4', ... (handle_moe_kernel_config, "
                "sglang/srt/arg_groups/moe_hook.py:78-101)")
    if q == "compressed-tensors" and runner == "triton" and not ct_triton_supported(x.s) \
            and vt(x.version) >= _CT_TRITON_GATE:
        return ("The Triton WNA16 MoE backend only supports symmetric INT4 group quantization with group_size=32 or 128 "
                f"and no actorder. (CompressedTensorsConfig.get_moe_scheme, {_Q}compressed_tensors/compressed_tensors.py:"
                "925-937)")
    return None


def runner_ignored(x: Layer, runner: str) -> str | None:
    """The kernel the layer runs instead of an explicit runner it does not use (a warning, not a refusal)."""
    q, _ = resolve(x)
    if q == "moe_wna16" and runner not in ("auto", "triton") and runner_problem(x, runner) is None:
        return f"MoeWNA16Method runs Triton whatever --moe-runner-backend says ({_Q}moe_wna16.py:379-383)"
    if q == "compressed-tensors" and runner not in ("auto", "triton") and runner_problem(x, runner) is None \
            and not (runner == "flashinfer_trtllm" and ct_mxint4(x.s)) and not x.rocm:
        return (f"compressed-tensors WNA16 MoE runs Marlin for --moe-runner-backend {runner} "
                f"(CompressedTensorsWNA16MoE.create_moe_runner, {_Q}compressed_tensors/schemes/"
                "compressed_tensors_wNa16_moe.py:420-424; compressed_tensors.py:912-951)")
    return None


def auto_kernel(x: Layer) -> str | None:
    q, _ = resolve(x)
    if q is None:
        return None
    if q in ("gptq_marlin", "awq_marlin"):
        return "marlin"
    if q == "moe_wna16":
        return "triton"
    if x.rocm or (x.family == "sm100" and ct_triton_supported(x.s) and vt(x.version) >= _CT_TRITON_GATE):
        return "triton"
    return "marlin"


def _start(f: Facts) -> str | None:
    x = layer(f)
    return resolve(x)[1] if x is not None and resolve(x)[0] is None else None


def _runner(f: Facts, r: str) -> str | None:
    x = layer(f)
    return runner_problem(x, r) if x is not None else None


CHECKS: tuple[Check, ...] = (
    Check("SQ1", lambda f, r: _start(f) is not None, "reject",
          "sglang {version} cannot start this {fmt} checkpoint's MoE layers on {gpu} (any --moe-runner-backend; "
          "lines of sglang 0.5.23, the same code in the releases engines/sglang/quant.py names)"),
    Check("SQ2", lambda f, r: r != "auto" and _runner(f, r) is not None, "reject",
          "sglang {version} refuses --moe-runner-backend {value} for this {fmt} checkpoint at start-up (lines of "
          "sglang 0.5.23, the same code in the releases engines/sglang/quant.py names)"),
)


def detail(f: Facts, runner: str) -> dict[str, str]:
    x = layer(f)
    if x is None:
        return {}
    if (why := _start(f)) is not None:
        return {"SQ1": why}
    if runner != "auto" and (p := runner_problem(x, runner)):
        return {"SQ2": p}
    return {}


def plan_notes(f: Facts, runner: str) -> tuple[list[str], list[str], list[tuple[str, str, str, str]]]:
    """(warnings, args to pass, decisions [(key, value, rule, reason)]) for a WNA16 checkpoint."""
    warnings: list[str] = []
    args: list[str] = []
    decisions: list[tuple[str, str, str, str]] = []
    if f.fmt in WNA16_FORMATS and not judged(f.fmt, f.version):
        read = READ[_METHOD[f.fmt]]
        warnings.append(f"[SQ0] sglang {f.version}: the {_METHOD[f.fmt]} MoE rules were read for sglang {read[0]}-{read[-1]} "
                        "only; not judged for this release (no --quantization is passed; no rule is inferred across "
                        "releases)")
        decisions.append(("quant.judged", "no", "SQ0", f"sglang {f.version} not among the releases the {_METHOD[f.fmt]} "
                                                     f"MoE rules were read for ({read[0]}-{read[-1]})"))
    x = layer(f)
    if x is None and f.fmt in WNA16_FORMATS and f.ckpt.quantScheme is None and judged(f.fmt, f.version):
        warnings.append(f"[SQ4] {f.fmt} without its quantization parameters (bits, group size, symmetry: the checkpoint "
                        "was not inspected, e.g. spec.model.format set by hand): --quantization and the runner checks of "
                        "these rows are not judged; sglang resolves --quantization itself")
    if x is None:
        return warnings, args, decisions
    q, why = resolve(x)
    if q is None:
        return warnings, args, decisions
    if q != "compressed-tensors":
        args += ["--quantization", q]
        decisions.append(("args.--quantization", q, "SQ-Q", f"sglang {f.version} builds this {f.fmt} checkpoint's MoE "
                                                          f"layers with --quantization {q}: {why}"))
    if (ign := runner_ignored(x, runner)) is not None:
        warnings.append(f"[SQ3] --moe-runner-backend {runner} has no effect for this {f.fmt} checkpoint: {ign}")
    if runner == "auto" and (k := auto_kernel(x)):
        decisions.append(("quant.moeKernel", k, "SQ-AUTO", f"sglang {f.version} runs this {f.fmt} checkpoint's experts on "
                                                           f"{k} on {f.gpu_name} (--quantization {q})"))
    return warnings, args, decisions


# ---- env-gated backends -------------------------------------------------------------------------------------------
# UnquantizedFusedMoEMethod builds the AITER runner only with SGLANG_USE_AITER=1 on ROCm (_use_aiter,
# layers/quantization/unquant.py:70, :1196-1219, sglang 0.5.23); without it an explicit --moe-runner-backend aiter
# runs the Triton runner built just before (:1169-1194). The plan renders the variable for it; a user's off value is
# kept (the user's env wins) and reported.
# Fp8MoEMethod (fp8, and DeepSeek-V4's FP8 / FP4-packed experts) has the same gate: `_use_aiter =
# envs.SGLANG_USE_AITER.get() and _is_hip` (layers/quantization/fp8.py:149, 0.5.23; the same line in every release
# read from 0.5.10), and Fp8MoEMethod.maybe_get_hip_aiter_quant_info returns None without it (fp8.py:3409-3415),
# so apply() falls through to "Unsupported runner backend" (fp8.py:3356-3359). The plan renders the variable there
# too, and startup row SG-FP8-AITER sees the rendered env merged with the user's (selection._engine_case): it
# refuses only where the user turned it off, or off ROCm.
AITER_READ = ("0.5.23",)
_FALSY = ("0", "false", "no", "off")


def aiter_env(f: Facts, runner: str) -> tuple[list[str], list[tuple[str, str, str, str]]]:
    """(warnings, env [(key, value, rule, reason)]) for an explicit aiter runner on ROCm: unquantized experts
    (releases in AITER_READ) and Fp8MoEMethod's formats (every release read; unread ones are not judged)."""
    if runner != "aiter" or not f.rocm:
        return [], []
    v = f.choices.env.get("SGLANG_USE_AITER")
    if f.fmt in FP8_METHOD and engine_rules.read_as("sglang", f.version) is not None:
        if v is not None:  # the user's value stands; off, SG-FP8-AITER refuses it with this value
            return [], []
        return [], [("SGLANG_USE_AITER", "1", "SQ-AITER",
                     f"--moe-runner-backend aiter on {f.fmt} experts runs only with SGLANG_USE_AITER=1 on ROCm: sglang "
                     f"{f.version} Fp8MoEMethod.maybe_get_hip_aiter_quant_info returns None without it and apply() raises "
                     "'Unsupported runner backend' (layers/quantization/fp8.py:149, 3409-3415, 3356-3359 in 0.5.23)")]
    if f.fmt != "bf16" or engine_rules.read_as("sglang", f.version) not in AITER_READ:
        return [], []
    if v is not None and v.strip().lower() in _FALSY:
        return [f"[SQ-AITER] --moe-runner-backend aiter with SGLANG_USE_AITER={v}: sglang {f.version} builds no AITER "
                "runner for unquantized experts and runs Triton (layers/quantization/unquant.py:70, 1169-1219)"], []
    return [], [("SGLANG_USE_AITER", "1", "SQ-AITER",
                 f"--moe-runner-backend aiter runs AITER's fused MoE only with SGLANG_USE_AITER=1 on ROCm; unset, sglang "
                 f"{f.version} runs Triton (UnquantizedFusedMoEMethod.create_moe_runner, layers/quantization/unquant.py:70, "
                 "1169-1219)")]
