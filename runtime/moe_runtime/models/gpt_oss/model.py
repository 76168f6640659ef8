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

The MoE layer is the shared block (models.common.moe.MoEBlock, "topk_softmax" routing with the
router's bias); the activation and the biases are its experts backend's: experts.Experts, the torch
path that computes them in x's dtype as transformers does, when the plan's backend is torch, or the
plan's kernel backend (Triton on CUDA: the same activation and biases in fp32 epilogues, so not
transformers' bf16 roundings; the capability table, moe_core.runtime, declares gpt-oss's experts as
"swiglu_oai" with biases, and only backends that compute those are planned). On the torch path MXFP4
experts stay packed in memory (moe_kernels ExpertWeights) and each step dequantizes only the experts
it routes to; bf16 experts are used as they are.

Tensor / expert parallel (moe_runtime.dist.shard.ShardPlan slices at load): attention heads over tp
with their q/k/v biases and sinks (KV heads split, or replicated when tp exceeds them), o_proj's bias
added once (dist.layers.RowParallelLinear); the router replicated; experts over ep with their biases, the
intermediate split inside the experts for the rest (down's bias on one rank of the group); the
combine is moe_runtime.dist.combine's, as for the other families.

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
from moe_kernels.experts import ExpertWeights
from moe_kernels.reference import TorchExperts

from ...dist.layers import RowParallelLinear
from ...errors import RuntimeFailure
from ...log import log
from ..common import layers as common
from ..common.attention import GqaKvCache, checkpoint_kv_scales
from ..common.layers import AttnContext, CausalLM
from ..common.moe import MoEBlock, RoutingConfig
from ..common.rope import Rope, rope_parameters
from .experts import SWIGLU_ALPHA, SWIGLU_LIMIT, Experts

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


class Attention(GqaKvCache, nn.Module):
    def __init__(self, cfg: dict[str, Any], w, p: str, rope: Rope, window: int | None, group=None):
        super().__init__()
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]

        def lin(name):
            return BiasedLinear(w(p + name + ".weight"), w(p + name + ".bias") if w.has(p + name + ".bias") else None)

        self.q_proj, self.k_proj, self.v_proj = lin("q_proj"), lin("k_proj"), lin("v_proj")
        o = p + "o_proj."
        # o_proj's bias is added once per attention group (dist.layers.RowParallelLinear)
        self.o_proj = RowParallelLinear(w(o + "weight"), "attn", group, w(o + "bias") if w.has(o + "bias") else None)
        # heads on this rank, from the (possibly tensor-parallel) slices the loader gave; the sinks are
        # those of this rank's query heads (dist.shard.ShardPlan splits them with the heads)
        self.nh, self.nkv = self.q_proj.weight.shape[0] // self.hd, self.k_proj.weight.shape[0] // self.hd
        # the sinks join the softmax in fp32 (both attention paths); transformers holds them in the model dtype
        self.sinks = nn.Parameter(w(p + "sinks").float().contiguous(), requires_grad=False)
        self.window, self.rope, self.scale = window, rope, self.hd ** -0.5
        self.kv_scales = checkpoint_kv_scales(w, p)  # used with --kv-cache-dtype fp8
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, ctx: AttnContext, cos_sin):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.nh, self.hd)
        k = self.k_proj(x).view(B, S, self.nkv, self.hd)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd)
        cos, sin = cos_sin
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        return self.o_proj(self.attend(q, k, v, ctx, self.scale, self.sinks, self.window))


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


def experts_backend(cfg: dict[str, Any], ew: ExpertWeights, factory=None):
    """The experts of one layer (GptOssArch.experts): `factory`'s backend (an experts class of
    moe_kernels.interface, or a partial of one) when it computes swiglu_oai with biases and is not the
    torch reference, else the torch path above over its ExpertWeights."""
    alpha, limit = float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)), float(cfg.get("swiglu_limit", SWIGLU_LIMIT))
    cls = getattr(factory, "func", factory)
    if cls is None or cls is TorchExperts or "swiglu_oai" not in getattr(cls, "activations", ()) \
            or not getattr(cls, "supports_bias", False):
        return Experts(ew, alpha, limit)
    return factory(ew, activation="swiglu_oai", alpha=alpha, limit=limit)


def build(cfg: dict[str, Any], w: Callable[[str], torch.Tensor], experts: Callable[[int], Experts],
          deferred: bool, group=None) -> CausalLM:
    """`experts(layer)` gives that layer's experts backend (experts_backend). `deferred` has nothing to
    fuse (no shared expert) and is not used."""
    eps = cfg.get("rms_norm_eps", 1e-5)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # YaRN scales cos/sin by its attention factor; gpt-oss keeps the plain 1/sqrt(d) softmax scale
    inv_freq, cs_scale, _ = rope_parameters(cfg, hd)
    rope = Rope(inv_freq, cs_scale, interleave=False)
    routing = RoutingConfig("topk_softmax", int(cfg["num_experts_per_tok"]), renormalize=False)
    layers = []
    for i, window in enumerate(layer_windows(cfg)):
        p = f"model.layers.{i}."
        ex = experts(i)
        if i == 0:
            torch_path = isinstance(ex, Experts)
            fmt = ex.weights.format if torch_path else getattr(ex, "fmt", "?")
            log("decision", f"gpt-oss experts: {fmt} weights; "
                + ("computed by its torch experts path (biases and the clamped SwiGLU in the model's dtype, as "
                   "transformers computes them" + (", the routed experts dequantized each step)" if fmt != "bf16" else ")")
                   if torch_path else f"computed by {type(ex).__name__} (biases and the clamped SwiGLU in fp32 epilogues)"),
                expert_format=fmt)
        # GptOssTopKRouter: top-k of the biased logits, then softmax over those k only (in x's dtype)
        moe = MoEBlock(w(p + "mlp.router.weight"), None, routing, ex, None, False, group,
                       router_bias=w(p + "mlp.router.bias"))
        layers.append(DecoderLayer(Attention(cfg, w, p + "self_attn.", rope, window, group), moe,
                                   w(p + "input_layernorm.weight"), w(p + "post_attention_layernorm.weight"), eps))
    lm = CausalLM(cfg, w, layers, rope, group)
    lm.norm = RMSNorm(w("model.norm.weight"), eps)
    return lm
