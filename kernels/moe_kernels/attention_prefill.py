"""Prefill / extend attention over the paged KV cache (Triton): any number of query tokens per sequence,
causal, over a cached prefix (chunked prefill, prefix-cache hits), with the padded batch layout the
runtime uses: q [B, S, h, d], positions [B, S] (each row's token positions, right-padded with later
positions), `kv_len` keys visible at most. Key j is visible to the query at position p when j <= p,
j < kv_len (and p - j < window). This is the torch reference's rule (paged_attention.visible).

A program covers T query tokens x HB query heads of one sequence, packed as T*HB rows of one MMA:
- GQA: the HB heads share one KV head (a row's head is kv_head * G + index), so K/V tiles are loaded
  once for all of them; attention sinks join the denominator at the end; a window layer starts at the
  window of the tile's first token.
- MLA (absorbed form, DeepSeek-V3): all heads share the latent cache (K = V = c_kv), scores are
  q_abs.c_kv + q_rot.k_rot, the output is the latent o_lat.
- MLA non-absorbed (`prefill_mla_mha`, fewer FLOPs from ~171 query tokens): the latent prefix is
  decompressed once through W_uk / W_uv into per-head K and V, then the same kernel runs one head per
  program (192-wide scores, 128-wide values), as the engines do for prefill.
The key loop stops at the tile's largest position, so a causal tile reads only its own prefix.
Fully masked rows (a padded token) give 0, never NaN. FP8 caches are read through a per-tensor scale
(k_scale folded into the score scale, v_scale into the output), converted to q's dtype for the dot.
"""

from __future__ import annotations

import torch

