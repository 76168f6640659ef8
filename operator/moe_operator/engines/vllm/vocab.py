"""vLLM's accepted values: the one list the CRD enum, the selection rows and the start-up rows use."""

from __future__ import annotations

from ...engine_rules import recorded

NAME = "vllm"
DEFAULT_VERSION = "0.33.0"

# --moe-backend values: every release read's MoEBackend choices (engine_rules/data/vllm.json; a test checks that
# none is missing) and the two values the legacy MXFP4 env vars translate to (W7:
# VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8[_CUTLASS]); this order is the CRD's. Which release accepts which is the
# start-up row VL-CHOICE's (per release).
MOE_BACKENDS = (
    "auto", "triton", "batched_triton", "deep_gemm", "deep_gemm_mega_moe", "cutlass", "flashinfer_trtllm",
    "flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_moe_ep_cutedsl", "flashinfer_b12x", "b12x",
    "flashinfer_moe_ep_mega_deep_gemm", "marlin", "humming", "triton_unfused", "aiter", "aiter_mega_moe",
    "aiter_triton_mxfp4_bf16", "aiter_triton_mxfp4_mxfp4", "flydsl", "hpc", "emulation", "rdna3",
    "flashinfer_trtllm_afp8", "flashinfer_cutlass_afp8", "flashinfer_moe_ep_mega_cutedsl",
)
# --all2all-backend values: every release read's All2AllBackend choices (minus the "passthrough" the CLI removes;
# "none" is the planner's word for no flag), from the data, oldest release first; which release accepts which is
# the start-up row VL-A2A's.
A2A = tuple(dict.fromkeys(x for r in recorded.releases(NAME).values() for x in r["a2a_choices"]["values"]))
