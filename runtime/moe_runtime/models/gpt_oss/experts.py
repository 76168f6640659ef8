"""gpt-oss's routed experts: stacking its fused, transposed, gate/up-interleaved, biased tensors into
the kernels' ExpertWeights contract, and the torch experts backend that computes them as
transformers does (biases and the clamped SwiGLU, in x's dtype)."""

from __future__ import annotations

import torch
from moe_kernels.experts import ExpertWeights

from ...errors import RuntimeFailure


# transformers' GptOssConfig defaults for keys a config.json may leave out (the hub's gpt-oss-20b and
# -120b configs have no swiglu_alpha)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss interleaves gate and up (gate at even, up at odd indices of `dim`); the kernels'
    ExpertWeights contract is [gate; up]."""
    idx = torch.arange(t.shape[dim], device=t.device)
    return torch.cat([t.index_select(dim, idx[0::2]), t.index_select(dim, idx[1::2])], dim=dim).contiguous()


def stack_experts(raw: dict[str, torch.Tensor], prefix: str, fmt: str, dtype: torch.dtype,
                  down_bias: bool = True) -> dict[str, torch.Tensor]:
    """One layer's expert tensors (popped from `raw`) as ExpertWeights.from_quantized keywords:
    w13 [E, 2I, H] in [gate; up] row order, w2 [E, H, I], and the biases (`w13_bias` [E, 2I],
    `w2_bias` [E, H], in `dtype`) as extras.

    bf16: `experts.gate_up_proj` [E, H, 2I] and `experts.down_proj` [E, I, H] are transposed to the
    [E, N, K] layout. mxfp4: `*_blocks` [E, N, K/32, 16] and `*_scales` [E, N, K/32] are already
    [E, N, K] (ExpertWeights flattens the blocks to packed [E, N, K/2]); de-interleaving permutes
    whole rows, so it applies to the packed bytes and the scales alike.

    Sharded (moe_runtime.dist.shard: this rank's experts and, with TP inside the experts, its part of
    the intermediate dimension): the tensors in `raw` are this rank's slices already; a contiguous
    part of the interleaved 2I holds gate and up of one intermediate slice, so the same
    de-interleaving applies. `down_bias` False (etp ranks other than 0): w2_bias is zero, so the
    combine over the expert group adds down's bias once."""
    m = prefix + "experts."
    b2 = raw.pop(m + "down_proj_bias").to(dtype).contiguous()
    out = {"w13_bias": _deinterleave(raw.pop(m + "gate_up_proj_bias"), 1).to(dtype),
           "w2_bias": b2 if down_bias else torch.zeros_like(b2)}
    if fmt == "bf16":
        out["w13_weight"] = _deinterleave(raw.pop(m + "gate_up_proj").transpose(1, 2), 1).to(torch.bfloat16)
        out["w2_weight"] = raw.pop(m + "down_proj").transpose(1, 2).to(torch.bfloat16).contiguous()
    elif fmt == "mxfp4":
        out["w13_weight"] = _deinterleave(raw.pop(m + "gate_up_proj_blocks"), 1)
        out["w13_weight_scale"] = _deinterleave(raw.pop(m + "gate_up_proj_scales"), 1)
        out["w2_weight"] = raw.pop(m + "down_proj_blocks").contiguous()
        out["w2_weight_scale"] = raw.pop(m + "down_proj_scales").contiguous()
    else:
        raise RuntimeFailure(f"gpt-oss experts are read in bf16 or mxfp4, not {fmt}")
    return out


class Experts:
    """Routed experts with biases and the clamped SwiGLU, over ExpertWeights (bf16 or mxfp4) whose
    extras hold `w13_bias` / `w2_bias` (stack_experts). Computes in x's dtype, like transformers'
    GptOssExperts: per routed expert, matmul then bias, activation, matmul then bias, times the
    routing weight, summed into the token's row (bf16 accumulation, in the routed order). An experts
    backend of the moe_kernels interface (moe_kernels.interface.Experts): the shared MoE block runs
    it like any other; it does not defer its finalize (there is no shared expert to fuse)."""

    activations = frozenset({"swiglu_oai"})
    formats = frozenset({"bf16", "mxfp4"})
    supports_bias = True

    def __init__(self, weights: ExpertWeights, alpha: float, limit: float):
        if "w13_bias" not in weights.extras or "w2_bias" not in weights.extras:
            raise RuntimeFailure("gpt-oss experts need their biases (w13_bias, w2_bias)")
        self.weights, self.alpha, self.limit = weights, alpha, limit
        self.b13, self.b2 = weights.extras["w13_bias"], weights.extras["w2_bias"]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                shared_output: torch.Tensor | None = None, routed_scale: float = 1.0,
                defer_finalize: bool = False) -> torch.Tensor:
        if defer_finalize:
            raise ValueError("gpt-oss's torch experts finalize themselves (defer_finalize=False)")
        w, inter = self.weights, self.weights.intermediate_size
        y = torch.zeros_like(x)
        flat = topk_ids.reshape(-1)
        # expert parallel: ids of experts on other ranks are -1 (dist.layers.localize_expert_ids); they
        # sort first and are skipped
        order = torch.argsort(flat, stable=True)
        start = int((flat < 0).sum())
        counts = torch.bincount(flat[flat >= 0], minlength=w.num_experts).tolist()
        k = topk_ids.shape[1]
        for e, c in enumerate(counts):
            if c == 0:
                continue
            pairs = order[start:start + c]
            start += c
            tok = pairs // k
            w13, w2 = w.dequantize_expert(e, x.dtype)  # MXFP4: only the experts this step routes to
            h = x[tok] @ w13.t() + self.b13[e]
            gate = h[:, :inter].clamp(max=self.limit)
            up = h[:, inter:].clamp(min=-self.limit, max=self.limit)
            a = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            out = a @ w2.t() + self.b2[e]
            y.index_add_(0, tok, out * topk_weights.reshape(-1)[pairs, None])
        if routed_scale != 1.0:
            y = y * routed_scale
        return y if shared_output is None else y + shared_output

    __call__ = forward
