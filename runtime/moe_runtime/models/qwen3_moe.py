"""Qwen3MoeForCausalLM: GQA attention with per-head q/k RMSNorm, softmax top-k MoE (norm_topk_prob),
no shared expert. The decoder layer and the LM top are the shared ones of models.common."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel
from moe_kernels import paged_attention as pa

from .common import AttnContext, CausalLM, GqaKvCache, Linear, RMSNorm, Rope, build_layers, rope_parameters
from .moe import MoEBlock, RoutingConfig


class GQAttention(GqaKvCache, nn.Module):
    def __init__(self, cfg: dict[str, Any], w: Callable[[str], torch.Tensor], p: str, rope: Rope):
        super().__init__()
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_proj, self.k_proj = Linear(w(p + "q_proj.weight")), Linear(w(p + "k_proj.weight"))
        self.v_proj = Linear(w(p + "v_proj.weight"))
        self.o_proj = parallel.RowParallelLinear(w(p + "o_proj.weight"), "attn")
        # heads on this rank, from the (possibly tensor-parallel) slices the loader gave
        self.nh, self.nkv = self.q_proj.weight.shape[0] // self.hd, self.k_proj.weight.shape[0] // self.hd
        self.q_norm, self.k_norm = RMSNorm(w(p + "q_norm.weight"), eps), RMSNorm(w(p + "k_norm.weight"), eps)
        self.rope = rope
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, ctx: AttnContext, cos_sin):
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, self.nh, self.hd))
        k = self.k_norm(self.k_proj(x).view(B, S, self.nkv, self.hd))
        v = self.v_proj(x).view(B, S, self.nkv, self.hd)
        cos, sin = cos_sin
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        pa.write_kv(self.k_cache, ctx.slots, k)
        pa.write_kv(self.v_cache, ctx.slots, v)
        if ctx.decode_kernel:
            o = pa.paged_decode_gqa(q[:, 0].contiguous(), self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens,
                                    self.hd ** -0.5)[:, None]
        else:
            o = pa.paged_attention_gqa_ref(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.positions, ctx.kv_len,
                                           self.hd ** -0.5)
        return self.o_proj(o.reshape(B, S, self.nh * self.hd))


def build(cfg: dict[str, Any], w: Callable[[str], torch.Tensor], experts: Callable[[int], Any],
          deferred: bool) -> CausalLM:
    """Softmax top-k routing (norm_topk_prob), no shared expert, so nothing to defer into the finalize."""
    r = RoutingConfig("softmax", cfg["num_experts_per_tok"], bool(cfg.get("norm_topk_prob", False)))

    def make_moe(i: int, p: str) -> MoEBlock:
        return MoEBlock(w(p + "gate.weight"), None, r, experts(i), None, deferred)

    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv_freq, cs_scale, _ = rope_parameters(cfg, hd)
    rope = Rope(inv_freq, cs_scale, interleave=False)
    layers = build_layers(cfg, w, lambda p: GQAttention(cfg, w, p + "self_attn.", rope), make_moe)
    return CausalLM(cfg, w, layers, rope)
