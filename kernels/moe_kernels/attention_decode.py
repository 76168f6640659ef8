"""Split-KV (flash-decoding) Triton decode kernels over the paged KV cache, one query token per sequence.

- MLA (DeepSeek-V3 absorbed form): a program covers BH heads of one sequence and one context slice;
  the latent tile [BN, C] is loaded once and shared by its heads; scores (q_abs.c_kv + q_rot.k_rot)
  and P.V run on tensor cores (`tl.dot`), fp32 online softmax in base 2.
- GQA: a program covers the G query heads of one KV head (G padded to 16 rows for the MMA) and one
  context slice; attention sinks are added in the reduce; a sliding-window layer reads only its window.

Each program writes its slice's normalised partial output and log-sum-exp; a reduce kernel merges the
slices (and adds the sink). With one slice the decode kernel writes the final output itself. The
number of slices is `num_splits` (a pure function of batch, context capacity, programs per slice and
SM count): it is taken from host-known sizes (the block table's width), never from the device lengths,
so the launch is the same in every CUDA-graph replay.

An FP8 (e4m3) cache is read through per-tensor scales: the key scale folds into the score scale, the
value scale into the output; the dots run in fp16 (q converted once; e4m3 is exact in fp16, and its
conversion to fp16 is one instruction where bf16 takes three).
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634


def num_splits(batch: int, ctx: int, programs: int, sm_count: int, tile: int, max_splits: int = 64,
               min_tiles: int = 2) -> int:
    """Context slices per sequence: enough programs for about two waves over the SMs, each slice at
    least `min_tiles` tiles of `tile` tokens. `programs` = programs per (sequence, slice)."""
    if batch < 1 or ctx < 1 or programs < 1 or sm_count < 1 or tile < 1:
        raise ValueError(f"num_splits: sizes must be positive, got batch={batch} ctx={ctx} programs={programs} "
                         f"sm_count={sm_count} tile={tile}")
    base = batch * programs
    want = -(-2 * sm_count // base)
    return max(1, min(want, math.ceil(ctx / tile) // min_tiles, max_splits))


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference serves
    triton = None

if triton is not None:
    @triton.jit
    def _mla_split_kernel(qa_ptr, qr_ptr, c_ptr, r_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, qk_scale, v_scale, H,
                          s_qab, s_qah, s_qrb, s_qrh, s_cb, s_ct, s_rb, s_rt, s_btb, s_ob, s_oh, s_os,
                          C: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr,
                          BH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr,
                          F16: tl.constexpr):
        hb = tl.program_id(0)  # fastest: the head blocks of one slice run together and share the tile in L2
        sp = tl.program_id(1)
        b = tl.program_id(2)
        n = tl.load(len_ptr + b)
        chunk = tl.cdiv(tl.cdiv(n, SPLITS), BN) * BN
        start = sp * chunk
        end = tl.minimum(start + chunk, n)
        h = hb * BH + tl.arange(0, BH)
        hm = h < H
        c = tl.arange(0, C)
        r = tl.arange(0, BR)
        rm = r < R
        qa = tl.load(qa_ptr + b * s_qab + h[:, None] * s_qah + c[None, :], mask=hm[:, None], other=0.0)
        qr = tl.load(qr_ptr + b * s_qrb + h[:, None] * s_qrh + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)
        if F16:  # an fp8 cache: fp16 dots (e4m3 -> fp16 is one conversion, -> bf16 is three)
            qa = qa.to(tl.float16)
            qr = qr.to(tl.float16)
        m_i = tl.full([BH], -float("inf"), tl.float32)
        l_i = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, C], tl.float32)
        t = tl.arange(0, BN)
        for s0 in range(start, end, BN):
            tok = s0 + t
            ok = tok < end
            page = tl.load(bt_ptr + b * s_btb + tok // BS, mask=ok, other=0).to(tl.int64)
            row = tok % BS
            ck = tl.load(c_ptr + page[:, None] * s_cb + row[:, None] * s_ct + c[None, :], mask=ok[:, None],
                         other=0.0).to(qa.dtype)  # an fp8 cache: converted for the dot, its scale applied outside
            kr = tl.load(r_ptr + page[:, None] * s_rb + row[:, None] * s_rt + r[None, :],
                         mask=ok[:, None] & rm[None, :], other=0.0).to(qa.dtype)
            s = tl.dot(qa, tl.trans(ck), input_precision=PREC)
            s = tl.dot(qr, tl.trans(kr), s, input_precision=PREC) * qk_scale
            s = tl.where(ok[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(ck.dtype), ck, acc * alpha[:, None], input_precision=PREC)
            m_i = m_new
        out = acc * (v_scale / tl.maximum(l_i, 1e-30))[:, None]
        if SPLITS == 1:
            tl.store(o_ptr + b * s_ob + h[:, None] * s_oh + c[None, :], out.to(o_ptr.dtype.element_ty), mask=hm[:, None])
        else:
            tl.store(o_ptr + b * s_ob + h[:, None] * s_oh + sp * s_os + c[None, :], out, mask=hm[:, None])
            tl.store(lse_ptr + (b * H + h) * SPLITS + sp, m_i + tl.log2(l_i), mask=hm)

    @triton.jit
    def _gqa_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, sink_ptr, o_ptr, lse_ptr, qk_scale, v_scale, H, window,
                          s_qb, s_qh, s_kb, s_kt, s_kh, s_btb, s_ob, s_oh, s_os,
                          G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
                          BN: tl.constexpr, SPLITS: tl.constexpr, HAS_SINK: tl.constexpr, PREC: tl.constexpr,
                          F16: tl.constexpr):
        kvh = tl.program_id(0)
        sp = tl.program_id(1)
        b = tl.program_id(2)
        n = tl.load(len_ptr + b)
        lo = 0
        if window > 0:
            lo = tl.maximum(n - window, 0)
        chunk = tl.cdiv(tl.cdiv(n - lo, SPLITS), BN) * BN
        start = lo + sp * chunk
        end = tl.minimum(start + chunk, n)
        g = tl.arange(0, GP)
        gm = g < G
        h = kvh * G + g
        d = tl.arange(0, BD)
        dm = d < D
        q = tl.load(q_ptr + b * s_qb + h[:, None] * s_qh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        if F16:
            q = q.to(tl.float16)
        m_i = tl.full([GP], -float("inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BD], tl.float32)
        t = tl.arange(0, BN)
        for s0 in range(start, end, BN):
            tok = s0 + t
            ok = tok < end
            page = tl.load(bt_ptr + b * s_btb + tok // BS, mask=ok, other=0).to(tl.int64)
            off = page[:, None] * s_kb + (tok % BS)[:, None] * s_kt + kvh * s_kh + d[None, :]
            km = ok[:, None] & dm[None, :]
            k = tl.load(k_ptr + off, mask=km, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + off, mask=km, other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            s = tl.where(ok[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
            m_i = m_new
        if SPLITS == 1:
            if HAS_SINK:  # the sink logit joins the denominator only
                sk = tl.load(sink_ptr + h, mask=gm, other=0.0).to(tl.float32) * 1.4426950408889634
                m_new = tl.maximum(m_i, sk)
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha + tl.exp2(sk - m_new)
            out = acc * (v_scale / tl.maximum(l_i, 1e-30))[:, None]
            tl.store(o_ptr + b * s_ob + h[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=gm[:, None] & dm[None, :])
        else:
            out = acc * (v_scale / tl.maximum(l_i, 1e-30))[:, None]
            tl.store(o_ptr + b * s_ob + h[:, None] * s_oh + sp * s_os + d[None, :], out, mask=gm[:, None] & dm[None, :])
            tl.store(lse_ptr + (b * H + h) * SPLITS + sp, m_i + tl.log2(l_i), mask=gm)

    @triton.jit
    def _reduce_kernel(part_ptr, lse_ptr, sink_ptr, o_ptr, H, s_pb, s_ph, s_ps, s_ob, s_oh,
                       D: tl.constexpr, BD: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
                       HAS_SINK: tl.constexpr):
        h = tl.program_id(0)
        b = tl.program_id(1)
        s = tl.arange(0, SP)
        sm = s < SPLITS
        d = tl.arange(0, BD)
        dm = d < D
        lse = tl.load(lse_ptr + (b * H + h) * SPLITS + s, mask=sm, other=-float("inf"))
        mx = tl.max(lse, axis=0)
        if HAS_SINK:
            sk = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
            mx = tl.maximum(mx, sk)
        w = tl.exp2(lse - mx)
        den = tl.sum(w, axis=0)
        if HAS_SINK:
            den += tl.exp2(sk - mx)
        part = tl.load(part_ptr + b * s_pb + h * s_ph + s[:, None] * s_ps + d[None, :], mask=sm[:, None] & dm[None, :],
                       other=0.0)
        out = tl.sum(part * w[:, None], axis=0) / den
        tl.store(o_ptr + b * s_ob + h * s_oh + d, out.to(o_ptr.dtype.element_ty), mask=dm)

_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs are enough to exercise split-KV
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


FP8_DOT_F16 = True  # bench_attention.py --sweep-fp8 times both: False converts fp8 tiles to q's dtype


def f16_dots(cache: torch.Tensor) -> bool:
    """Whether the kernels run their dots in fp16: for an fp8 (e4m3) cache, whose values fp16 holds exactly."""
    return FP8_DOT_F16 and cache.dtype == torch.float8_e4m3fn


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 queries keep fp32 dots; bf16 dots ignore it


def mla_config(heads: int, cache_bytes: int = 2) -> tuple[int, int, int, int]:
    """(heads per program, tokens per tile, warps, stages) for the MLA decode kernel: the best of
    bench_attention.py --sweep on one H200 (2026-12-01) for bf16 caches: 64 heads x 64 tokens at 128
    heads (3.07x vs 4.40x at 32 tokens), 16 x 128 at 16 heads (1.65x vs 2.15x). A 4-byte (fp32)
    cache gets half the tokens per tile, the same shared-memory bytes (64 x 64 x fp32 needs 304 KiB
    of the H200's 227)."""
    bh = min(64, max(16, _pow2(heads)))
    bn = 128 if bh <= 16 else 64
    return bh, max(16, bn * 2 // max(cache_bytes, 2)), 8, 2


def gqa_config(group: int, head_dim: int, cache_bytes: int = 2) -> tuple[int, int, int]:
    """(tokens per tile, warps, stages) for the GQA decode kernel (the same sweep: 128-token tiles at
    head dim 64, 1.03x vs 1.12x at 64; 64 at head dim 128, 1.02x). An fp8 cache takes 128-token tiles
    at head dim 128 too (--sweep-fp8, 2026-12-02: 252 us vs 311 us at 64 x 8k, 23.6 vs 27.0 at 1 x 32k)."""
    return (128 if head_dim <= 64 or cache_bytes == 1 else 64), 4, 3


def _reduce(part, lse, sinks, o, splits):
    B, H, _, D = part.shape
    _reduce_kernel[(H, B)](part, lse, sinks if sinks is not None else lse, o, H, part.stride(0), part.stride(1),
                           part.stride(2), o.stride(0), o.stride(1), D=D, BD=_pow2(D), SPLITS=splits,
                           SP=max(2, _pow2(splits)), HAS_SINK=sinks is not None)


def decode_mla(q_abs, q_rot, ckv_cache, krot_cache, block_tables, seq_lens, scale, num_splits_: int | None = None,
               config: tuple[int, int, int, int] | None = None, kv_scale: float = 1.0):
    B, H, C = q_abs.shape
    R = q_rot.shape[-1]
    bs = ckv_cache.shape[1]
    if bs & (bs - 1) or C & (C - 1) or C < 16:
        raise ValueError(f"paged_decode_mla: block size ({bs}) and latent width ({C}) must be powers of two, latent >= 16")
    for name, x in (("q_abs", q_abs), ("q_rot", q_rot), ("ckv_cache", ckv_cache), ("krot_cache", krot_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"paged_decode_mla: {name} must be contiguous in its last dim")
    bh, bn, warps, stages = config or mla_config(H, ckv_cache.element_size())
    hblocks = -(-H // bh)
    bt = block_tables.contiguous()
    splits = num_splits_ or num_splits(B, bt.shape[1] * bs, hblocks, _sm_count(q_abs.device), bn)
    o = torch.empty_like(q_abs)
    lens = seq_lens.to(torch.int32).contiguous()
    if splits == 1:
        part, lse, s_p = o, o, (o.stride(0), o.stride(1), 0)
    else:
        part = torch.empty(B, H, splits, C, device=q_abs.device, dtype=torch.float32)
        lse = torch.empty(B, H, splits, device=q_abs.device, dtype=torch.float32)
        s_p = (part.stride(0), part.stride(1), part.stride(2))
    _mla_split_kernel[(hblocks, splits, B)](
        q_abs, q_rot, ckv_cache, krot_cache, bt, lens, part, lse, float(scale) * float(kv_scale) * LOG2E, float(kv_scale), H,
        q_abs.stride(0), q_abs.stride(1), q_rot.stride(0), q_rot.stride(1), ckv_cache.stride(0), ckv_cache.stride(1),
        krot_cache.stride(0), krot_cache.stride(1), bt.stride(0), *s_p,
        C=C, R=R, BR=max(16, _pow2(R)), BS=bs, BH=bh, BN=bn, SPLITS=splits, PREC=_prec(q_abs.dtype), F16=f16_dots(ckv_cache),
        num_warps=warps, num_stages=stages)
    if splits > 1:
        _reduce(part, lse, None, o, splits)
    return o


def decode_gqa(q, k_cache, v_cache, block_tables, seq_lens, scale, sinks=None, window=None,
               num_splits_: int | None = None, config: tuple[int, int, int] | None = None, k_scale: float = 1.0,
               v_scale: float = 1.0):
    B, H, d = q.shape
    NB, bs, kvh, dk = k_cache.shape
    if dk != d or H % kvh or bs & (bs - 1):
        raise ValueError(f"paged_decode_gqa: q heads {H} x {d} vs cache kv heads {kvh} x {dk}, block size {bs} "
                         "(heads must divide, dims match, block size a power of two)")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_decode_gqa: k/v caches must share strides, last dims contiguous")
    G = H // kvh
    bn, warps, stages = config or gqa_config(G, d, k_cache.element_size())
    bt = block_tables.contiguous()
    ctx = bt.shape[1] * bs
    if window:
        ctx = min(ctx, int(window))
    splits = num_splits_ or num_splits(B, ctx, kvh, _sm_count(q.device), bn)
    o = torch.empty_like(q)
    lens = seq_lens.to(torch.int32).contiguous()
    if splits == 1:
        part, lse, s_p = o, o, (o.stride(0), o.stride(1), 0)
    else:
        part = torch.empty(B, H, splits, d, device=q.device, dtype=torch.float32)
        lse = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
        s_p = (part.stride(0), part.stride(1), part.stride(2))
    _gqa_split_kernel[(kvh, splits, B)](
        q, k_cache, v_cache, bt, lens, sinks if sinks is not None else q, part, lse,
        float(scale) * float(k_scale) * LOG2E, float(v_scale), H,
        int(window or 0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        bt.stride(0), *s_p, G=G, GP=max(16, _pow2(G)), D=d, BD=max(16, _pow2(d)), BS=bs, BN=bn, SPLITS=splits,
        HAS_SINK=sinks is not None, PREC=_prec(q.dtype), F16=f16_dots(k_cache), num_warps=warps, num_stages=stages)
    if splits > 1:
        _reduce(part, lse, sinks, o, splits)
    return o
