"""vLLM's selection rows (W*, K31), validate rows (WV*, K14, K32), the legacy env <-> --moe-backend translation
(W7), the MoE and attention split rules (WK40, WK41) and the command-line flags of a plan (tuning-rules.md 6.3,
3.x). Pure."""

from __future__ import annotations

import math

from moe_core.checkpoint import CheckpointInfo
from moe_core.plan import PlanMoE

from ...selection import Builder, Check, Facts, Select, choose_runner, fits_tps, heads_problem, run_checks, truthy
from ..archs import DSV4, GPT_OSS
from . import quant
from .vocab import MOE_BACKENDS

RUNNER_FLAG = "--moe-backend"


def _vllm_flag_era(f: Facts) -> bool:
    return f.ver >= (0, 16)  # --moe-backend (PR #33807); env vars removed in 0.23


SELECT: tuple[Select, ...] = (
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

CHECKS: tuple[Check, ...] = (
    Check("WV0", lambda f, r: r not in MOE_BACKENDS, "reject",
          "unknown vLLM --moe-backend {value}; valid values: " + ", ".join(MOE_BACKENDS)),
    Check("K14", lambda f, r: r in ("flashinfer_trtllm", "flashinfer_trtllm_afp8") and f.fam != "sm100", "reject",
          "{value}: trtllm-gen kernels are SM100-family only, not {gpu}; use flashinfer_cutlass (NVFP4 on SM120), marlin, or auto"),
    Check("WV1", lambda f, r: r in ("flashinfer_cutlass",) and f.fam in ("sm110",), "reject",
          "FlashInfer CUTLASS MoE excludes SM110 (flashinfer#3134); use cutlass"),
    Check("WV2", lambda f, r: r != "auto" and not _vllm_flag_era(f) and r not in _VLLM_FLAG_TO_ENV, "reject",
          "vLLM {version} predates --moe-backend; {value} cannot be expressed with its environment variables"),
    Check("K32", lambda f, r: f.fam == "sm121" and f.fmt == "nvfp4", "warn",
          "vLLM NVFP4 MoE on GB10 (SM121) with FlashInfer is known to crash at CUDA-graph capture (flashinfer#2776)"),
    # GPTQ / AWQ / compressed-tensors WNA16 oracle and env-gated backends (engines/vllm/quant.py, vLLM 0.33.0)
    *quant.CHECKS,
    *quant.ENV_CHECKS,
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


def attention_split_refusal(f: Facts) -> str | None:
    """WK41: the attention heads do not split over the layout's attention tensor-parallel ranks.
    ModelConfig.verify_with_parallel_config raises 'Total number of attention heads (H) must be divisible by tensor
    parallel size (T).' (vllm/config/model.py:1557-1564 in 0.33.0, :1195-1202 in 0.22.1) and QKVParallelLinear.__init__
    divides the KV heads (model_executor/layers/linear.py:1064-1071 in 0.33.0, :1027-1032 in 0.22.1); its data
    parallel ranks are whole replicas, so the attention group is tp."""
    ck, tp = f.ckpt, f.choices.tp
    if f.ver < (0, 22, 1):
        return None
    msg = heads_problem(ck, tp, True)
    if msg is None:
        return None
    tps, left = fits_tps(f, [t for t in (1, 2, 4, 8, 16, 32, 64) if t != tp and heads_problem(ck, t, True) is None])
    cite = ("vllm/config/model.py:1557-1564 ModelConfig.verify_with_parallel_config and model_executor/layers/"
            "linear.py:1064-1071 QKVParallelLinear.__init__, vLLM 0.33.0; config/model.py:1195-1202, linear.py:1027-1032"
            " in 0.22.1")
    if f.ver >= (0, 33, 0) and f.arch in _VLLM_ATTN_SPLIT:
        cite += f"; the model asserts it too: vllm/{_VLLM_ATTN_SPLIT[f.arch]}, vLLM 0.33.0"
    return (f"[WK41] vLLM {f.version} refuses this layout at start-up: {msg} ('Total number of attention heads "
            f"({ck.numAttentionHeads}) must be divisible by tensor parallel size ({tp}).' / '... is not divisible by "
            f"...') ({cite}). Works instead: {'tp ' + ', '.join(map(str, tps)) if tps else 'no tp of this checkpoint'}{left}.")


def moe_split_refusal(f: Facts, runner: str = "auto") -> str | None:
    """WK40's text (vllm_moe_shape_errors, with the --moe-backend value vLLM gets), None when vLLM accepts it."""
    return next(iter(vllm_moe_shape_errors(f, "flashinfer_trtllm" if runner == "env" else runner)), None)


def pick_runner(b: Builder) -> str:
    """The --moe-backend value vLLM gets: the user's, W7's translation of legacy env, or the select table's
    ("env": W5env's env-era FlashInfer TRT-LLM)."""
    f = b.f
    legacy = _vllm_translate_legacy_env(f)
    if legacy and f.choices.runner_backend == "auto" and f.ver >= (0, 23):
        b.decide("moe.runnerBackend", legacy, "W7", f"VLLM_* MoE env vars were removed in vLLM 0.23 and are silently ignored; "
                                                     f"translated the user's env to --moe-backend {legacy}")
        b.warnings.append(f"[W7] legacy VLLM_* MoE env vars have no effect on vLLM {f.version}; use moe.runnerBackend instead")
        return legacy
    return choose_runner(b, SELECT, RUNNER_FLAG)[0]


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


def plan_moe(b: Builder) -> PlanMoE:
    f = b.f
    runner = pick_runner(b)
    if runner == "auto" and (why := _vllm_auto_without_flashinfer(f)):
        b.warnings.append(f"[FI0] the image has no FlashInfer (engine.flashinferVersion none): {why}")
    if runner == "env":  # W5 env era: express the choice with env vars
        for k, v in _VLLM_FLAG_TO_ENV["flashinfer_trtllm"].items():
            b.set_env(k, v, "W5", "vLLM env-era FlashInfer TRT-LLM NVFP4 MoE on SM100")
        runner = "flashinfer_trtllm"
    elif runner != "auto":
        run_checks(b, CHECKS, runner, RUNNER_FLAG)
        if _vllm_flag_era(f):
            b.args[:0] = ["--moe-backend", runner]
        elif runner in _VLLM_FLAG_TO_ENV:
            for k, v in _VLLM_FLAG_TO_ENV[runner].items():
                b.set_env(k, v, "W7r", f"vLLM {f.version} predates --moe-backend: {runner} expressed as {k}={v}")
    else:
        run_checks(b, CHECKS, runner, RUNNER_FLAG)
    _quant_plan(b, runner)
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


def _quant_plan(b: Builder, runner: str) -> None:
    """The WNA16 rows' per-case reasons (appended to their refusals, before 'Works instead'), the VQ0 note for
    releases they were not read for, the env an env-gated backend needs, and what auto runs (engines/vllm/quant.py)."""
    f = b.f
    b.explain(quant.detail(f, runner))
    warnings, env, decisions = quant.plan_notes(f, runner)
    b.warnings.extend(warnings)
    if not b.errors:
        for key, value, rule, reason in env:
            b.set_env(key, value, rule, reason)
    for key, value, reason in decisions:
        b.decide(key, value, "VQ0" if key == "quant.judged" else "VQ-AUTO", reason)



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
    tps, left = fits_tps(f, [t for t in (1, 2, 4, 8, 16, 32, 64)
                              if t != tp and _vllm_split_problem(f.ckpt, t, dp, ep, runner, v) is None])
    if tps:
        alts.append(f"tp {', '.join(map(str, tps))}")
    cite = _WK40_CITE["0.33.0" if v >= (0, 33, 0) else "0.22.1"]
    if (0, 22, 1) < v[:3] < (0, 33, 0):
        cite += f"; vLLM {f.version} was not read: refused because 0.22.1 and 0.33.0 both refuse it"
    return [f"[WK40] vLLM {f.version} refuses this layout at start-up: {msg} ({cite}). Works instead: "
            f"{'; '.join(alts) or 'no tp/ep split of this checkpoint'}{left}."]



def default_flashinfer(version: str, gpu) -> str | None:
    """vLLM's images: not known (the plan judges FlashInfer only where the user says, engine.flashinferVersion)."""
    return None


# What the user's env already chooses (moe-operator plan warns where --set contradicts it; the env wins in the pod).
DEFERRED_ENV = None  # vLLM has no deferred-finalize switch (DF4)


def env_runner(env: dict[str, str], family: str) -> list[tuple[str, str]]:
    """(env description, runner it selects): the legacy VLLM_* MoE env as W7 translates it."""
    from types import SimpleNamespace

    legacy = _vllm_translate_legacy_env(SimpleNamespace(choices=SimpleNamespace(env=env), fam=family))
    return [(" ".join(f"{k}={env[k]}" for k in _VLLM_LEGACY_ENV if k in env), legacy)] if legacy else []
