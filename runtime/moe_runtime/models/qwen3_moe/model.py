"""Qwen3MoeForCausalLM: GQA attention with per-head q/k RMSNorm, softmax top-k MoE (norm_topk_prob),
no shared expert. The decoder layer, the LM top and the paged GQA tail are the shared ones of
models.common."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ...dist.layers import RowParallelLinear
from ..common.attention import GqaKvCache, checkpoint_kv_scales
from ..common.layers import AttnContext, CausalLM, Linear, RMSNorm, build_layers
from ..common.moe import MoEBlock, RoutingConfig
from ..common.rope import Rope, rope_parameters


class GQAttention(GqaKvCache, nn.Module):
    def __init__(self, cfg: dict[str, Any], w: Callable[[str], torch.Tensor], p: str, rope: Rope, group=None):
        super().__init__()
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_proj, self.k_proj = Linear(w(p + "q_proj.weight")), Linear(w(p + "k_proj.weight"))
        self.v_proj = Linear(w(p + "v_proj.weight"))
        self.o_proj = RowParallelLinear(w(p + "o_proj.weight"), "attn", group)
        # heads on this rank, from the (possibly tensor-parallel) slices the loader gave
        self.nh, self.nkv = self.q_proj.weight.shape[0] // self.hd, self.k_proj.weight.shape[0] // self.hd
        self.q_norm, self.k_norm = RMSNorm(w(p + "q_norm.weight"), eps), RMSNorm(w(p + "k_norm.weight"), eps)
        self.rope = rope
        self.kv_scales = checkpoint_kv_scales(w, p)  # used with --kv-cache-dtype fp8
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, ctx: AttnContext, cos_sin):
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, self.nh, self.hd))
        k = self.k_norm(self.k_proj(x).view(B, S, self.nkv, self.hd))
        v = self.v_proj(x).view(B, S, self.nkv, self.hd)
        cos, sin = cos_sin
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        return self.o_proj(self.attend(q, k, v, ctx, self.hd ** -0.5))


def build(cfg: dict[str, Any], w: Callable[[str], torch.Tensor], experts: Callable[[int], Any],
          deferred: bool, group=None) -> CausalLM:
    """Softmax top-k routing (norm_topk_prob), no shared expert, so nothing to defer into the finalize."""
    r = RoutingConfig("softmax", cfg["num_experts_per_tok"], bool(cfg.get("norm_topk_prob", False)))

    def make_moe(i: int, p: str) -> MoEBlock:
        return MoEBlock(w(p + "gate.weight"), None, r, experts(i), None, deferred, group)

    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv_freq, cs_scale, _ = rope_parameters(cfg, hd)
    rope = Rope(inv_freq, cs_scale, interleave=False)
    layers = build_layers(cfg, w, lambda p: GQAttention(cfg, w, p + "self_attn.", rope, group), make_moe, group)
    return CausalLM(cfg, w, layers, rope, group)
