"""Torch reference experts: correct on any device, slow. Defines the semantics every backend matches.

For each expert with routed tokens: dequantize its weights to bf16, h = x @ w13^T (bf16 matmul)
[+ w13_bias], a = bf16(act(gate, up)) in fp32, y = a @ w2^T [+ w2_bias]; rows of gemm2_out are in
expert-sorted order (stable), and the finalize weights and sums them in fp32.

Activations (`ACTIVATIONS`): "silu" = silu(gate) * up (every SwiGLU model); "swiglu_oai" = gpt-oss's
clamped SwiGLU, gate = min(gate, limit), up = clamp(up, -limit, limit),
(up + 1) * gate * sigmoid(alpha * gate) (transformers GptOssExperts, alpha 1.702, limit 7.0).
Expert biases, when the weights carry them, are ExpertWeights.extras["w13_bias"] [E, 2I] and
["w2_bias"] [E, H], added after each GEMM (before the activation / before the routing weight).

`dtype` (default bf16, the backends' contract) is the precision of the activations and dequantized
weights: the runtime's exact mode (`--dtype float32`, CPU checks against transformers) runs the same
code in fp32, finalized by `finalize_exact`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn

from .experts import ExpertWeights
from .finalize import DeferredMoEOutput, finalize_exact, moe_finalize_fuse_shared


ACTIVATIONS = frozenset({"silu", "swiglu_oai"})
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


def check_activation(activation: str, supported: frozenset[str], backend: str):
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; known: {sorted(ACTIVATIONS)}")
    if activation not in supported:
        raise ValueError(f"{backend} does not run activation {activation!r} (it runs {sorted(supported)})")


def expert_biases(weights: ExpertWeights) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(w13_bias [E, 2I], w2_bias [E, H]) from the weights' extras, each None when absent; shapes checked."""
    e, h, i = weights.num_experts, weights.hidden_size, weights.intermediate_size
    out = []
    for name, shape in (("w13_bias", (e, 2 * i)), ("w2_bias", (e, h))):
        b = weights.extras.get(name)
        if b is not None and tuple(b.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(b.shape)}")
        out.append(b)
    return out[0], out[1]


def activate(h: torch.Tensor, activation: str, alpha: float = OAI_ALPHA, limit: float = OAI_LIMIT) -> torch.Tensor:
    """[rows, 2I] (gate | up) -> [rows, I] in fp32: the activation every backend matches."""
    inter = h.shape[1] // 2
    gate, up = h[:, :inter].float(), h[:, inter:].float()
    if activation == "silu":
        return Fn.silu(gate) * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(alpha * gate))
    raise ValueError(f"unknown expert activation {activation!r}; known: {sorted(ACTIVATIONS)}")


ACT_QUANTS = frozenset({"fp8"})


def act_fp8_roundtrip(a: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Per-token-group FP8 activation quantization (W8A8, triton_w8a8.py), quantized and dequantized in
    fp32: per row and `group` columns, s = max|a| / 448 (at least 1e-10), q = e4m3(a / s), q * s."""
    rows, cols = a.shape
    if cols % group:
        raise ValueError(f"FP8 activation groups need a multiple of {group} columns, got {cols}")
    g = a.float().reshape(rows, cols // group, group)
    s = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * s).reshape(rows, cols)


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
    activations = ACTIVATIONS
    formats = frozenset({"bf16", "fp8", "nvfp4", "mxfp4"})
    supports_bias = True

    def __init__(self, weights: ExpertWeights, dtype: torch.dtype = torch.bfloat16, *, activation: str = "silu",
                 alpha: float = OAI_ALPHA, limit: float = OAI_LIMIT, act_quant: str | None = None):
        check_activation(activation, self.activations, "TorchExperts")
        if act_quant is not None and act_quant not in ACT_QUANTS:
            raise ValueError(f"unknown activation quantization {act_quant!r}; known: {sorted(ACT_QUANTS)}")
        # act_quant="fp8": both GEMMs' inputs through act_fp8_roundtrip, products in fp32 (W8A8 semantics)
        self.act_quant = act_quant
        self.weights = weights
        self.dtype = dtype
        self.activation, self.alpha, self.limit = activation, float(alpha), float(limit)
        self.b13, self.b2 = expert_biases(weights)

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
        counts = torch.bincount(sorted_experts, minlength=w.num_experts).tolist()
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            rows = order[start:start + c]
            w13, w2 = w.dequantize_expert(e, torch.float32 if self.act_quant else self.dtype)
            if self.act_quant:
                h = act_fp8_roundtrip(xb[rows // k]) @ w13.t()
            else:
                h = xb[rows // k] @ w13.t()
            if self.b13 is not None:
                h = h + self.b13[e].to(h.dtype)
            a = activate(h, self.activation, self.alpha, self.limit).to(self.dtype)
            if self.act_quant:
                y = act_fp8_roundtrip(a) @ w2.t()
            else:
                y = a @ w2.t()
            if self.b2 is not None:
                y = y + self.b2[e].to(self.dtype)
            gemm2_out[start:start + c] = y
            start += c
        deferred = DeferredMoEOutput(gemm2_out, topk_weights, perm, float(routed_scale))
        if defer_finalize:
            return deferred
        if self.dtype != torch.bfloat16:
            return finalize_exact(gemm2_out, topk_weights, perm, shared_output, float(routed_scale))
        return moe_finalize_fuse_shared(gemm2_out, topk_weights, perm, shared_output, float(routed_scale))

    __call__ = forward
