"""Attention over a paged KV cache: the torch reference (the CPU path) and Triton decode kernels.

Cache layout (one tensor per layer and kind): `[num_blocks, block_size, ...]`; a sequence's token t
is at `cache[block_table[t // block_size], t % block_size]`. `slot = block * block_size + row`
indexes the same cache viewed as `[num_blocks * block_size, ...]`.

- GQA (Qwen3-MoE, gpt-oss): k/v caches `[NB, bs, kv_heads, d]`; optional attention sinks (one
  logit per query head added to the softmax denominator, gpt-oss) and a sliding window (keys with
  position > p - window).
- MLA (DeepSeek-V3, absorbed form): the compressed latent `c_kv [NB, bs, kv_lora]` and the roped key
  `k_rot [NB, bs, rope]`; scores = q_abs . c_kv + q_rot . k_rot, output the latent `o_lat = p @ c_kv`
  (the caller applies W_uv).

The reference handles any query length (prefill chunks over a cached prefix, decode). The Triton
kernels: decode (one query per sequence, split-KV: moe_kernels.attention_decode) and prefill/extend
(any query length over a cached prefix: moe_kernels.attention_prefill). `paged_attention_gqa` /
`paged_attention_mla` take the reference's arguments and run Triton on CUDA, the reference elsewhere.

FP8 KV cache: a cache of dtype float8_e4m3fn holds value / scale (one scale per tensor, as vLLM's
k_scale / v_scale; `write_kv(..., scale=)` quantizes, saturating at +-448); every reader takes the
same scale (`k_scale`, `v_scale`; MLA one `kv_scale` for c_kv and k_rot) and dequantizes.
"""

from __future__ import annotations

import torch

# the cache's storage (slots, writes, gathers) is moe_kernels.paged_kv's; its names stay importable from here
from moe_kernels.paged_kv import FP8, FP8_MAX, _dequant, gather_kv, quantize_fp8, slot_mapping, write_kv  # noqa: F401


# ------------------------------------------------------------------------------------------------
# torch reference

def visible(positions: torch.Tensor, kv_len: int, window: int | None = None) -> torch.Tensor:
    """[B, 1, S, L] boolean: key j visible to the query at position p (j <= p, and p - j < window)."""
    keys = torch.arange(kv_len, device=positions.device)[None, None, :]
    m = keys <= positions[:, :, None]
    if window:
        m = m & (keys > positions[:, :, None] - window)
    return m[:, None]


def _softmax(scores: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """scores [B, h, S, L] scaled -> fp32 probabilities; sinks [h]: an extra logit per head that takes
    probability mass and is then dropped (gpt-oss)."""
    s = scores.float().masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1)
    sink = sinks.float()[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
    return torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]


def paged_attention_gqa_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, positions: torch.Tensor, kv_len: int, scale: float,
                            sinks: torch.Tensor | None = None, window: int | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
    """q [B, S, h, d] -> [B, S, h, d] (q's dtype). Keys/values of the sequence's positions
    0..kv_len-1 are read through block_tables [B, >= ceil(kv_len/bs)]."""
    B, S, h, d = q.shape
    k = _dequant(gather_kv(k_cache, block_tables, kv_len), q.dtype, k_scale)  # [B, L, kvh, d]
    v = _dequant(gather_kv(v_cache, block_tables, kv_len), q.dtype, v_scale)
    g = h // k.shape[2]
    k = k.repeat_interleave(g, dim=2).transpose(1, 2)  # [B, h, L, d]
    v = v.repeat_interleave(g, dim=2).transpose(1, 2)
    scores = torch.matmul(q.transpose(1, 2), k.transpose(-1, -2)) * scale  # [B, h, S, L]
    p = _softmax(scores, visible(positions, kv_len, window), sinks).to(q.dtype)
    return torch.matmul(p, v).transpose(1, 2)


