"""GptOssForCausalLM (openai/gpt-oss): GQA attention with q/k/v/o biases and per-head attention
sinks, sliding-window (config `sliding_window`, 128) and full attention alternating by
`layer_types`, YaRN rope, a biased top-k router (softmax over the selected logits) and experts with
biases and a clamped SwiGLU. Every layer is MoE; there is no shared expert.

Semantics are those of transformers 5.24's modeling_gpt_oss.py:
- RMSNorm multiplies the fp32 normalised activations by the weight before casting back (the other
  families cast first), so gpt-oss has its own norm here;
- router: logits = x W^T + b; top-k; softmax over the k selected logits (in x's dtype);
- experts: [gate | up] = x W13^T + b13; gate = min(gate, limit); up = clamp(up, -limit, limit);
  out = ((up + 1) * gate * sigmoid(alpha * gate)) W2^T + b2 (alpha 1.702, limit 7.0);
- attention: softmax over [scores, sink] with the sink's probability dropped; a sliding layer's query
  at position p sees keys p - window < j <= p.

The experts run here, in torch, not on a kernel backend: no backend computes biases or this
activation (the capability table, moe_core.runtime, says torch for gpt-oss so the plan agrees).
MXFP4 experts stay packed in memory (moe_kernels ExpertWeights, the kernels' MXFP4 decoder) and
each step dequantizes only the experts it routes to; bf16 experts are used as they are.

Tensor / expert parallel (moe_runtime.parallel.ShardPlan slices at load): attention heads over tp
with their q/k/v biases and sinks (KV heads split, or replicated when tp exceeds them), o_proj's bias
added once (RowParallelBiased); the router replicated; experts over ep with their biases, the
intermediate split inside the experts for the rest (down's bias on one rank of the group); the
combine is moe_runtime.dispatch's, as for the other families.

KV cache: sliding layers keep every position in the paged cache and mask (no window-sized ring
buffer), so their KV memory is that of a full-attention layer. Keeping only the window needs a
second block id space: every layer's cache is indexed by the same per-sequence block table
(kv_cache.BlockManager), so a block past the window cannot be freed for the sliding layers alone.
It would take a sliding-layer pool with its own tables (freed behind position - window, slots
mapped per table in AttnContext, a second table in CausalLM.forward and the CUDA-graph decoder),
prefix hits that also hold the window's blocks, and the KV budget split between the two pools.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from moe_kernels import paged_attention as pa
from moe_kernels.experts import ExpertWeights

from .. import dispatch, parallel
from ..errors import RuntimeFailure
from ..log import log
from . import common
from .common import AttnContext, CausalLM, GqaKvCache, Rope, rope_parameters

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

    Sharded (moe_runtime.parallel: this rank's experts and, with TP inside the experts, its part of
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)  # weight multiply in fp32, then cast (GptOssRMSNorm)


class RMSNorm(common.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class BiasedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelBiased(nn.Module):
    """o_proj under tensor parallelism: this rank's input-dimension slice (its heads), the partial
    outputs summed over the attention group (parallel.all_reduce_attn, fp32), the bias added once:
    by the group's first rank before the sum. Without a process group (or attention replicated, tp 1)
    the plain biased linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = parallel.STATE
        first = g is None or g.layout.tp == 1 or g.layout.tp_rank == 0
        return parallel.all_reduce_attn(F.linear(x, self.weight, self.bias if first else None))


class Attention(GqaKvCache, nn.Module):
    def __init__(self, cfg: dict[str, Any], w, p: str, rope: Rope, window: int | None):
        super().__init__()
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]

        def lin(name):
            return BiasedLinear(w(p + name + ".weight"), w(p + name + ".bias") if w.has(p + name + ".bias") else None)

        self.q_proj, self.k_proj, self.v_proj = lin("q_proj"), lin("k_proj"), lin("v_proj")
        o = p + "o_proj."
        self.o_proj = RowParallelBiased(w(o + "weight"), w(o + "bias") if w.has(o + "bias") else None)
        # heads on this rank, from the (possibly tensor-parallel) slices the loader gave; the sinks are
        # those of this rank's query heads (parallel.ShardPlan splits them with the heads)
        self.nh, self.nkv = self.q_proj.weight.shape[0] // self.hd, self.k_proj.weight.shape[0] // self.hd
        # the sinks join the softmax in fp32 (both attention paths); transformers holds them in the model dtype
        self.sinks = nn.Parameter(w(p + "sinks").float().contiguous(), requires_grad=False)
        self.window, self.rope, self.scale = window, rope, self.hd ** -0.5
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, ctx: AttnContext, cos_sin):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.nh, self.hd)
        k = self.k_proj(x).view(B, S, self.nkv, self.hd)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd)
        cos, sin = cos_sin
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        pa.write_kv(self.k_cache, ctx.slots, k)
        pa.write_kv(self.v_cache, ctx.slots, v)
        if ctx.decode_kernel:
            o = pa.paged_decode_gqa(q[:, 0].contiguous(), self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens,
                                    self.scale, self.sinks, self.window)[:, None]
        else:
            o = pa.paged_attention_gqa_ref(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.positions, ctx.kv_len,
                                           self.scale, self.sinks, self.window)
        return self.o_proj(o.reshape(B, S, self.nh * self.hd))


