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

The reference handles any query length (prefill chunks over a cached prefix, decode); the Triton
kernels do decode (one query per sequence), the step that reads the whole cache every token.
"""

from __future__ import annotations

import math

import torch


# ------------------------------------------------------------------------------------------------
# torch reference

def slot_mapping(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, S] flat cache slots of the tokens at `positions` [B, S]."""
    blk = torch.gather(block_tables, 1, torch.div(positions, block_size, rounding_mode="floor"))
    return blk * block_size + positions % block_size


def write_kv(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache [NB, bs, ...]; slots [B, S]; values [B, S, ...]."""
    flat = cache.view(-1, *cache.shape[2:])
    flat[slots.reshape(-1)] = values.reshape(-1, *values.shape[2:]).to(cache.dtype)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, kv_len, ...]: each row's first kv_len cached tokens, read through its block table."""
    bs = cache.shape[1]
    nb = math.ceil(kv_len / bs)
    g = cache[block_tables[:, :nb]]  # [B, nb, bs, ...]
    return g.reshape(g.shape[0], nb * bs, *cache.shape[2:])[:, :kv_len]


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
                            sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [B, S, h, d] -> [B, S, h, d] (q's dtype). Keys/values of the sequence's positions
    0..kv_len-1 are read through block_tables [B, >= ceil(kv_len/bs)]."""
    B, S, h, d = q.shape
    k = gather_kv(k_cache, block_tables, kv_len)  # [B, L, kvh, d]
    v = gather_kv(v_cache, block_tables, kv_len)
    g = h // k.shape[2]
    k = k.repeat_interleave(g, dim=2).transpose(1, 2)  # [B, h, L, d]
    v = v.repeat_interleave(g, dim=2).transpose(1, 2)
    scores = torch.matmul(q.transpose(1, 2), k.transpose(-1, -2)) * scale  # [B, h, S, L]
    p = _softmax(scores, visible(positions, kv_len, window), sinks).to(q.dtype)
    return torch.matmul(p, v).transpose(1, 2)


def paged_attention_mla_ref(q_abs: torch.Tensor, q_rot: torch.Tensor, ckv_cache: torch.Tensor,
                            krot_cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                            kv_len: int, scale: float) -> torch.Tensor:
    """q_abs [B, S, h, c] (q_nope absorbed through W_uk), q_rot [B, S, h, r] -> o_lat [B, S, h, c]."""
    c = gather_kv(ckv_cache, block_tables, kv_len)  # [B, L, c]
    kr = gather_kv(krot_cache, block_tables, kv_len)  # [B, L, r]
    scores = torch.einsum("bshc,blc->bhsl", q_abs, c) + torch.einsum("bshr,blr->bhsl", q_rot, kr)
    p = _softmax(scores * scale, visible(positions, kv_len), None).to(q_abs.dtype)
    return torch.einsum("bhsl,blc->bshc", p, c)


# ------------------------------------------------------------------------------------------------
# Triton decode kernels (one query token per sequence; seq_lens[b] = its position + 1)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = None

if triton is not None:
    @triton.jit
    def _gqa_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, sink_ptr, o_ptr, scale,
                           stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb, stride_ob, stride_oh,
                           window, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
                           HAS_SINK: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // G
        n = tl.load(len_ptr + b)
        d = tl.arange(0, BD)
        dm = d < D
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dm, other=0.0).to(tl.float32)
        t = tl.arange(0, BS)
        m_i = -float("inf")
        l_i = 0.0
        acc = tl.zeros([BD], dtype=tl.float32)
        lo = 0
        if window > 0:
            lo = tl.maximum(n - window, 0)
        for blk in range(lo // BS, tl.cdiv(n, BS)):
            bid = tl.load(bt_ptr + b * stride_btb + blk).to(tl.int64)
            pos = blk * BS + t
            ok = (pos < n) & (pos >= lo)
            off = bid * stride_kb + t[:, None] * stride_kt + kvh * stride_kh + d[None, :]
            k = tl.load(k_ptr + off, mask=ok[:, None] & dm[None, :], other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(ok, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_ptr + off, mask=ok[:, None] & dm[None, :], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        if HAS_SINK:
            sk = tl.load(sink_ptr + h).to(tl.float32)
            m_new = tl.maximum(m_i, sk)
            alpha = tl.exp(m_i - m_new)
            acc = acc * alpha
            l_i = l_i * alpha + tl.exp(sk - m_new)
        tl.store(o_ptr + b * stride_ob + h * stride_oh + d, (acc / l_i).to(o_ptr.dtype.element_ty), mask=dm)

    @triton.jit
    def _mla_decode_kernel(qa_ptr, qr_ptr, c_ptr, r_ptr, bt_ptr, len_ptr, o_ptr, scale,
                           stride_qab, stride_qah, stride_qrb, stride_qrh, stride_cb, stride_ct, stride_rb, stride_rt,
                           stride_btb, stride_ob, stride_oh,
                           C: tl.constexpr, BC: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(len_ptr + b)
        c = tl.arange(0, BC)
        cm = c < C
        r = tl.arange(0, BR)
        rm = r < R
        qa = tl.load(qa_ptr + b * stride_qab + h * stride_qah + c, mask=cm, other=0.0).to(tl.float32)
        qr = tl.load(qr_ptr + b * stride_qrb + h * stride_qrh + r, mask=rm, other=0.0).to(tl.float32)
        t = tl.arange(0, BS)
        m_i = -float("inf")
        l_i = 0.0
        acc = tl.zeros([BC], dtype=tl.float32)
        for blk in range(0, tl.cdiv(n, BS)):
            bid = tl.load(bt_ptr + b * stride_btb + blk).to(tl.int64)
            ok = blk * BS + t < n
            ck = tl.load(c_ptr + bid * stride_cb + t[:, None] * stride_ct + c[None, :],
                         mask=ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
            kr = tl.load(r_ptr + bid * stride_rb + t[:, None] * stride_rt + r[None, :],
                         mask=ok[:, None] & rm[None, :], other=0.0).to(tl.float32)
            s = (tl.sum(ck * qa[None, :], axis=1) + tl.sum(kr * qr[None, :], axis=1)) * scale
            s = tl.where(ok, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            acc = acc * alpha + tl.sum(p[:, None] * ck, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        tl.store(o_ptr + b * stride_ob + h * stride_oh + c, (acc / l_i).to(o_ptr.dtype.element_ty), mask=cm)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def paged_decode_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                     window: int | None = None) -> torch.Tensor:
    """Triton: q [B, h, d] (one token per sequence, at position seq_lens-1) -> [B, h, d]."""
    B, h, d = q.shape
    NB, bs, kvh, dk = k_cache.shape
    assert dk == d and h % kvh == 0 and bs & (bs - 1) == 0, "block_size must be a power of two"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    o = torch.empty_like(q)
    bt = block_tables.contiguous()
    _gqa_decode_kernel[(B, h)](q, k_cache, v_cache, bt, seq_lens.to(torch.int32).contiguous(),
                               sinks if sinks is not None else q, o, float(scale),
                               q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                               bt.stride(0), o.stride(0), o.stride(1), int(window or 0),
                               G=h // kvh, D=d, BD=_pow2(d), BS=bs, HAS_SINK=sinks is not None)
    return o


def paged_decode_mla(q_abs: torch.Tensor, q_rot: torch.Tensor, ckv_cache: torch.Tensor, krot_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton: q_abs [B, h, c], q_rot [B, h, r] -> o_lat [B, h, c]."""
    B, h, C = q_abs.shape
    R = q_rot.shape[-1]
    bs = ckv_cache.shape[1]
    assert bs & (bs - 1) == 0, "block_size must be a power of two"
    assert ckv_cache.stride(-1) == 1 and krot_cache.stride(-1) == 1 and q_abs.stride(-1) == 1 and q_rot.stride(-1) == 1
    o = torch.empty_like(q_abs)
    bt = block_tables.contiguous()
    _mla_decode_kernel[(B, h)](q_abs, q_rot, ckv_cache, krot_cache, bt, seq_lens.to(torch.int32).contiguous(), o,
                               float(scale), q_abs.stride(0), q_abs.stride(1), q_rot.stride(0), q_rot.stride(1),
                               ckv_cache.stride(0), ckv_cache.stride(1), krot_cache.stride(0), krot_cache.stride(1),
                               bt.stride(0), o.stride(0), o.stride(1), C=C, BC=_pow2(C), R=R, BR=_pow2(R), BS=bs)
    return o