from moe_kernels import attention_decode as _ad
from moe_kernels.attention_decode import LOG2E, _pow2, triton
from moe_kernels.paged_kv import _dequant, gather_kv

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gqa_prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, sink_ptr, o_ptr, qk_scale, v_scale, S, KVH,
                            kv_len, window, s_qb, s_qs, s_qh, s_kb, s_kt, s_kh, s_btb, s_pb, s_ob, s_os, s_oh,
                            G: tl.constexpr, T: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                            BS: tl.constexpr, BN: tl.constexpr, HAS_SINK: tl.constexpr, PREC: tl.constexpr,
                            F16: tl.constexpr):
        tb = tl.num_programs(0) - 1 - tl.program_id(0)  # the last tokens (most keys) start first
        hb = tl.program_id(1)
        bk = tl.program_id(2)
        b = bk // KVH
        kvh = bk % KVH
        r = tl.arange(0, T * HB)
        tok = tb * T + r % T
        gi = hb * HB + r // T
        rm = (tok < S) & (gi < G)
        h = kvh * G + gi
        pos = tl.load(pos_ptr + b * s_pb + tok, mask=rm, other=-1).to(tl.int32)
        hi = tl.minimum(tl.max(pos, axis=0) + 1, kv_len)
        lo = 0
        if window > 0:
            lo = tl.maximum(tl.min(tl.where(rm, pos, 2147483647), axis=0) - window + 1, 0)
        d = tl.arange(0, BD)
        dm = d < D
        q = tl.load(q_ptr + b * s_qb + tok[:, None] * s_qs + h[:, None] * s_qh + d[None, :],
                    mask=rm[:, None] & dm[None, :], other=0.0)
        if F16:  # an fp8 cache: fp16 dots
            q = q.to(tl.float16)
        m_i = tl.full([T * HB], -float("inf"), tl.float32)
        l_i = tl.zeros([T * HB], tl.float32)
        acc = tl.zeros([T * HB, BD], tl.float32)
        t = tl.arange(0, BN)
        for s0 in range(lo, hi, BN):
            j = s0 + t
            ok = j < hi
            page = tl.load(bt_ptr + b * s_btb + j // BS, mask=ok, other=0).to(tl.int64)
            off = page[:, None] * s_kb + (j % BS)[:, None] * s_kt + kvh * s_kh + d[None, :]
            km = ok[:, None] & dm[None, :]
            k = tl.load(k_ptr + off, mask=km, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + off, mask=km, other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            vis = ok[None, :] & (j[None, :] <= pos[:, None])
            if window > 0:
                vis = vis & (j[None, :] > pos[:, None] - window)
            s = tl.where(vis, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None], input_precision=PREC)
            m_i = m_new
        if HAS_SINK:  # the sink logit joins the denominator only
            sk = tl.load(sink_ptr + h, mask=rm, other=0.0).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m_i, sk)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sk - m_new)
        out = acc * (v_scale / tl.maximum(l_i, 1e-30))[:, None]
        tl.store(o_ptr + b * s_ob + tok[:, None] * s_os + h[:, None] * s_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])

    @triton.jit
    def _mla_prefill_kernel(qa_ptr, qr_ptr, ka_ptr, kr_ptr, v_ptr, bt_ptr, pos_ptr, o_ptr, qk_scale, v_scale, S, H,
                            kv_len, s_qab, s_qas, s_qah, s_qrb, s_qrs, s_qrh, s_kb, s_kt, s_kh, s_rb, s_rt,
                            s_vb, s_vt, s_vh, s_btb, s_pb, s_ob, s_os, s_oh, C: tl.constexpr, CV: tl.constexpr,
                            R: tl.constexpr, BR: tl.constexpr, T: tl.constexpr, HB: tl.constexpr,
                            BS: tl.constexpr, BN: tl.constexpr, V_IS_K: tl.constexpr, PREC: tl.constexpr,
                            F16: tl.constexpr):
        # absorbed: K = V = the latent (head strides 0, HB heads share the tile); non-absorbed: one head
        # per program (HB = 1) with its own decompressed K [.., C] and V [.., CV]; k_rot is shared.
        tb = tl.num_programs(0) - 1 - tl.program_id(0)  # the last tokens (most keys) start first
        hb = tl.program_id(1)
        b = tl.program_id(2)
        rr = tl.arange(0, T * HB)
        tok = tb * T + rr % T
        h = hb * HB + rr // T
        rm = (tok < S) & (h < H)
        pos = tl.load(pos_ptr + b * s_pb + tok, mask=rm, other=-1).to(tl.int32)
        hi = tl.minimum(tl.max(pos, axis=0) + 1, kv_len)
        c = tl.arange(0, C)
        cv = tl.arange(0, CV)
        r = tl.arange(0, BR)
        rmask = r < R
        qa = tl.load(qa_ptr + b * s_qab + tok[:, None] * s_qas + h[:, None] * s_qah + c[None, :],
                     mask=rm[:, None], other=0.0)
        qr = tl.load(qr_ptr + b * s_qrb + tok[:, None] * s_qrs + h[:, None] * s_qrh + r[None, :],
                     mask=rm[:, None] & rmask[None, :], other=0.0)
        if F16:
            qa = qa.to(tl.float16)
            qr = qr.to(tl.float16)
        m_i = tl.full([T * HB], -float("inf"), tl.float32)
        l_i = tl.zeros([T * HB], tl.float32)
        acc = tl.zeros([T * HB, CV], tl.float32)
        t = tl.arange(0, BN)
        hk = (hb * HB).to(tl.int64)  # the program's K/V head (all rows' head when HB = 1; strides 0 when shared)
        for s0 in range(0, hi, BN):
            j = s0 + t
            ok = j < hi
            page = tl.load(bt_ptr + b * s_btb + j // BS, mask=ok, other=0).to(tl.int64)
            row = j % BS
            ck = tl.load(ka_ptr + page[:, None] * s_kb + row[:, None] * s_kt + hk * s_kh + c[None, :],
                         mask=ok[:, None], other=0.0).to(qa.dtype)
            kr = tl.load(kr_ptr + page[:, None] * s_rb + row[:, None] * s_rt + r[None, :],
                         mask=ok[:, None] & rmask[None, :], other=0.0).to(qa.dtype)
            if V_IS_K:
                vt = ck
            else:
                vt = tl.load(v_ptr + page[:, None] * s_vb + row[:, None] * s_vt + hk * s_vh + cv[None, :],
                             mask=ok[:, None], other=0.0).to(qa.dtype)
            s = tl.dot(qa, tl.trans(ck), input_precision=PREC)
            s = tl.dot(qr, tl.trans(kr), s, input_precision=PREC) * qk_scale
            s = tl.where(ok[None, :] & (j[None, :] <= pos[:, None]), s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(qa.dtype), vt, acc * alpha[:, None], input_precision=PREC)
            m_i = m_new
        out = acc * (v_scale / tl.maximum(l_i, 1e-30))[:, None]
        tl.store(o_ptr + b * s_ob + tok[:, None] * s_os + h[:, None] * s_oh + cv[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=rm[:, None])


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 queries keep fp32 dots; bf16 dots ignore it


def gqa_prefill_config(group: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """(tokens per program T, heads per program HB, keys per tile, warps, stages): 128 rows of the MMA,
    all G heads of the KV head when G <= 16 (their K/V tiles loaded once). Keys per tile, warps and
    stages: the best of bench_attention.py --sweep-prefill on one H200 (2026-12-02) at 1 x 8k and
    4 x 512 over a 4k prefix: 128 keys, 4 warps, 3 stages at head dim 64 (2.53 ms vs 3.28 ms with
    64 keys, 2 stages); 32 keys, 4 warps, 3 stages at head dim 128 (1.95 ms vs 2.39 ms)."""
    hb = min(_pow2(group), 16)
    return max(1, 128 // hb), hb, (128 if head_dim <= 64 else 32), 4, 3


def mla_prefill_config(heads: int) -> tuple[int, int, int, int, int]:
    """(T, HB, keys per tile, warps, stages) for the absorbed MLA prefill: 64 rows (4 tokens x 16
    heads) against a [64, 512] latent tile (the same sweep: 39.4 ms vs 52.5 ms with 32 keys at
    128 heads, 1 x 8k); the fp32 [64, 512] accumulator is the decode kernel's."""
    hb = min(_pow2(heads), 16)
    return max(1, 64 // hb), hb, 64, 8, 2


MHA_CONFIG = (128, 64, 8, 3)  # (T, keys per tile, warps, stages) of the non-absorbed MLA: the same sweep, 9.9 vs 10.7 ms


def _check_rows(q: torch.Tensor, positions: torch.Tensor, name: str) -> None:
    if positions.shape != q.shape[:2]:
        raise ValueError(f"{name}: positions {tuple(positions.shape)} must be q's [B, S] {tuple(q.shape[:2])}")


def prefill_gqa(q, k_cache, v_cache, block_tables, positions, kv_len: int, scale: float, sinks=None, window=None,
                k_scale: float = 1.0, v_scale: float = 1.0, config=None):
    """q [B, S, h, d] -> [B, S, h, d]: the Triton form of paged_attention_gqa_ref."""
    B, S, H, d = q.shape
    NB, bs, kvh, dk = k_cache.shape
    _check_rows(q, positions, "prefill_gqa")
    if dk != d or H % kvh or bs & (bs - 1):
        raise ValueError(f"prefill_gqa: q heads {H} x {d} vs cache kv heads {kvh} x {dk}, block size {bs} "
                         "(heads must divide, dims match, block size a power of two)")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("prefill_gqa: k/v caches must share strides, last dims contiguous")
    if kv_len > block_tables.shape[1] * bs:
        raise ValueError(f"prefill_gqa: kv_len {kv_len} exceeds the block tables ({block_tables.shape[1]} x {bs})")
    G = H // kvh
    T, HB, bn, warps, stages = config or gqa_prefill_config(G, d)
    if config is None and k_cache.element_size() == 4:
        bn = max(16, bn // 2)  # fp32: the same shared-memory bytes as bf16
    bt = block_tables.contiguous()
    pos = positions.contiguous()
    o = torch.empty_like(q)
    grid = (triton.cdiv(S, T), triton.cdiv(G, HB), B * kvh)
    _gqa_prefill_kernel[grid](
        q, k_cache, v_cache, bt, pos, sinks if sinks is not None else q, o, float(scale) * float(k_scale) * LOG2E,
        float(v_scale), S, kvh, int(kv_len), int(window or 0), q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0), pos.stride(0),
        o.stride(0), o.stride(1), o.stride(2), G=G, T=T, HB=HB, D=d, BD=max(16, _pow2(d)), BS=bs, BN=bn,
        HAS_SINK=sinks is not None, PREC=_prec(q.dtype), F16=_ad.f16_dots(k_cache), num_warps=warps, num_stages=stages)
    return o


def prefill_mla(q_abs, q_rot, ckv_cache, krot_cache, block_tables, positions, kv_len: int, scale: float,
                kv_scale: float = 1.0, config=None):
    """q_abs [B, S, h, c], q_rot [B, S, h, r] -> o_lat [B, S, h, c]: the Triton form of paged_attention_mla_ref."""
    B, S, H, C = q_abs.shape
    R = q_rot.shape[-1]
    bs = ckv_cache.shape[1]
    _check_rows(q_abs, positions, "prefill_mla")
    if bs & (bs - 1) or C & (C - 1) or C < 16:
        raise ValueError(f"prefill_mla: block size ({bs}) and latent width ({C}) must be powers of two, latent >= 16")
    for name, x in (("q_abs", q_abs), ("q_rot", q_rot), ("ckv_cache", ckv_cache), ("krot_cache", krot_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"prefill_mla: {name} must be contiguous in its last dim")
    if kv_len > block_tables.shape[1] * bs:
        raise ValueError(f"prefill_mla: kv_len {kv_len} exceeds the block tables ({block_tables.shape[1]} x {bs})")
    T, HB, bn, warps, stages = config or mla_prefill_config(H)
    if config is None and q_abs.element_size() == 4:
        # fp32: the latent tile and the [64, 512] q tile both double (64 keys: ~256 KiB of the H200's
        # 227); 16-key tiles passed on the H200 (2026-12-02, first run)
        bn = max(16, bn // 4)
    bt = block_tables.contiguous()
    pos = positions.contiguous()
    o = torch.empty_like(q_abs)
    grid = (triton.cdiv(S, T), triton.cdiv(H, HB), B)
    _mla_prefill_kernel[grid](
        q_abs, q_rot, ckv_cache, krot_cache, ckv_cache, bt, pos, o, float(scale) * float(kv_scale) * LOG2E,
        float(kv_scale), S, H, int(kv_len), q_abs.stride(0), q_abs.stride(1), q_abs.stride(2), q_rot.stride(0),
        q_rot.stride(1), q_rot.stride(2), ckv_cache.stride(0), ckv_cache.stride(1), 0, krot_cache.stride(0),
        krot_cache.stride(1), ckv_cache.stride(0), ckv_cache.stride(1), 0, bt.stride(0), pos.stride(0),
        o.stride(0), o.stride(1), o.stride(2), C=C, CV=C, R=R, BR=max(16, _pow2(R)), T=T, HB=HB, BS=bs, BN=bn,
        V_IS_K=True, PREC=_prec(q_abs.dtype), F16=_ad.f16_dots(ckv_cache), num_warps=warps, num_stages=stages)
    return o


def mla_mha_flops_cheaper(q_tokens: int, heads: int, kv_lora: int, nope: int, rope: int, v_dim: int) -> bool:
    """Whether the non-absorbed (decompress, then multi-head attention) MLA prefill needs fewer FLOPs per
    key than the absorbed form: per key, absorbed = S*h*2*(2*kv_lora + rope); non-absorbed =
    S*h*2*(nope + rope + v) + h*2*kv_lora*(nope + v) (the decompression, once per key). DeepSeek-V3
    (512 / 128 / 64 / 128): from about 171 query tokens, as the engines switch for prefill."""
    absorbed = q_tokens * heads * 2 * (2 * kv_lora + rope)
    mha = q_tokens * heads * 2 * (nope + rope + v_dim) + heads * 2 * kv_lora * (nope + v_dim)
    return mha < absorbed


MHA_MIN_FLOPS = 2e11  # absorbed FLOPs below which the decompression's fixed cost (~0.2-0.5 ms on one H200) loses


def mla_prefill_form(batch: int, q_tokens: int, kv_len: int, heads: int, kv_lora: int, nope: int, rope: int,
                     v_dim: int) -> str:
    """"mha" (non-absorbed) or "absorbed" for one MLA prefill call: mha where it needs fewer FLOPs per
    key and the call is big enough to pay for the decompression (bench_attention.py --prefill,
    2026-12-02: at 16 heads, 1 x 1024 new tokens absorbed took 109 us against 723 us; 8 x 1024 746
    against 646 us; 1 x 2048 over 6k cached 2.2 ms against 0.74 ms)."""
    absorbed = batch * q_tokens * kv_len * heads * 2 * (2 * kv_lora + rope)
    if absorbed >= MHA_MIN_FLOPS and mla_mha_flops_cheaper(q_tokens, heads, kv_lora, nope, rope, v_dim):
        return "mha"
    return "absorbed"


MHA_BLOCK = 16  # the decompressed K/V's page size: a plain [B, L] layout read through an identity table


def mla_decompress(ckv_cache, krot_cache, w_uk, w_uv, block_tables, kv_len: int, dt: torch.dtype,
                   kv_scale: float = 1.0):
    """The latent prefix of every row, gathered once and decompressed: K [B*nb, 16, h, nope],
    V [B*nb, 16, h, v], k_rot [B*nb, 16, r] (zero-padded to whole blocks), and their identity table [B, nb]."""
    B, H, D, V = block_tables.shape[0], w_uk.shape[0], w_uk.shape[1], w_uv.shape[1]
    nb = triton.cdiv(kv_len, MHA_BLOCK)
    pad = nb * MHA_BLOCK - kv_len
    lat = torch.nn.functional.pad(_dequant(gather_kv(ckv_cache, block_tables, kv_len), dt, kv_scale), (0, 0, 0, pad))
    kr = torch.nn.functional.pad(_dequant(gather_kv(krot_cache, block_tables, kv_len), dt, kv_scale), (0, 0, 0, pad))
    k = torch.einsum("blc,hdc->blhd", lat, w_uk.to(dt)).reshape(B * nb, MHA_BLOCK, H, D)
    v = torch.einsum("blc,hvc->blhv", lat, w_uv.to(dt)).reshape(B * nb, MHA_BLOCK, H, V)
    kr = kr.reshape(B * nb, MHA_BLOCK, kr.shape[-1]).contiguous()
    bt = torch.arange(B * nb, device=lat.device, dtype=torch.int32).view(B, nb)
    return k, v, kr, bt


def prefill_mla_mha(q_nope, q_rot, ckv_cache, krot_cache, w_uk, w_uv, block_tables, positions, kv_len: int,
                    scale: float, kv_scale: float = 1.0, config=None):
    """Non-absorbed MLA prefill: q_nope [B, S, h, nope], q_rot [B, S, h, r], w_uk [h, nope, c],
    w_uv [h, v, c] -> o [B, S, h, v] (the attention output before o_proj). The latent prefix is gathered
    once and decompressed to per-head K [B, L, h, nope] and V [B, L, h, v] (torch matmuls), then one
    program per (T tokens, head) attends with scores q_nope.k + q_rot.k_rot (k_rot shared by heads)."""
    B, S, H, D = q_nope.shape
    R = q_rot.shape[-1]
    V = w_uv.shape[1]
    _check_rows(q_nope, positions, "prefill_mla_mha")
    if D & (D - 1) or V & (V - 1) or w_uk.shape != (H, D, ckv_cache.shape[-1]) or w_uv.shape[::2] != (H, ckv_cache.shape[-1]):
        raise ValueError(f"prefill_mla_mha: nope {D} and v {V} must be powers of two, w_uk {tuple(w_uk.shape)} "
                         f"[h, nope, c] and w_uv {tuple(w_uv.shape)} [h, v, c] must match q's {H} heads and the cache")
    if kv_len > block_tables.shape[1] * ckv_cache.shape[1]:
        raise ValueError(f"prefill_mla_mha: kv_len {kv_len} exceeds the block tables")
    k, v, kr, bt = mla_decompress(ckv_cache, krot_cache, w_uk, w_uv, block_tables, kv_len, q_nope.dtype, kv_scale)
    dt = q_nope.dtype
    T, bn, warps, stages = config or MHA_CONFIG
    if q_nope.stride(-1) != 1 or q_rot.stride(-1) != 1:
        raise ValueError("prefill_mla_mha: q_nope and q_rot must be contiguous in their last dim")
    pos = positions.contiguous()
    o = torch.empty(B, S, H, V, device=q_nope.device, dtype=dt)
    _mla_prefill_kernel[(triton.cdiv(S, T), H, B)](
        q_nope, q_rot, k, kr, v, bt, pos, o, float(scale) * LOG2E, 1.0, S, H, int(kv_len),
        q_nope.stride(0), q_nope.stride(1), q_nope.stride(2), q_rot.stride(0), q_rot.stride(1), q_rot.stride(2),
        k.stride(0), k.stride(1), k.stride(2), kr.stride(0), kr.stride(1), v.stride(0), v.stride(1), v.stride(2),
        bt.stride(0), pos.stride(0), o.stride(0), o.stride(1), o.stride(2), C=D, CV=V, R=R, BR=max(16, _pow2(R)),
        T=T, HB=1, BS=MHA_BLOCK, BN=bn, V_IS_K=False, PREC=_prec(dt), F16=False, num_warps=warps, num_stages=stages)
    return o
