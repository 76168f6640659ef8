"""Torch reference experts: correct on any device, slow. Defines the semantics every backend matches.

For each expert with routed tokens: dequantize its weights to bf16, h = x @ w13^T (bf16 matmul),
a = bf16(silu(gate) * up) in fp32, y = a @ w2^T; rows of gemm2_out are in expert-sorted order
(stable), and the finalize weights and sums them in fp32.

`dtype` (default bf16, the backends' contract) is the precision of the activations and dequantized
weights: the runtime's exact mode (`--dtype float32`, CPU checks against transformers) runs the same
code in fp32, finalized by `finalize_exact`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn

from .experts import ExpertWeights
from .finalize import DeferredMoEOutput, finalize_exact, moe_finalize_fuse_shared


def _check_inputs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, hidden: int):
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} do not match x")


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, perm): order[j] = flat (t*K+k) index of the j-th row in expert-sorted order (stable);
    perm[t*K+k] = row of that pair, or -1 when the id is outside [0, E) (expert not on this rank)."""
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)[: int(valid.sum())]
    perm = torch.full_like(flat, -1, dtype=torch.int32)
    perm[order] = torch.arange(order.numel(), dtype=torch.int32, device=flat.device)
    return order, perm


class TorchExperts:
    def __init__(self, weights: ExpertWeights, dtype: torch.dtype = torch.bfloat16):
        self.weights = weights
        self.dtype = dtype

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                shared_output: torch.Tensor | None = None, routed_scale: float = 1.0,
                defer_finalize: bool = False):
        w = self.weights
        _check_inputs(x, topk_weights, topk_ids, w.hidden_size)
        k = topk_ids.shape[1]
        order, perm = sort_by_expert(topk_ids, w.num_experts)
        sorted_experts = topk_ids.reshape(-1).long()[order]
        gemm2_out = torch.empty(order.numel(), w.hidden_size, dtype=self.dtype, device=x.device)
        xb = x.to(self.dtype)
        inter = w.intermediate_size
        counts = torch.bincount(sorted_experts, minlength=w.num_experts).tolist()
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            rows = order[start:start + c]
            w13, w2 = w.dequantize_expert(e, self.dtype)
            h = xb[rows // k] @ w13.t()
            a = (Fn.silu(h[:, :inter].float()) * h[:, inter:].float()).to(self.dtype)
            gemm2_out[start:start + c] = a @ w2.t()
            start += c
        deferred = DeferredMoEOutput(gemm2_out, topk_weights, perm, float(routed_scale))
        if defer_finalize:
            return deferred
        if self.dtype != torch.bfloat16:
            return finalize_exact(gemm2_out, topk_weights, perm, shared_output, float(routed_scale))
        return moe_finalize_fuse_shared(gemm2_out, topk_weights, perm, shared_output, float(routed_scale))

    __call__ = forward
