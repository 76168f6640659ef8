"""sglang's start-up checks of `--moe-runner-backend` / `--moe-a2a-backend`, as rows.

Every release from 0.5.10 to 0.5.23, post releases included, is read from its wheel (PyPI) into
data/sglang.json by scripts/engine_rules_extract.py: the choices, the fused-function registrations,
the flashinfer pin, and for every row whether (and where) the release has its check; a check whose
code differs from every other release read carries the reader's note there. A row applies to a
release that has its check (engine_rules._applies); line numbers here are 0.5.23's, and a refusal
cites the first release read that has the check. Paths are inside the wheel.

Where the checks run (0.5.23):
  * server arguments: `srt/arg_groups/moe_hook.py` `handle_moe_kernel_config` (runner x quantization,
    ep), `handle_a2a_moe` (a2a x runner, attention DP, architecture registries);
  * layer build: each quantization method's `__init__` / `create_moe_runner` / `apply`
    (`srt/layers/quantization/*.py`) and `MoeRunner.__init__` (`srt/layers/moe/moe_runner/runner.py`),
    which needs a fused function registered for (a2a, runner) for the fused-only runners
    (`@register_fused_func` in `srt/layers/moe/moe_runner/*.py`) or a permute method for the
    dispatch format (`PermuteMethodPool.get_pre_permute`, `moe_runner/base.py`). The first forward
    (CUDA-graph capture / warm-up) runs before the server reports ready, so `apply` errors are
    start-up errors too;
  * `--deepep-mode` (auto | normal | low_latency) in `handle_a2a_moe`: Case.deepep_mode is what the planner
    passes (it passes low_latency only, for flashinfer_cutedsl under deepep: S15/S15b);
  * the FlashInfer package itself: the flashinfer runners import it when a layer builds or first runs
    (SG-FI-ABSENT, for an image declared without it: engine.flashinferVersion none);
  * shapes: the layer methods' alignment checks take Case.hidden / Case.moe_inter (config.json) and the
    per-rank split moe_tp_size(tp, ep, a2a). The split checks that hold for every runner (FusedMoE.__init__,
    check_quantized_moe_compatibility) are the planner's K40, and the attention layers' head-split asserts its
    K41; both run on automatic choices too and size placement's layouts (planner.split_refusal).
"""

from __future__ import annotations

from ...engine_rules import Case, Rule, Source, read_as, recorded, vt
from .vocab import DEEPSEEK_FAMILY as _DEEPSEEK_FAMILY_ARCHS, QWEN3_FAMILY as _QWEN3_FAMILY_ARCHS

A2A_FLAG = "--moe-a2a-backend"

V = "0.5.23"

# --moe-runner-backend / --moe-a2a-backend choices per release read, extracted from each wheel by
# scripts/engine_rules_extract.py (MOE_RUNNER_BACKEND_CHOICES / MOE_A2A_BACKEND_CHOICES in server_args.py
# to 0.5.19, the fields' Arg(choices=...) in srt/arg_groups/fields/exec_.py from 0.5.20; data/sglang.json
# names the line per release).
RUNNER_CHOICES = {v: tuple(r["runner_choices"]["values"]) for v, r in recorded.releases("sglang").items()}
A2A_CHOICES = {v: tuple(r["a2a_choices"]["values"]) for v, r in recorded.releases("sglang").items()}


def _of_release(table: dict, version: str):
    """The row of this very release; a release not read has none (its checks are not judged)."""
    key = read_as("sglang", version)
    if key is None or key not in table:
        raise ValueError(f"sglang {version} was not read: its start-up checks are not judged")
    return table[key]


