"""RoPE: the default rotation and YaRN (with its mscale softmax correction), the pairs interleaved
(DeepSeek's layout) or split in halves."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ...config_keys import rope_dict
from ...errors import RuntimeFailure


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(cfg: dict[str, Any], dim: int) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [dim/2], cos/sin scale, softmax-scale multiplier) for the config's rope.

    Supports the default rope and YaRN (DeepSeek-V3's `rope_scaling: {type: yarn, factor, ...}`, with
    its mscale/mscale_all_dim softmax correction). Other scaling types are rejected clearly rather than
    served with silently wrong positions."""
    rs = rope_dict(cfg, "")  # both spellings (rope_parameters / rope_theta + rope_scaling): config_keys
    base = rs["rope_theta"]
    kind = rs["rope_type"]
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

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):  # transformers' yarn: `truncate` (default true) floors/ceils the range
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
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
