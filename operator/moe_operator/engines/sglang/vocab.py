"""sglang's accepted values: the one list the CRD enum, the selection rows and the start-up rows use."""

from __future__ import annotations

from ...engine_rules import recorded

NAME = "sglang"
DEFAULT_VERSION = "0.5.23"

# --moe-runner-backend values (this order is the CRD enum's) and the first release read that
# accepts each (its --moe-runner-backend choices, engine_rules/data/sglang.json).
_RUNNER_ORDER = (
    "auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "flashinfer_trtllm_routed",
    "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_cutedsl", "cutlass", "experimental_sgl_trtllm", "aiter",
    "marlin", "humming", "experimental_sgl_marlin", "hpc_ops", "megamoe", "intel_xpu", "flashinfer_megamoe",
    "lora_cutedsl", "lora_triton", "lora_marlin",
)


def _first_accepting(runner: str) -> str:
    return next(v for v, r in recorded.releases(NAME).items() if runner in r["runner_choices"]["values"])


RUNNERS = {r: _first_accepting(r) for r in _RUNNER_ORDER}
A2A = ("none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "megamoe",
       "deepep_v2", "pplx", "ascend_tp", "flashinfer_megamoe")

# sglang release -> pinned flashinfer-python (the wheel's Requires-Dist, engine_rules/data/sglang.json).
FLASHINFER_PIN = {v: r["flashinfer_pin"] for v, r in recorded.releases(NAME).items() if r.get("flashinfer_pin")}

# The DeepSeek and Qwen3 families as sglang's model overrides list them (0.5.23): overrides.py:744-760
# `_DEEPSEEK_FAMILY_ARCHS`, model_overrides/qwen3_moe.py:29-37 `_qwen3_moe_family_overrides`. The selection
# rows (S4, S9, deferred finalize) and the start-up rows (QUANT_RESOLVING_ARCHS) use these same sets.
DEEPSEEK_FAMILY = frozenset({
    "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration", "MistralLarge3ForCausalLM",
    "PixtralForConditionalGeneration", "GlmMoeDsaForCausalLM", "Glm5NextForConditionalGeneration", "HYV4ForCausalLM",
    "HYV4ForCausalLMNextN", "LongcatFlashForCausalLM", "LongcatFlashForCausalLMNextN", "Dots3NoteForCausalLM",
})
QWEN3_FAMILY = frozenset({
    "Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration", "Qwen3NextForCausalLM",
    "Qwen3_5MoeForConditionalGeneration", "InternS2PreviewForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
    "Qwen4ExpForConditionalGeneration",
})
