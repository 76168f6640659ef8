"""Qwen3MoeForCausalLM: GQA attention with per-head q/k RMSNorm, softmax top-k MoE (norm_topk_prob),
no shared expert. Reuses the DeepSeek module's decoder layer and LM top."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .deepseek_v3 import CausalLM, build_layers
from .model_common import Linear, RMSNorm, Rope, causal_slot_mask, rope_parameters


class GQAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], w: Callable[[str], torch.Tensor], p: str, rope: Rope):
        super().__init__()
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.nh
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_proj, self.k_proj = Linear(w(p + "q_proj.weight")), Linear(w(p + "k_proj.weight"))
        self.v_proj, self.o_proj = Linear(w(p + "v_proj.weight")), Linear(w(p + "o_proj.weight"))
        self.q_norm, self.k_norm = RMSNorm(w(p + "q_norm.weight"), eps), RMSNorm(w(p + "k_norm.weight"), eps)
        self.rope = rope
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def allocate(self, slots: int, max_len: int, dtype: torch.dtype, device) -> None:
        self.k_cache = torch.zeros(slots, self.nkv, max_len, self.hd, dtype=dtype, device=device)
        self.v_cache = torch.zeros(slots, self.nkv, max_len, self.hd, dtype=dtype, device=device)

    def forward(self, x, positions, slots, cos_sin, kv_len):
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, self.nh, self.hd))
        k = self.k_norm(self.k_proj(x).view(B, S, self.nkv, self.hd))
        v = self.v_proj(x).view(B, S, self.nkv, self.hd)
        cos, sin = cos_sin
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        # cache layout [slot, head, pos, d]: index with (slot, :, pos)
        self.k_cache[slots[:, None], :, positions] = k.to(self.k_cache.dtype)
        self.v_cache[slots[:, None], :, positions] = v.to(self.v_cache.dtype)
        keys, values = self.k_cache[slots, :, :kv_len], self.v_cache[slots, :, :kv_len]
        mask = causal_slot_mask(positions, kv_len)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                           scale=self.hd ** -0.5, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.nh * self.hd))


def build(cfg: dict[str, Any], w: Callable[[str], torch.Tensor], make_moe: Callable[[int, str], nn.Module]) -> CausalLM:
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv_freq, cs_scale, _ = rope_parameters(cfg, hd)
    rope = Rope(inv_freq, cs_scale, interleave=False)
    layers = build_layers(cfg, w, lambda p: GQAttention(cfg, w, p + "self_attn.", rope), make_moe)
    return CausalLM(cfg, w, layers, rope)