def choices(version: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Values accepted by this release (read releases only)."""
    return tuple(dict.fromkeys(_of_release(RUNNER_CHOICES, version))), _of_release(A2A_CHOICES, version)


# Architectures whose model override copies config.json's quant_method into --quantization
# (on SM100 only for the first three groups): overrides.py:745-760 `_DEEPSEEK_FAMILY_ARCHS`,
# model_overrides/qwen3_moe.py:29-49, glm4_moe.py:15-32 (0.5.23); the two family sets are engines/sglang/vocab.py's.
QUANT_RESOLVING_ARCHS = _DEEPSEEK_FAMILY_ARCHS | _QWEN3_FAMILY_ARCHS | {"Glm4MoeForCausalLM"}
# Other overrides that resolve --quantization (model_overrides/minimax_m3.py:37-54, nemotron_h.py:17-55,
# gemma4.py:17-47): the value is not known here, so the quantization asserts are skipped for them.
QUANT_RESOLVING_ANYWHERE = frozenset({
    "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration", "NemotronHForCausalLM",
    "NemotronHPuzzleForCausalLM", "NemotronH_Omni_Reasoning_V3", "Gemma4ForConditionalGeneration", "Gemma4ForCausalLM",
    "Gemma4UnifiedForConditionalGeneration", "DiffusionGemmaForBlockDiffusion",
})

_NEMOTRON_H = frozenset({"NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "NemotronH_Omni_Reasoning_V3"})

# FlashInfer MegaMOE validated architectures (moe_hook.py:242-256 validate_flashinfer_megamoe_model).
MEGAMOE_ARCHS = frozenset({
    "BeamForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV4ForCausalLM",
    "Glm4MoeForCausalLM", "GlmMoeDsaForCausalLM", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM",
    "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "KimiK3ForConditionalGeneration", "KimiK3LinearForCausalLM",
})
# DeepEP v2 registered architectures (srt/configs/moe_model_registry.py:20-28 `_DEEPEP_V2_MODELS`).
DEEPEP_V2_ARCHS = frozenset({
    "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "Qwen3MoeForCausalLM", "Glm5NextForConditionalGeneration",
    "GlmMoeDsaForCausalLM", "MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM",
})

# Fused-only runners: MoeRunner.__init__ sets runner_core = None for them (runner.py:117-162) and
# then needs a fused function for (a2a, runner) (runner.py:166-180).
FUSED_ONLY = frozenset({"marlin", "flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutedsl",
                        "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_megamoe", "hpc_ops"})
# Per release read: every @register_fused_func(a2a, runner) of the wheel (data/sglang.json, extracted).
# The row that uses them (SG-FUSED) applies where its check is (from 0.5.15: MoeRunner.__init__ with
# fused-only runners; 0.5.10-0.5.14 built their runners differently).
FUSED_FUNCS_BY_RELEASE = {v: frozenset(tuple(p) for p in r["fused_funcs"]) for v, r in recorded.releases("sglang").items()}


def _fused_funcs(version: str) -> frozenset:
    """Registered (a2a, runner) pairs of this very release (read releases only)."""
    return _of_release(FUSED_FUNCS_BY_RELEASE, version)
# Runners with a runner core take the dispatcher's output through a registered pre-permute for
# its format (base.py PermuteMethodPool.get_pre_permute asserts): triton.py:268 (standard only),
# triton_kernels.py:161 (standard only), humming.py:839,887,929 (deepep_ll, deepep_normal, standard).
# Dispatch formats: deepep -> deepep_normal/deepep_ll, deepep_v2 -> deepep_v2, flashinfer -> flashinfer
# (token_dispatcher/base.py:170-176 DispatchOutputFormat).
_PERMUTE_FORMATS = {"triton": frozenset({"none"}), "triton_kernel": frozenset({"none"}),
                    "humming": frozenset({"none", "deepep"})}

# Layer quantization methods by checkpoint format (planner vocabulary):
NVFP4_METHOD = frozenset({"nvfp4"})  # ModelOptNvFp4FusedMoEMethod (modelopt_quant.py:2362)
MXFP4_METHOD = frozenset({"mxfp4"})  # Mxfp4MoEMethod (mxfp4.py:387), serialized MXFP4 (gpt-oss)
FP8_METHOD = frozenset({"fp8", "dsv4_fp8", "dsv4_fp4"})  # Fp8MoEMethod (fp8.py:1490; DSV4 FP4 experts: is_fp4_experts)
SM90_SM100_SM12X = frozenset({"sm90", "sm100", "sm120", "sm121"})  # is_sm90 / is_sm100 / platform is_sm120 (major 12)
BLACKWELL = frozenset({"sm100", "sm110", "sm120", "sm121"})  # platform is_blackwell (major 10, 11, 12)


def _cutedsl_a2a(c: Case) -> tuple[str, ...]:
    return ("none", "deepep") if vt(c.version) < (0, 5, 13) else ("none", "deepep", "flashinfer")


def _runner_substituted(c: Case) -> bool:
    """The layer method does not build a MoeRunner with the requested fused-only runner:
    Fp8MoEMethod runs flashinfer_cutlass/cutedsl layers on triton (fp8.py:2973-2983) and takes
    marlin/flashinfer_mxfp4 as direct kernels without a MoeRunner (fp8.py:2985-2998) unless the
    experts are FP4 (then Mxfp4MarlinMoEMethod / Mxfp4Flashinfer*MoEMethod build one, fp8.py:445-470);
    UnquantizedFusedMoEMethod builds triton for every runner but trtllm/flashinfer_cutlass/deep_gemm/
    triton_kernel (unquant.py:1169-1194)."""
    if c.fmt in ("fp8", "dsv4_fp8"):
        return c.runner in ("flashinfer_cutlass", "flashinfer_cutedsl", "marlin", "flashinfer_mxfp4")
    if c.fmt == "dsv4_fp4":
        return c.runner in ("flashinfer_cutlass", "flashinfer_cutedsl")
    if c.fmt == "bf16":
        return c.runner in ("flashinfer_cutedsl", "marlin", "flashinfer_mxfp4")
    return False


_DEEPEP_MOE_A2A = frozenset({"deepep", "deepep_v2", "mooncake", "nixl", "pplx"})


def _deepep_modern(c: Case) -> bool:
    """DeepEPMoE.__init__ (ep_moe/layer.py:98-149, 0.5.23) sets deprecate_flag (= run the layer through the
    fused-MoE runner) for: deepep_v2, humming, aiter (ROCm), NPU, an Fp8Config checkpoint with JIT DeepGEMM,
    SGLANG_DEEPEP_BF16_DISPATCH with JIT DeepGEMM, flashinfer_cutedsl with ModelOpt NVFP4, deep_gemm with
    MXFP4 and JIT DeepGEMM, unquantized BF16 with deep_gemm under deepep/pplx."""
    jit = not _no_jit_deepgemm(c)
    runner = _effective_runner(c)
    return (c.a2a == "deepep_v2" or runner == "humming" or c.rocm
            or (jit and c.fmt in FP8_METHOD)
            or (jit and c.truthy("SGLANG_DEEPEP_BF16_DISPATCH"))
            or (runner == "flashinfer_cutedsl" and c.fmt in ("nvfp4", "mixed"))
            or (jit and runner == "deep_gemm" and c.fmt == "mxfp4")
            or (c.fmt == "bf16" and runner == "deep_gemm" and c.a2a in ("deepep", "pplx")))


def _effective_runner(c: Case) -> str:
    """handle_a2a_moe resolves runner auto -> deep_gemm for pplx (moe_hook.py:603-611) and deepep_v2 (:404-412)."""
    return "deep_gemm" if c.runner == "auto" and c.a2a in ("pplx", "deepep_v2") else c.runner


def _no_jit_deepgemm(c: Case) -> bool:
    """ENABLE_JIT_DEEPGEMM is False below SM90 or with SGLANG_ENABLE_JIT_DEEPGEMM=0 (configurer.py:31-37;
    environ.py:1348 default True). SM120/121 depend on the installed DeepGEMM build: not decided here."""
    v = c.env.get("SGLANG_ENABLE_JIT_DEEPGEMM", c.env.get("SGL_ENABLE_JIT_DEEPGEMM"))
    return c.family in ("sm80", "sm89") or (v is not None and v.strip().lower() in ("0", "false", "no", "off"))


def moe_tp_size(tp: int, ep: int, a2a: str) -> int:
    """sglang's moe_tp_size = tp_size // moe_ep_size // moe_dp_size (moe_ep_setup.py:154, 0.5.23); an all-to-all
    backend makes ep = tp (handle_a2a_moe); --moe-dp-size is never passed (1)."""
    ep = tp if a2a not in ("none", "ascend_tp") else ep
    return max(tp // max(ep, 1), 1)


def fi_mxfp4_cutlass_misaligned(family: str, version: str, hidden: int | None, moe_inter: int | None,
                                moe_tp: int) -> str | None:
    """DeepSeek-V4 FP4 experts with flashinfer_mxfp4 build Mxfp4FlashinferCutlassMoEMethod on SM90 (from 0.5.14)
    and SM120/SM121 (from 0.5.17: fp8.py Fp8Config.get_quant_method, :459-466 in 0.5.23), whose create_weights
    raises unless hidden_size and intermediate_size_per_partition (= moe_intermediate_size // moe_tp_size,
    FusedMoE.__init__ fused_moe_triton/layer.py:427-428) are multiples of 128. Returns the numbers, or None."""
    on = family == "sm90" or (family in ("sm120", "sm121") and vt(version) >= (0, 5, 17))
    if not on or hidden is None or moe_inter is None or vt(version) < (0, 5, 14):
        return None
    per = moe_inter // moe_tp
    if hidden % 128 or per % 128:
        return f"hidden={hidden}, intermediate={per} (moe_intermediate_size {moe_inter} / moe_tp_size {moe_tp})"
    return None


def _quant(c: Case) -> tuple[bool, str | None]:
    if c.arch in QUANT_RESOLVING_ANYWHERE:
        return False, None
    return server_quantization(c)


def _quant_not_in(allowed: tuple) -> "callable":
    def pred(c: Case) -> bool:
        known, q = _quant(c)
        return known and q not in allowed
    return pred


def _src(file: str, lines: str, function: str, since: str, marker: str) -> Source:
    return Source(file=file, lines=lines, function=function, version=V, since=since, marker=marker)


_MH = "sglang/srt/arg_groups/moe_hook.py"
_RUN = "sglang/srt/layers/moe/moe_runner/runner.py"
_MQ = "sglang/srt/layers/quantization/modelopt_quant.py"
_MX = "sglang/srt/layers/quantization/mxfp4.py"
_F8 = "sglang/srt/layers/quantization/fp8.py"

RULES: tuple[Rule, ...] = (
    # ---- command line -------------------------------------------------------------------------
    Rule("SG-A2A", "sglang", lambda c: c.a2a not in choices(c.version)[1],
         "argument --moe-a2a-backend: invalid choice: '{a2a}'",
         _src("sglang/srt/arg_groups/fields/exec_.py", "836-866", "ExecArgs.moe_a2a_backend (argparse choices)",
              "0.5.10", '"ascend_fuseep"'), flag="a2a"),

    # ---- server arguments: handle_moe_kernel_config ------------------------------------------
    Rule("SG-FICUTLASS-Q", "sglang",
         lambda c: c.runner == "flashinfer_cutlass" and _quant_not_in(("modelopt_fp4", "modelopt_fp8", "modelopt_mixed", None))(c),
         "Invalid quantization '{quant}'. FlashInfer Cutlass MOE supports only: 'modelopt_fp4', 'modelopt_fp8', "
         "'modelopt_mixed', or bfloat16 (None).",
         _src(_MH, "78-88", "handle_moe_kernel_config", "0.5.10", "FlashInfer Cutlass MOE supports only"),
         same_as=("K23", "V8b")),
    Rule("SG-FICUTLASS-EP", "sglang", lambda c: c.runner == "flashinfer_cutlass" and c.ep not in (1, c.tp),
         "The expert parallel size must be 1 or the same as the tensor parallel size (ep={ep}, tp={tp})",
         _src(_MH, "89-92", "handle_moe_kernel_config", "0.5.10",
              "The expert parallel size must be 1 or the same as the tensor parallel size")),
    # the hybrid-NVFP4 exception (nvfp4_moe_meta) is in the assert from 0.5.15 (0.5.14 server_args.py:5122
    # accepts modelopt_fp4 only; 0.5.15 server_args.py:4945 adds it)
    Rule("SG-CUTEDSL-Q", "sglang",
         lambda c: c.runner == "flashinfer_cutedsl" and not (c.fmt == "dsv4_nvfp4" and vt(c.version) >= (0, 5, 15))
         and _quant_not_in(("modelopt_fp4", "modelopt_mixed", "nvfp4_online"))(c),
         "Invalid quantization '{quant}'. FlashInfer CuteDSL MOE currently supports only: 'modelopt_fp4', "
         "'modelopt_mixed' (with NVFP4 MoE layers), 'nvfp4_online', or hybrid NVFP4 models. (The planner passes no "
         "--quantization and no model override resolves it for {arch} on {family}.)",
         _src(_MH, "94-101", "handle_moe_kernel_config", "0.5.14", "FlashInfer CuteDSL MOE currently supports only")),
    Rule("SG-CUTEDSL-EP", "sglang", lambda c: c.runner == "flashinfer_cutedsl" and c.ep not in (1, c.tp),
         "The expert parallel size must be 1 or the same as the tensor parallel size (ep={ep}, tp={tp})",
         _src(_MH, "94-105", "handle_moe_kernel_config", "0.5.14", "FlashInfer CuteDSL MOE currently supports only")),
    # 0.5.11-0.5.12.post1 accept none and deepep only (server_args.py:2986 in 0.5.11, :3120 in 0.5.12);
    # flashinfer from 0.5.13 (the digest of 0.5.13's assert equals 0.5.14's)
    Rule("SG-CUTEDSL-A2A", "sglang",
         lambda c: c.runner == "flashinfer_cutedsl" and c.a2a not in _cutedsl_a2a(c),
         "flashinfer_cutedsl supports moe_a2a_backend={allowed}, got '{a2a}'.",
         _src(_MH, "106-113", "handle_moe_kernel_config", "0.5.14", "flashinfer_cutedsl supports moe_a2a_backend="),
         flag="both", extra=lambda c: {"allowed": " or ".join(repr(a) for a in _cutedsl_a2a(c))}),
    Rule("SG-CUTEDSL-PERTOKEN", "sglang",
         lambda c: c.runner == "flashinfer_cutedsl" and c.a2a == "deepep" and c.truthy("SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION"),
         "flashinfer_cutedsl per-token NVFP4 activation requires moe_a2a_backend='none' or 'flashinfer'.",
         _src(_MH, "114-122", "handle_moe_kernel_config", "0.5.19", "flashinfer_cutedsl per-token NVFP4 activation requires"),
         flag="both"),
    Rule("SG-TRTLLM-Q", "sglang",
         lambda c: c.runner in ("flashinfer_trtllm", "experimental_sgl_trtllm") and _quant_not_in(
             ("modelopt_fp4", "nvfp4_online", "fp8", "mxfp8", "modelopt_fp8", "modelopt_mixed", "compressed-tensors", None))(c),
         "Invalid quantization '{quant}'. FlashInfer TRTLLM MOE supports only: 'modelopt_fp4', 'nvfp4_online', 'fp8', "
         "'modelopt_fp8', 'modelopt_mixed', 'compressed-tensors', or bfloat16 (None).",
         _src(_MH, "124-138", "handle_moe_kernel_config", "0.5.10", "FlashInfer TRTLLM MOE supports only")),
    Rule("SG-ROUTED-Q", "sglang",
         lambda c: c.runner == "flashinfer_trtllm_routed" and _quant_not_in(
             ("fp8", "mxfp8", "modelopt_fp4", "modelopt_mixed", "nvfp4_online", "minimax_m3_nvfp4", None))(c),
         "Invalid quantization '{quant}'. FlashInfer TRTLLM routed MOE supports only: 'fp8', 'mxfp8', 'modelopt_fp4', "
         "'modelopt_mixed', 'nvfp4_online', 'minimax_m3_nvfp4', or bfloat16 (None).",
         _src(_MH, "140-152", "handle_moe_kernel_config", "0.5.10", "FlashInfer TRTLLM routed MOE supports only")),

    # ---- server arguments: handle_a2a_moe ----------------------------------------------------
    Rule("SG-MEGAMOE-ARCH", "sglang", lambda c: c.a2a == "flashinfer_megamoe" and c.arch not in MEGAMOE_ARCHS,
         "FlashInfer MegaMOE is not validated for model architectures ['{arch}'].",
         _src(_MH, "237-262", "validate_flashinfer_megamoe_model", "0.5.21",
              "FlashInfer MegaMOE is not validated for model architectures"), flag="a2a"),
    Rule("SG-MEGAMOE-Q", "sglang",
         lambda c: c.a2a == "flashinfer_megamoe" and c.fmt not in ("dsv4_fp4", "dsv4_nvfp4")
         and _quant_not_in(("mxfp8", "modelopt_fp4"))(c),
         "FlashInfer MegaMOE currently supports only MXFP8, ModelOpt NVFP4, FP4-expert, hybrid NVFP4 MoE checkpoints, "
         "or nvfp4_online with SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16=1; got quantization={quant!r}. Standard FP8 MoE "
         "checkpoints are not supported.",
         _src(_MH, "264-281", "validate_flashinfer_megamoe_model", "0.5.21",
              "FlashInfer MegaMOE currently supports only MXFP8"), flag="a2a"),
    Rule("SG-MEGAMOE-DP", "sglang", lambda c: c.a2a == "flashinfer_megamoe" and c.dp != c.tp,
         "FlashInfer MegaMOE is only supported with --attn-dp-size equal to --tp-size (dp={dp}, tp={tp})",
         _src(_MH, "324-327", "handle_a2a_moe", "0.5.22", "FlashInfer MegaMOE is only supported with --attn-dp-size"),
         flag="a2a"),
    Rule("SG-MEGAMOE-RUNNER", "sglang",
         lambda c: c.a2a == "flashinfer_megamoe" and c.runner not in ("auto", "flashinfer_megamoe"),
         "FlashInfer MegaMOE a2a backend requires --moe-runner-backend flashinfer_megamoe",
         _src(_MH, "328-334", "handle_a2a_moe", "0.5.21", "FlashInfer MegaMOE a2a backend requires"), flag="both"),
    Rule("SG-MEGAMOE-SM100", "sglang", lambda c: c.a2a == "flashinfer_megamoe" and c.family != "sm100",
         "FlashInfer MegaMOE currently requires an SM100-family CUDA device for all supported quantization formats.",
         _src(_MH, "335-339", "handle_a2a_moe", "0.5.21", "FlashInfer MegaMOE currently requires an SM100-family"),
         flag="a2a"),
    Rule("SG-DEEPEPV2-ARCH", "sglang", lambda c: c.a2a == "deepep_v2" and c.arch not in DEEPEP_V2_ARCHS,
         "DeepEP v2 MoE is not validated for '{arch}'. The model package must register its architecture with "
         "register_deepep_v2_model (srt/configs/moe_model_registry.py:20-28).",
         _src(_MH, "719-731", "validate_deepep_v2_model_architecture", "0.5.21", "register_deepep_v2_model, because"),
         flag="a2a"),
    Rule("SG-DEEPEPV2-RUNNER", "sglang", lambda c: c.a2a == "deepep_v2" and c.runner not in ("auto", "deep_gemm"),
         "DeepEP v2 MoE currently supports only --moe-runner-backend deep_gemm. Got '{runner}'.",
         _src(_MH, "404-419", "handle_a2a_moe", "0.5.19", "DeepEP v2 MoE currently supports only"), flag="both"),
    Rule("SG-FIA2A-RUNNER", "sglang",
         lambda c: c.a2a == "flashinfer" and c.runner not in ("flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_trtllm",
                                                              "flashinfer_trtllm_routed", "deep_gemm"),
         "FlashInfer MoE A2A is supported with flashinfer_cutlass, flashinfer_cutedsl, flashinfer_trtllm, "
         "flashinfer_trtllm_routed, or deep_gemm (runner: {runner}).",
         _src(_MH, "534-545", "handle_a2a_moe", "0.5.19", "FlashInfer MoE A2A is supported with"), flag="both"),
    Rule("SG-PPLX-DP", "sglang", lambda c: c.a2a == "pplx" and c.dp < 2,
         "moe_a2a_backend='pplx' requires attention DP with at least 2 groups (--attn-dp-size >= 2); dp={dp}.",
         _src(_MH, "588-595", "handle_a2a_moe", "0.5.22", "requires attention DP with at least 2"), flag="a2a"),
    Rule("SG-PPLX-RUNNER", "sglang", lambda c: c.a2a == "pplx" and c.runner not in ("deep_gemm", "auto"),
         "moe_a2a_backend='pplx' is only supported with --moe-runner-backend deep_gemm (or auto).",
         _src(_MH, "596-602", "handle_a2a_moe", "0.5.17", "is only supported with --moe-runner-backend"), flag="both"),

    # --deepep-mode (auto = low_latency for decode batches, normal for prefill: srt/arg_groups/fields/exec_.py:898-901)
    Rule("SG-CUTEDSL-DEEPEP-NORMAL", "sglang",
         lambda c: c.a2a == "deepep" and c.runner == "flashinfer_cutedsl" and c.deepep_mode == "normal",
         "flashinfer_cutedsl FP4 MoE only supports DeepEP low_latency dispatch (masked layout). DeepEP normal (prefill) "
         "dispatch has no CuteDSL FP4 handler. Pass --deepep-mode low_latency or auto.",
         _src(_MH, "362-382", "handle_a2a_moe", "0.5.17", "flashinfer_cutedsl FP4 MoE only supports DeepEP"), flag="both"),
    # Before 0.5.17 nothing forces low_latency (the forcing is moe_hook.py:363-375 in 0.5.23, first in 0.5.17), and
    # the only ('deepep', 'flashinfer_cutedsl') fused function unpacks a DeepEPLLDispatchOutput
    # (srt/layers/moe/moe_runner/flashinfer_cutedsl.py:460-476, fused_experts_deepep_to_flashinfer_cutedsl_fp4, 0.5.14),
    # so the first prefill batch (normal dispatch under --deepep-mode auto) fails. The planner passes
    # --deepep-mode low_latency with this pair (S15/S15b); this row holds only for a Case without it.
    Rule("SG-CUTEDSL-DEEPEP-AUTO", "sglang",
         lambda c: c.a2a == "deepep" and c.runner == "flashinfer_cutedsl" and c.deepep_mode == "auto"
         and vt(c.version) < (0, 5, 17),
         "flashinfer_cutedsl under DeepEP has only a low-latency (masked) handler; --deepep-mode auto dispatches prefill "
         "batches in normal mode and the first prefill fails (sglang {version} does not force low_latency)",
         Source("sglang/srt/layers/moe/moe_runner/flashinfer_cutedsl.py", "460-476",
                "fused_experts_deepep_to_flashinfer_cutedsl_fp4", version="0.5.14", since="0.5.14",
                marker='@register_fused_func("deepep", "flashinfer_cutedsl")'),
         flag="both"),
    Rule("SG-PPLX-NORMAL", "sglang", lambda c: c.a2a == "pplx" and c.deepep_mode == "normal",
         "moe_a2a_backend='pplx' only supports low-latency mode; set --deepep-mode to 'low_latency' or 'auto'.",
         _src(_MH, "575-580", "handle_a2a_moe", "0.5.17", "only supports low-latency mode"), flag="a2a"),

    # ---- per-model override modules -----------------------------------------------------------
    # NemotronH normalises ModelOpt quantization itself (model_overrides/nemotron_h.py:35-55), so a
    # W4A16_NVFP4-expert checkpoint (planner format mixed_w4a16) is known to be modelopt_mixed here.
    Rule("SG-NEMOTRONH-W4A16-A2A", "sglang", lambda c: c.arch in _NEMOTRON_H and c.fmt == "mixed_w4a16" and c.a2a != "none",
         "W4A16_NVFP4 MoE layers require --moe-a2a-backend=none.",
         _src("sglang/srt/arg_groups/model_overrides/nemotron_h.py", "74-76", "_nemotron_h_overrides", "0.5.19",
              "W4A16_NVFP4 MoE layers require --moe-a2a-backend=none."), flag="a2a"),
    Rule("SG-NEMOTRONH-W4A16-RUNNER", "sglang",
         lambda c: c.arch in _NEMOTRON_H and c.fmt == "mixed_w4a16" and c.runner not in ("auto", "marlin"),
         "W4A16_NVFP4 MoE layers require --moe-runner-backend=marlin.",
         _src("sglang/srt/arg_groups/model_overrides/nemotron_h.py", "77-80", "_nemotron_h_overrides", "0.5.19",
              "W4A16_NVFP4 MoE layers require --moe-runner-backend=marlin.")),

    Rule("SG-LORA", "sglang", lambda c: c.runner.startswith("lora_"),
         "--moe-runner-backend {runner} requires --enable-lora (or --lora-paths) (the MoEDeployment has no LoRA adapters)",
         _src("sglang/srt/arg_groups/lora_hook.py", "196-203", "check_lora_moe_runner_args", "0.5.23",
              "requires --enable-lora (or --lora-paths)")),

    # ---- layer build: DeepEPMoE (a2a deepep, deepep_v2, mooncake, nixl, pplx; ep_moe/layer.py:352-365) ---
    Rule("SG-DEEPEP-LEGACY", "sglang",
         lambda c: c.a2a in _DEEPEP_MOE_A2A and not c.rocm and c.fmt != "w4afp8" and not _deepep_modern(c),
         "DeepEPMoE keeps its deprecated path for this layer ({fmt} experts, runner {runner}: none of the conditions "
         "that route it through the fused-MoE runner hold) and run_moe_core asserts 'forward_deepgemm_contiguous is "
         "deprecated' / 'forward_deepgemm_masked is deprecated' (unquantized: 'Unquantized DeepEP MoE currently "
         "supports low_latency mode only') at the first forward",
         _src("sglang/srt/layers/moe/ep_moe/layer.py", "98-149,278-301", "DeepEPMoE.__init__ / run_moe_core", "0.5.23",
              "is_humming = backend is not None and backend.is_humming()"), flag="both"),
    Rule("SG-DEEPEP-DEEPGEMM", "sglang",
         lambda c: c.a2a in _DEEPEP_MOE_A2A and not c.rocm and _no_jit_deepgemm(c) and c.fmt not in ("bf16", "w4afp8")
         and not _deepep_modern(c) and c.deepep_mode != "normal",
         "DeepEP auto mode requires deep_gemm (low-latency dispatch; DeepGEMM JIT is off below SM90 or with "
         "SGLANG_ENABLE_JIT_DEEPGEMM=0: layers/deep_gemm_wrapper/configurer.py:31-37)",
         _src("sglang/srt/layers/moe/ep_moe/layer.py", "166-177", "DeepEPMoE.__init__", "0.5.10", "mode requires deep_gemm"),
         flag="a2a"),
    Rule("SG-DEEPEP-BF16", "sglang",
         lambda c: c.a2a in ("deepep", "pplx") and not c.rocm and _no_jit_deepgemm(c) and c.fmt == "bf16"
         and _effective_runner(c) == "deep_gemm",
         "Unquantized DeepEP MoE requires DeepGEMM BF16",
         _src("sglang/srt/layers/moe/ep_moe/layer.py", "135-146", "DeepEPMoE.__init__", "0.5.17",
              "Unquantized DeepEP MoE requires DeepGEMM BF16"), flag="both"),

    # ---- layer build: MoeRunner --------------------------------------------------------------
    Rule("SG-FUSED", "sglang",
         lambda c: c.runner in FUSED_ONLY and c.a2a != "megamoe" and (c.a2a, c.runner) not in _fused_funcs(c.version)
         and not _runner_substituted(c),
         "Runner backend {runner} requires a fused func for a2a backend {a2a}, but none is registered.",
         _src(_RUN, "117-180", "MoeRunner.__init__ (fused-only runners, FusedOpPool.get_fused_func)", "0.5.17",
              "FlashInfer CUTLASS only supports fused path"), flag="both", same_as=("V2", "V5")),
    Rule("SG-PERMUTE", "sglang",
         lambda c: c.runner in _PERMUTE_FORMATS and c.a2a in ("deepep", "deepep_v2", "flashinfer")
         and c.a2a not in _PERMUTE_FORMATS[c.runner],
         "no pre-permute method registered for dispatch format {a2a} -> runner {runner} "
         "(PermuteMethodPool.get_pre_permute assertion at the first forward)",
         _src("sglang/srt/layers/moe/moe_runner/base.py", "255-275", "PermuteMethodPool.get_pre_permute", "0.5.10",
              "pre_permute_func is not None"), flag="both", same_as=("V5",)),
    # deepep_v2 resolves runner auto -> deep_gemm (moe_hook.py:404-412); the NVFP4 method has no deep_gemm path
    # (ModelOptNvFp4FusedMoEMethod.apply, modelopt_quant.py:3366-3369), so NVFP4 experts cannot run under deepep_v2.
    # (MXFP4 experts can: Mxfp4MoEMethod builds a deep_gemm MoeRunner, mxfp4.py:1466-1471.)
    Rule("SG-DEEPEPV2-LAYER", "sglang", lambda c: c.a2a == "deepep_v2" and c.fmt in NVFP4_METHOD | {"mixed"},
         "--moe-a2a-backend deepep_v2 requires the deep_gemm MoE runner (auto becomes deep_gemm), but NVFP4 MoE has no "
         "deep_gemm path; use an FP8 blockwise-quantized or BF16 checkpoint, or --moe-a2a-backend deepep.",
         _src(_RUN, "84-93", "MoeRunner.__init__", "0.5.19", "--moe-a2a-backend deepep_v2 requires the deep_gemm MoE runner"),
         flag="a2a"),
    Rule("SG-HPCOPS-SM90", "sglang", lambda c: c.runner == "hpc_ops" and c.family != "sm90",
         "--moe-runner-backend hpc_ops requires an SM90 (Hopper) GPU (the HPC-Ops kernels ship sm90a only), got {family}.",
         _src(_RUN, "150-158", "MoeRunner.__init__", "0.5.17", "requires an SM90 (Hopper)")),
    Rule("SG-HPCOPS-FP8", "sglang", lambda c: c.runner == "hpc_ops" and c.fmt not in ("fp8", "dsv4_fp8"),
         "--moe-runner-backend hpc_ops was requested, but this MoE layer's quantization method selected another runner "
         "(hpc_ops only supports FP8 blockwise / per-tensor quantized MoE; checkpoint: {fmt}).",
         _src(_RUN, "68-82", "MoeRunner.__init__", "0.5.17", "--moe-runner-backend hpc_ops was requested")),

    # ---- layer build: quantization methods -----------------------------------------------------
    Rule("SG-NVFP4-PLATFORM", "sglang",
         lambda c: c.fmt in NVFP4_METHOD | {"mixed"} and c.family not in BLACKWELL and c.runner not in ("marlin", "auto"),
         "Current platform does not support NVFP4 quantization with the selected MoE backend. Please use Blackwell "
         "and above, or use moe_runner_backend=marlin on SM80+.",
         _src(_MQ, "2369-2387", "ModelOptNvFp4FusedMoEMethod.__init__", "0.5.10", "Current platform does not support NVFP4"),
         same_as=("V7",)),
    Rule("SG-NVFP4-CUTLASS", "sglang", lambda c: c.fmt in NVFP4_METHOD and c.runner == "cutlass",
         "moe_runner_backend=cutlass is not supported for NVFP4 MoE. Use --moe-runner-backend flashinfer_cutlass instead.",
         _src(_MQ, "3144-3148", "ModelOptNvFp4FusedMoEMethod.create_moe_runner", "0.5.17",
              "moe_runner_backend=cutlass is not supported for NVFP4 MoE")),
    Rule("SG-NVFP4-RUNNER", "sglang",
         lambda c: c.fmt in NVFP4_METHOD and c.a2a != "megamoe" and c.runner not in (
             "auto", "flashinfer_megamoe", "marlin", "flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutedsl",
             "flashinfer_cutlass", "cutlass", "experimental_sgl_trtllm", "lora_cutedsl", "lora_triton", "lora_marlin"),
         "Unsupported moe_runner_backend for NVFP4 MoE: {runner}. Use --moe-runner-backend flashinfer_cutlass instead.",
         _src(_MQ, "3366-3369", "ModelOptNvFp4FusedMoEMethod.apply", "0.5.17", "Unsupported moe_runner_backend for NVFP4 MoE")),
    Rule("SG-MXFP4-ROCM", "sglang", lambda c: c.fmt in MXFP4_METHOD and c.family == "gfx942",
         "Current platform gfx942 not support mxfp4 computation",
         _src(_MX, "326-333", "Mxfp4Config.from_config", "0.5.10", "not support mxfp4 computation")),
    Rule("SG-MXFP4-RUNNER", "sglang",
         lambda c: c.fmt in MXFP4_METHOD and c.runner not in (
             "auto", "aiter", "triton_kernel", "triton", "marlin", "deep_gemm", "flashinfer_mxfp4",
             "lora_cutedsl", "lora_triton", "lora_marlin"),
         "Mxfp4MoEMethod has no MoeRunner for backend={runner}.",
         _src(_MX, "1433-1478", "Mxfp4MoEMethod.create_moe_runner", "0.5.21", "Mxfp4MoEMethod has no MoeRunner for backend")),
    Rule("SG-MXFP4-MARLIN", "sglang", lambda c: c.fmt in MXFP4_METHOD and c.runner == "marlin" and c.family not in SM90_SM100_SM12X,
         "MXFP4 Marlin requires SM90+.",
         _src(_MX, "650-655", "Mxfp4MoEMethod.process_weights_after_loading", "0.5.17", "MXFP4 Marlin requires SM90+")),
    Rule("SG-MXFP4-FI", "sglang",
         lambda c: c.fmt in MXFP4_METHOD | {"dsv4_fp4"} and c.runner == "flashinfer_mxfp4" and c.family not in SM90_SM100_SM12X,
         "moe_runner_backend=flashinfer_mxfp4 requires SM90, SM100, or SM120.",
         _src(_MX, "416-441", "Mxfp4MoEMethod.__init__", "0.5.10", "requires SM90, SM100"), same_as=("V2",)),
    Rule("SG-FP4EXPERT-MARLIN", "sglang",
         lambda c: c.fmt == "dsv4_fp4" and c.runner == "marlin" and c.family not in ("sm90", "sm120", "sm121"),
         "MXFP4 Marlin requires SM90 or SM120.",
         _src("sglang/srt/layers/quantization/mxfp4_marlin_moe.py", "160-161", "Mxfp4MarlinMoEMethod.process_weights_after_loading",
              "0.5.14", "MXFP4 Marlin requires SM90 or SM120")),
    Rule("SG-FP4EXPERT-FI-ALIGN", "sglang",
         lambda c: c.fmt == "dsv4_fp4" and c.runner == "flashinfer_mxfp4"
         and fi_mxfp4_cutlass_misaligned(c.family, c.version, c.hidden, c.moe_inter, moe_tp_size(c.tp, c.ep, c.a2a)) is not None,
         "Mxfp4FlashinferCutlassMoEMethod requires hidden_size and intermediate_size_per_partition to be multiples of "
         "128 (got {shape}).",
         _src("sglang/srt/layers/quantization/mxfp4_flashinfer_cutlass_moe.py", "67-74",
              "Mxfp4FlashinferCutlassMoEMethod.create_weights", "0.5.14", "requires hidden_size and"),
         extra=lambda c: {"shape": fi_mxfp4_cutlass_misaligned(c.family, c.version, c.hidden, c.moe_inter,
                                                                moe_tp_size(c.tp, c.ep, c.a2a))}),
    # Fp8MoEMethod keeps FP4-packed (int8) experts for an explicit triton runner and get_triton_quant_info passes
    # them as use_fp8_w8a8 (fp8.py:3018-3038, 0.5.23), so fused_experts_impl's shape assert fires at the first
    # forward (moe_runner/triton_utils/fused_moe.py:1118-1121). SGLANG_DSV4_FP4_DEQUANT=1 makes them FP8 first.
    Rule("SG-FP4EXPERT-TRITON", "sglang",
         lambda c: c.fmt == "dsv4_fp4" and c.runner == "triton" and not c.rocm and not c.truthy("SGLANG_DSV4_FP4_DEQUANT"),
         "Hidden size mismatch (the triton runner gets the packed FP4 expert weights as FP8 W8A8)",
         _src(_F8, "1501,3018-3038", "Fp8MoEMethod.__init__ / get_triton_quant_info", "0.5.14",
              "self.is_fp4_expert = self.quant_config.is_fp4_experts")),
    # Fp8MoEMethod builds a MoeRunner for an explicit aiter runner anywhere (create_moe_runner, fp8.py:2986-2991), but
    # apply() takes the aiter path only on ROCm with aiter on (maybe_get_hip_aiter_quant_info returns None unless
    # SGLANG_USE_AITER=1 or SGLANG_INT4_WEIGHT=1 on HIP: fp8.py:148-149,3409-3415) and then raises
    # "Unsupported runner backend" (fp8.py:3356-3359, 0.5.23) at the first forward. On ROCm the plan renders
    # SGLANG_USE_AITER=1 for it (engines/sglang/quant.py aiter_env) and the row reads that merged with the user's env
    # (selection._engine_case): it refuses a user's off value, or any GPU that is not ROCm.
    Rule("SG-FP8-AITER", "sglang",
         lambda c: c.fmt in FP8_METHOD and c.runner == "aiter"
         and not (c.rocm and (c.truthy("SGLANG_USE_AITER") or c.truthy("SGLANG_INT4_WEIGHT"))),
         "Unsupported runner backend: MoeRunnerBackend.AITER (the aiter MoE path of Fp8MoEMethod needs a ROCm GPU "
         "and SGLANG_USE_AITER=1; here {family}, SGLANG_USE_AITER {aiter_env})",
         _src(_F8, "148-149,3139-3149,3356-3359,3409-3415", "Fp8MoEMethod.apply / maybe_get_hip_aiter_quant_info",
              "0.5.14", "def maybe_get_hip_aiter_quant_info"),
         extra=lambda c: {"aiter_env": c.env.get("SGLANG_USE_AITER", "unset")}),
    # The FlashInfer runners and a2a backends import flashinfer when the layer is built or first runs:
    # flashinfer_cutlass.py:157-162 _flashinfer_cutlass_fused_moe ("... requires flashinfer to be installed"),
    # flashinfer_cutedsl.py:316-322, flashinfer_trtllm.py:1697-1712 and layers/moe/flashinfer_trtllm_moe.py:73-79
    # (ImportError "Please check flashinfer version"), 0.5.23. engine.flashinferVersion: none says the image has none.
    Rule("SG-FI-ABSENT", "sglang",
         lambda c: c.flashinfer == "none" and (c.runner.startswith("flashinfer") or c.a2a in ("flashinfer", "flashinfer_megamoe")),
         "{runner} / a2a {a2a} needs FlashInfer and the image has none (engine.flashinferVersion none): "
         "'MoE runner backend requires flashinfer to be installed' / ImportError from flashinfer.fused_moe",
         _src("sglang/srt/layers/moe/moe_runner/flashinfer_cutlass.py", "157-162", "_flashinfer_cutlass_fused_moe",
              "0.5.14", "requires flashinfer to be installed"), flag="both"),
    Rule("SG-FP8-CUTLASS", "sglang",
         lambda c: c.fmt in FP8_METHOD and c.runner == "cutlass" and c.family not in SM90_SM100_SM12X,
         "cutlass_fp8 MoE requires SM90, SM100, or SM120 GPUs",
         _src(_F8, "1508-1517", "Fp8MoEMethod.__init__", "0.5.10", "cutlass_fp8 MoE requires SM90, SM100, or SM120")),
    Rule("SG-FP8-RUNNER", "sglang",
         lambda c: not c.rocm and ((c.fmt in ("fp8", "dsv4_fp8") and c.runner in (
             "marlin", "triton_kernel", "flashinfer_mxfp4", "humming", "experimental_sgl_marlin", "intel_xpu"))
             or (c.fmt == "dsv4_fp4" and c.runner in ("triton_kernel", "experimental_sgl_marlin", "intel_xpu"))),
         "Fp8MoEMethod.create_moe_runner builds no MoeRunner for {runner} (only deep_gemm, triton, aiter, "
         "flashinfer_trtllm(_routed), hpc_ops, flashinfer_megamoe; flashinfer_cutlass/cutedsl run on triton) and "
         "apply() has no direct path for it but cutlass: the first forward fails on self.runner = None",
         _src(_F8, "2941-2998,3188-3227", "Fp8MoEMethod.create_moe_runner / apply", "0.5.23",
              "Direct kernels declare the layout they consume")),
    Rule("SG-FP4EXPERT-DEQUANT", "sglang",
         lambda c: c.fmt == "dsv4_fp4" and c.truthy("SGLANG_DSV4_FP4_DEQUANT") and c.runner != "auto",
         "{runner} is not compatible with SGLANG_DSV4_FP4_DEQUANT=1",
         _src(_F8, "425-428", "Fp8Config.get_quant_method", "0.5.17", "is not compatible with SGLANG_DSV4_FP4_DEQUANT=1"),
         same_as=("V4",)),
)


def server_quantization(case: Case) -> tuple[bool, str | None]:
    """sglang: the `--quantization` value its server-argument asserts see (known, value).

    The planner passes --quantization only for GPTQ / AWQ checkpoints (gptq_marlin, awq_marlin or moe_wna16, from
    their quantization parameters: engines/sglang/quant.py, whose rows judge those runners; the Case does not carry
    the parameters, so the value is reported unknown here). Otherwise it is None unless a model override resolves it
    from config.json; those overrides run on SM100 only (tuning-rules.md 1.6):
    `_deepseek_moe_quant_resolution` (srt/arg_groups/overrides.py:764-810, 0.5.23) and the
    per-model modules. Where the raw `quant_method` the override copies is not known with certainty
    (ModelOpt checkpoints write `modelopt` or nothing), the value is reported unknown and the
    quantization asserts are not evaluated."""
    if case.fmt in ("gptq", "awq"):
        return False, None
    if case.family != "sm100" or case.arch not in QUANT_RESOLVING_ARCHS:
        return True, None
    qm = case.quant_method
    if case.fmt == "bf16":
        return True, None
    if case.fmt in ("fp8",) and qm in (None, "fp8"):
        # DeepSeek-V3/R1 declare fp8 or have FP8 expert weights (overrides.py:788-800 probes them)
        return True, "fp8"
    if case.fmt.startswith("ct_") and qm == "compressed-tensors":
        return True, "compressed-tensors"
    if case.fmt in ("mxfp4", "w4afp8") and qm == case.fmt:
        return True, qm
    return False, None


def quant(case: Case) -> str | None:
    """The --quantization value the rows' messages name: what the server-argument asserts see."""
    return server_quantization(case)[1]
