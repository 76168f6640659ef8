"""The runtime's single door into `moe_kernels` (formats, routing, experts backends, finalize,
self-test), plus the one thing the kernels do not provide by contract: fp32 activations.

The kernels' backends compute in bf16 (their contract). `--dtype float32` (exact mode: CPU
correctness checks against transformers, quantised-vs-dequantised comparisons) runs the experts on
`Fp32ReferenceExperts` and finalizes with `finalize_any_dtype`; everything else goes to moe_kernels.
"""

from __future__ import annotations

import torch
from moe_kernels.backends import installed_packages, load_backend  # noqa: F401
from moe_kernels.experts import ExpertWeights
from moe_kernels.finalize import DeferredMoEOutput, moe_finalize_fuse_shared
from moe_kernels.formats import (Fp8BlockTensor, MxFp4Tensor, NvFp4Tensor, dequantize_fp8_block,  # noqa: F401
                                 dequantize_mxfp4, dequantize_nvfp4, quantize_fp8_block, quantize_mxfp4,
                                 quantize_nvfp4)
from moe_kernels.routing import grouped_topk, softmax_topk  # noqa: F401
from moe_kernels.selftest import selftest  # noqa: F401


def dequantize(fmt: str, t, dtype=torch.float32) -> torch.Tensor:
    """Format tensor (a plain tensor for bf16) -> dense tensor of `dtype`."""
    if fmt == "bf16":
        return t.to(dtype)
    if fmt == "nvfp4":
        return dequantize_nvfp4(t, dtype=dtype)
    if fmt == "mxfp4":
        return dequantize_mxfp4(t, dtype=dtype)
    if fmt == "fp8":
        return dequantize_fp8_block(t, dtype=dtype)
    raise ValueError(f"unknown expert weight format {fmt!r}")


def make_expert_weights(fmt: str, tensors: dict[str, torch.Tensor]) -> ExpertWeights:
    """Stacked checkpoint tensors (w13_weight, w13_weight_scale, ... sglang names) -> ExpertWeights."""
    return ExpertWeights.from_quantized(fmt, **tensors)


def finalize_any_dtype(gemm2_out, expert_weights, perm, shared_output=None, routed_scale=1.0):
    """moe_finalize_fuse_shared for bf16 (its contract); the same arithmetic in torch otherwise."""
    if gemm2_out.dtype == torch.bfloat16 and (shared_output is None or shared_output.dtype == torch.bfloat16):
        return moe_finalize_fuse_shared(gemm2_out, expert_weights, perm, shared_output, routed_scale)
    t, k = expert_weights.shape
    p = perm.view(t, k).long()
    rows = gemm2_out[p.clamp(min=0)].float() * (p >= 0)[..., None]
    acc = (rows * expert_weights.float()[..., None]).sum(1) * routed_scale
    if shared_output is not None:
        acc = acc + shared_output.float()
    return acc.to(gemm2_out.dtype)


class Fp32ReferenceExperts:
    """Exact-mode experts: weights dequantised once to fp32, math in the activation dtype per expert."""

    def __init__(self, weights: ExpertWeights):
        self.w13 = dequantize(weights.format, weights.w13, torch.float32)
        self.w2 = dequantize(weights.format, weights.w2, torch.float32)
        self.num_experts, self.inter = self.w13.shape[0], self.w2.shape[-1]

    def forward(self, x, topk_weights, topk_ids, *, shared_output=None, routed_scale=1.0, defer_finalize=False):
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tok = order // k
        out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            rows = slice(start, start + c)
            h = torch.nn.functional.linear(x[tok[rows]], self.w13[e].to(x.dtype))
            h = torch.nn.functional.silu(h[:, : self.inter]) * h[:, self.inter:]
            out[rows] = torch.nn.functional.linear(h, self.w2[e].to(x.dtype))
            start += c
        perm = torch.empty_like(flat)
        perm[order] = torch.arange(t * k, device=x.device)
        perm = perm.to(torch.int32)
        if defer_finalize:
            return DeferredMoEOutput(out, topk_weights, perm, routed_scale)
        return finalize_any_dtype(out, topk_weights, perm, shared_output, routed_scale)