def paged_attention_mla_ref(q_abs: torch.Tensor, q_rot: torch.Tensor, ckv_cache: torch.Tensor,
                            krot_cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                            kv_len: int, scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """q_abs [B, S, h, c] (q_nope absorbed through W_uk), q_rot [B, S, h, r] -> o_lat [B, S, h, c]."""
    c = _dequant(gather_kv(ckv_cache, block_tables, kv_len), q_abs.dtype, kv_scale)  # [B, L, c]
    kr = _dequant(gather_kv(krot_cache, block_tables, kv_len), q_abs.dtype, kv_scale)  # [B, L, r]
    scores = torch.einsum("bshc,blc->bhsl", q_abs, c) + torch.einsum("bshr,blr->bhsl", q_rot, kr)
    p = _softmax(scores * scale, visible(positions, kv_len), None).to(q_abs.dtype)
    return torch.einsum("bhsl,blc->bshc", p, c)


# ------------------------------------------------------------------------------------------------
# Triton kernels: decode (one query token per sequence; seq_lens[b] = its position + 1), split-KV
# tensor-core kernels in moe_kernels.attention_decode; prefill/extend in moe_kernels.attention_prefill

from moe_kernels.attention_decode import decode_gqa, decode_mla, triton  # noqa: E402  (triton: None on CPU-only installs)
from moe_kernels.attention_prefill import mla_prefill_form, prefill_gqa, prefill_mla, prefill_mla_mha  # noqa: E402


def paged_decode_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                     window: int | None = None, num_splits: int | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """Triton: q [B, h, d] (one token per sequence, at position seq_lens-1) -> [B, h, d]."""
    return decode_gqa(q, k_cache, v_cache, block_tables, seq_lens, scale, sinks, window, num_splits,
                      k_scale=k_scale, v_scale=v_scale)


def paged_decode_mla(q_abs: torch.Tensor, q_rot: torch.Tensor, ckv_cache: torch.Tensor, krot_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     num_splits: int | None = None, kv_scale: float = 1.0) -> torch.Tensor:
    """Triton: q_abs [B, h, c], q_rot [B, h, r] -> o_lat [B, h, c]."""
    return decode_mla(q_abs, q_rot, ckv_cache, krot_cache, block_tables, seq_lens, scale, num_splits, kv_scale=kv_scale)


def _triton_ok(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None


def paged_attention_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        positions: torch.Tensor, kv_len: int, scale: float, sinks: torch.Tensor | None = None,
                        window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """paged_attention_gqa_ref's arguments and result (any query length: prefill chunks over a cached
    prefix); the Triton prefill kernel on CUDA, the reference elsewhere."""
    if _triton_ok(q):
        return prefill_gqa(q, k_cache, v_cache, block_tables, positions, kv_len, scale, sinks, window, k_scale, v_scale)
    return paged_attention_gqa_ref(q, k_cache, v_cache, block_tables, positions, kv_len, scale, sinks, window,
                                   k_scale, v_scale)


def paged_attention_mla(q_abs: torch.Tensor, q_rot: torch.Tensor, ckv_cache: torch.Tensor, krot_cache: torch.Tensor,
                        block_tables: torch.Tensor, positions: torch.Tensor, kv_len: int, scale: float,
                        kv_scale: float = 1.0) -> torch.Tensor:
    """paged_attention_mla_ref's arguments and result; the Triton prefill kernel on CUDA, the reference elsewhere."""
    if _triton_ok(q_abs):
        return prefill_mla(q_abs, q_rot, ckv_cache, krot_cache, block_tables, positions, kv_len, scale, kv_scale)
    return paged_attention_mla_ref(q_abs, q_rot, ckv_cache, krot_cache, block_tables, positions, kv_len, scale, kv_scale)


def paged_attention_mla_heads(q_nope: torch.Tensor, q_rot: torch.Tensor, ckv_cache: torch.Tensor,
                              krot_cache: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                              block_tables: torch.Tensor, positions: torch.Tensor, kv_len: int, scale: float,
                              kv_scale: float = 1.0) -> torch.Tensor:
    """MLA prefill to the per-head output before o_proj: q_nope [B, S, h, nope], w_uk [h, nope, c],
    w_uv [h, v, c] -> [B, S, h, v]. On CUDA the non-absorbed kernel where it needs fewer FLOPs (long
    chunks: mla_prefill_form), else the absorbed form (Triton on CUDA, the reference elsewhere) and then W_uv."""
    H, nope, c = w_uk.shape
    B, S = q_nope.shape[:2]
    v_dim = w_uv.shape[1]
    pow2 = not (nope & (nope - 1) or v_dim & (v_dim - 1))  # the non-absorbed kernel's aranges; else absorbed
    if _triton_ok(q_nope) and pow2 and mla_prefill_form(B, S, kv_len, H, c, nope, q_rot.shape[-1], v_dim) == "mha":
        return prefill_mla_mha(q_nope, q_rot, ckv_cache, krot_cache, w_uk, w_uv, block_tables, positions, kv_len,
                               scale, kv_scale)
    q_abs = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)
    o_lat = paged_attention_mla(q_abs, q_rot.contiguous(), ckv_cache, krot_cache, block_tables, positions, kv_len,
                                scale, kv_scale)
    return torch.einsum("bshc,hvc->bshv", o_lat, w_uv)
