"""vLLM's accepted values: the one list the CRD enum, the selection rows and the start-up rows use."""

from __future__ import annotations

NAME = "vllm"
DEFAULT_VERSION = "0.33.0"

# --moe-backend values: vLLM 0.33.0's MoEBackend choices (engine_rules/data/vllm.json) and the two values the
# legacy MXFP4 env vars translate to (W7: VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8[_CUTLASS]); this order is the CRD's.
MOE_BACKENDS = (
    "auto", "triton", "batched_triton", "deep_gemm", "deep_gemm_mega_moe", "cutlass", "flashinfer_trtllm",
    "flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_moe_ep_cutedsl", "flashinfer_b12x", "b12x",
    "flashinfer_moe_ep_mega_deep_gemm", "marlin", "humming", "triton_unfused", "aiter", "aiter_mega_moe",
    "aiter_triton_mxfp4_bf16", "aiter_triton_mxfp4_mxfp4", "flydsl", "hpc", "emulation", "rdna3",
    "flashinfer_trtllm_afp8", "flashinfer_cutlass_afp8",
)
# --all2all-backend values the CRD adds to sglang's (the shared ones, none/pplx/..., are in sglang's list);
# each release's own list is in engine_rules/data/vllm.json and its start-up row VL-A2A-CHOICE.
A2A_EXTRA = ("naive", "deepep_high_throughput", "deepep_low_latency", "allgather_reducescatter", "flashinfer_all2allv")