class Experts:
    """Routed experts with biases and the clamped SwiGLU, over ExpertWeights (bf16 or mxfp4) whose
    extras hold `w13_bias` / `w2_bias` (stack_experts). Computes in x's dtype, like transformers'
    GptOssExperts: per routed expert, matmul then bias, activation, matmul then bias, times the
    routing weight, summed into the token's row."""

    def __init__(self, weights: ExpertWeights, alpha: float, limit: float):
        if "w13_bias" not in weights.extras or "w2_bias" not in weights.extras:
            raise RuntimeFailure("gpt-oss experts need their biases (w13_bias, w2_bias)")
        self.weights, self.alpha, self.limit = weights, alpha, limit
        self.b13, self.b2 = weights.extras["w13_bias"], weights.extras["w2_bias"]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        w, inter = self.weights, self.weights.intermediate_size
        y = torch.zeros_like(x)
        flat = topk_ids.reshape(-1)
        # expert parallel: ids of experts on other ranks are -1 (parallel.localize_expert_ids); they
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
        return y


class MoE(nn.Module):
    def __init__(self, router_w: torch.Tensor, router_b: torch.Tensor, experts: Experts, top_k: int):
        super().__init__()
        self.router = BiasedLinear(router_w, router_b)
        self.experts, self.top_k = experts, top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under expert/tensor parallelism (moe_runtime.parallel) the router is replicated (every rank
        routes every token alike), this rank's experts run the pairs routed to them, and the partial
        sums are combined over the world (moe_runtime.dispatch), as the other families' MoEBlock does."""
        # GptOssTopKRouter: top-k of the biased logits, then softmax over those k only
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
        y = self.experts.forward(x, weights, parallel.localize_expert_ids(ids, self.experts))
        return dispatch.combine(y, ids, self.experts, False)


class DecoderLayer(common.DecoderLayer):
    norm = RMSNorm


def layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window (None: full attention). `layer_types` as written, else
    GptOssConfig's default (even layers sliding, odd layers full)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise RuntimeFailure(f"config.json layer_types must name sliding_attention/full_attention for each of the "
                             f"{n} layers, got {types}")
    window = cfg.get("sliding_window")
    return [int(window) if t == "sliding_attention" and window else None for t in types]


def build(cfg: dict[str, Any], w: Callable[[str], torch.Tensor], experts: Callable[[int], ExpertWeights],
          deferred: bool) -> CausalLM:
    """`experts(layer)` gives that layer's ExpertWeights themselves (models.OWN_EXPERTS): no backend
    is built over them. `deferred` has nothing to fuse (no shared expert) and is not used."""
    eps = cfg.get("rms_norm_eps", 1e-5)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # YaRN scales cos/sin by its attention factor; gpt-oss keeps the plain 1/sqrt(d) softmax scale
    inv_freq, cs_scale, _ = rope_parameters(cfg, hd)
    rope = Rope(inv_freq, cs_scale, interleave=False)
    alpha, limit = float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)), float(cfg.get("swiglu_limit", SWIGLU_LIMIT))
    top_k = cfg["num_experts_per_tok"]
    layers = []
    for i, window in enumerate(layer_windows(cfg)):
        p = f"model.layers.{i}."
        ew = experts(i)
        if i == 0:
            log("decision", f"gpt-oss experts: {ew.format} weights"
                + (" kept packed, the routed experts dequantized each step" if ew.format != "bf16" else "")
                + "; computed by the model's torch path (biases and the clamped SwiGLU are in no kernel backend)",
                expert_format=ew.format)
        moe = MoE(w(p + "mlp.router.weight"), w(p + "mlp.router.bias"), Experts(ew, alpha, limit), int(top_k))
        layers.append(DecoderLayer(Attention(cfg, w, p + "self_attn.", rope, window), moe,
                                   w(p + "input_layernorm.weight"), w(p + "post_attention_layernorm.weight"), eps))
    lm = CausalLM(cfg, w, layers, rope)
    lm.norm = RMSNorm(w("model.norm.weight"), eps)
    return lm
