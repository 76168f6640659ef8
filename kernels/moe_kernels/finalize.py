"""MoE finalize: out[t] = bf16(sum_k (w[t,k] * routed_scale) * gemm2_out[perm[t*K+k]] + shared[t]).

Semantics of sglang's `moe_finalize_fuse_shared` (formats-and-kernels.md section 1.2): fp32
accumulation, one rounding to bf16, perm == -1 means the expert is not on this rank (skipped),
`routed_scale` multiplies the expert weight in fp32. The Triton kernel runs on CUDA tensors; the
torch reference runs anywhere and is the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DeferredMoEOutput:
    """What an experts backend hands over when asked to stop before finalize.

    gemm2_out: bf16 [P, H], rows in expert-sorted (padded) order, not yet weighted.
    expert_weights: fp32 or bf16 [T, K]; they do NOT yet include `routed_scale`.
    expanded_idx_to_permuted_idx: int32 [T*K], row of gemm2_out for (t, k) or -1.
    routed_scale: applied by the finalize (the forward's `routed_scale` argument).
    """

    gemm2_out: torch.Tensor
    expert_weights: torch.Tensor
    expanded_idx_to_permuted_idx: torch.Tensor
    routed_scale: float = 1.0

    def finalize(self, shared_output: torch.Tensor | None = None) -> torch.Tensor:
        if self.gemm2_out.dtype != torch.bfloat16:  # exact mode (TorchExperts(dtype=torch.float32))
            return finalize_exact(self.gemm2_out, self.expert_weights, self.expanded_idx_to_permuted_idx,
                                  shared_output, self.routed_scale)
        return moe_finalize_fuse_shared(self.gemm2_out, self.expert_weights, self.expanded_idx_to_permuted_idx,
                                        shared_output, self.routed_scale)


def _check(gemm2_out, expert_weights, perm, shared_output):
    if gemm2_out.dtype != torch.bfloat16 or gemm2_out.dim() != 2:
        raise TypeError(f"gemm2_out must be 2-D bf16, got {gemm2_out.dtype} {tuple(gemm2_out.shape)}")
    if expert_weights.dtype not in (torch.float32, torch.bfloat16) or expert_weights.dim() != 2:
        raise TypeError(f"expert_weights must be 2-D fp32 or bf16, got {expert_weights.dtype}")
    if perm.dtype != torch.int32 or perm.numel() != expert_weights.numel():
        raise TypeError(f"expanded_idx_to_permuted_idx must be int32 [T*K], got {perm.dtype} {tuple(perm.shape)}")
    if shared_output is not None and (shared_output.dtype != torch.bfloat16
                                      or shared_output.shape[0] != expert_weights.shape[0]):
        raise TypeError("shared_output must be bf16 [T, H]")


def finalize_reference(gemm2_out: torch.Tensor, expert_weights: torch.Tensor,
                       expanded_idx_to_permuted_idx: torch.Tensor, shared_output: torch.Tensor | None = None,
                       routed_scale: float | None = None) -> torch.Tensor:
    _check(gemm2_out, expert_weights, expanded_idx_to_permuted_idx, shared_output)
    return finalize_exact(gemm2_out, expert_weights, expanded_idx_to_permuted_idx, shared_output, routed_scale)


def finalize_exact(gemm2_out: torch.Tensor, expert_weights: torch.Tensor, expanded_idx_to_permuted_idx: torch.Tensor,
                   shared_output: torch.Tensor | None = None, routed_scale: float | None = None) -> torch.Tensor:
    """The reference arithmetic (fp32 accumulation in slot order, one rounding) in gemm2_out's own dtype,
    without the bf16 contract: the finalize of the exact (fp32) mode of the torch reference experts."""
    t, k = expert_weights.shape
    h = shared_output.shape[1] if shared_output is not None else gemm2_out.shape[1]
    perm = expanded_idx_to_permuted_idx.view(t, k).long()
    w = expert_weights.float() * (1.0 if routed_scale is None else float(routed_scale))
    acc = torch.zeros(t, h, dtype=torch.float32, device=gemm2_out.device)
    for j in range(k if gemm2_out.shape[0] else 0):  # slot order, like the kernel (no rows: no pair on this rank)
        valid = perm[:, j] >= 0
        rows = gemm2_out[perm[:, j].clamp(min=0), :h].float()
        acc += torch.where(valid[:, None], rows * w[:, j:j + 1], torch.zeros((), device=acc.device))
    if shared_output is not None:
        acc += shared_output.float()
    return acc.to(gemm2_out.dtype)


def moe_finalize_fuse_shared(gemm2_out: torch.Tensor, expert_weights: torch.Tensor,
                             expanded_idx_to_permuted_idx: torch.Tensor, shared_output: torch.Tensor | None = None,
                             routed_scale: float | None = None, *, pdl: bool = False) -> torch.Tensor:
    """Triton kernel on CUDA when Triton is importable; the torch reference otherwise.
    pdl: launch with programmatic dependent launch (pdl.py; the caller checks support)."""
    if gemm2_out.is_cuda:
        try:
            from .triton_finalize import finalize_triton
        except ImportError:
            finalize_triton = None
        if finalize_triton is not None:
            _check(gemm2_out, expert_weights, expanded_idx_to_permuted_idx, shared_output)
            return finalize_triton(gemm2_out, expert_weights, expanded_idx_to_permuted_idx, shared_output,
                                   1.0 if routed_scale is None else float(routed_scale), pdl=pdl)
    return finalize_reference(gemm2_out, expert_weights, expanded_idx_to_permuted_idx, shared_output, routed_scale)
