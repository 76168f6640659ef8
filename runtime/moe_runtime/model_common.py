"""Building blocks shared by the model families: RMSNorm, RoPE (default and YaRN), SwiGLU MLP,
a slot-indexed KV cache and masked attention.

Batching model: every running sequence owns a *slot* (a row of the KV cache). A forward call takes
`input_ids [B, S]`, `positions [B, S]` and `slots [B]`; new keys/values are written at
`cache[slot, position]` and each query attends to cache positions `<= its own position` of its own
slot. One code path then serves prefill (B=1, S=prompt) and batched decode (B=running, S=1).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import RuntimeFailure


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics, output cast back before the weight multiply (HF's order, so fp32/bf16 match it)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """A bias-free linear over an already-loaded weight [out, in]."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SwiGLU(nn.Module):
    """Dense MLP / shared expert: down(silu(gate(x)) * up(x))."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(gate), Linear(up), Linear(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ------------------------------------------------------------------------------------------------
# RoPE

def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(cfg: dict[str, Any], dim: int) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [dim/2], cos/sin scale, softmax-scale multiplier) for the config's rope.

    Supports the default rope and YaRN (DeepSeek-V3's `rope_scaling: {type: yarn, factor, ...}`, with
    its mscale/mscale_all_dim softmax correction). Other scaling types are rejected clearly rather than
    served with silently wrong positions."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    base = float(rs.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    kind = rs.get("rope_type") or rs.get("type") or "default"
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq, 1.0, 1.0
    if kind != "yarn":
        raise RuntimeFailure(f"config.json rope_scaling type {kind!r} is not supported by the bundled runtime "
                             "(supported: default, yarn)")
    factor = float(rs["factor"])
    orig = int(rs.get("original_max_position_embeddings") or cfg.get("max_position_embeddings"))
    beta_fast, beta_slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    attn_factor = rs.get("attention_factor")
    if attn_factor is None:
        attn_factor = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
                       if mscale and mscale_all else yarn_get_mscale(factor))

    def corr_dim(n_rot: float) -> float:
        return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    softmax_mult = yarn_get_mscale(factor, mscale_all) ** 2 if mscale_all else 1.0
    return inv_freq, float(attn_factor), softmax_mult


class Rope(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, scale: float, interleave: bool):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale, self.interleave = scale, interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, heads, d]; cos/sin [B, S, d/2]."""
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        if self.interleave:
            # DeepSeek pairs (x0, x1), (x2, x3)...; output de-interleaved like HF (q and k alike, so
            # dot products are those of the interleaved rotation)
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ------------------------------------------------------------------------------------------------
# Attention helpers

def causal_slot_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, 1, S, L] boolean: key j visible to the query at position p iff j <= p."""
    keys = torch.arange(kv_len, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]


def masked_softmax_attention(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores [B, h, S, L] (already scaled) -> probabilities in fp32."""
    scores = scores.float().masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)
