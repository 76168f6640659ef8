"""Triton MoE experts for SM90 (and any NVIDIA GPU Triton supports): weight-only (W4A16 / W8A16).

Pipeline per forward (4 launches + finalize; no host synchronisation, CUDA-graph capturable):
  align (2 launches, triton_align.py) -> GEMM1 (gathered x @ [gate; up]^T, SiLU(gate)*up fused in the
  epilogue, rows in expert-padded order) -> GEMM2 (act @ w2^T, un-weighted rows = gemm2_out)
  -> finalize (weights, top-k sum, shared add; triton_finalize.py), or hand gemm2_out over (deferred).

Weights are dequantised in registers, tile by tile, to bf16 (exact for FP4: e2m1 * e4m3/e8m0 has at
most 6 significant bits); per-expert factors (NVFP4 global scale, exponent offsets) are applied to
the fp32 accumulator. FP4 with <= FRAG_MAX_ROWS rows per expert (decode to ~2500 tokens of
DeepSeek-V3) runs on the fragment-order kernel of triton_frag.py (its own weight copy, packed in
__init__; 8- or 16-row token blocks, decoded weights as the A operand of mma.sync, no operand staging,
activations read in a coalesced K order). There, one token skips the alignment (pairwise blocks;
GEMM1 and GEMM2 chained with programmatic dependent launch on SM90, pdl.py; GEMM2 does the finalize
itself, the last of each column block's top-k programs summing their rows: two launches), ~8 rows per
expert mix 16-row and 8-row blocks (align_mixed), more rows take 16-row blocks. Above: 128-row bf16
tensor-core tiles (tl.dot) for the rows that fill them, and an expert's remainder of up to 32 rows in
16-row fragment blocks (align_split). Kept selectable by explicit config: the one-row decode loops
(_fp4_fma_loop_pipe: cp.async stages, mma.sync on the decoded tile or CUDA-core FMAs; the older
hand-prefetched _fp4_fma_loop, GemmConfig.pipe=0, whose register prefetch never stayed in flight),
used by default only where the fragment kernel does not apply (pre-SM80, K not a multiple of its
step). History and measurements: bench/README.md.

FP4 storage (re-laid out once in __init__):
- "split-half" packing: byte j of a row holds element j (low nibble) and element K/2 + j (high
  nibble), so one byte tile gives two contiguous K ranges; no nibble interleaving in registers.
- K-tiled: [E, K/2/32, N, 32] bytes, so a block of rows x one 64-weight K step is one contiguous
  read (row-major rows gave 32-byte pieces 3.5 KB apart). Scales: [E, K/2/32, N, 4], per row and K
  tile the scales of its low and its high half in one 4-byte entry (cp.async needs >= 4 bytes).

Decoding without lookup tables (inline PTX, _FP4_ASM): a code c placed as bf16 bits
(c & 8) << 12 | (c & 7) << 6 is exactly value * 2^-126; one bf16x2 FMA by scale * 2^(126-c) gives
the weight, two per instruction. The portable path (CPU interpreter) computes the same products in
fp32 via fp16 bit patterns.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import formats as F
from . import fp4_ptx as ptx
from .experts import ExpertWeights
from .finalize import DeferredMoEOutput, _check as _check_finalize, moe_finalize_fuse_shared
from .reference import _check_inputs
from .pdl import pdl_supported
from .triton_align import TAIL_M, Alignment, align_by_expert, align_mixed, align_split
from .triton_frag import STEP_K, FragWeights, coalesce_activations, frag_asm_args, frag_moe_kernel, grouped_block

FMT_BF16, FMT_FP8, FMT_NVFP4, FMT_MXFP4 = 0, 1, 2, 3
_FMT_ID = {"bf16": FMT_BF16, "fp8": FMT_FP8, "nvfp4": FMT_NVFP4, "mxfp4": FMT_MXFP4}
_GROUP = {FMT_BF16: 1, FMT_FP8: 128, FMT_NVFP4: F.NVFP4_BLOCK, FMT_MXFP4: F.MXFP4_BLOCK}


# ------------------------------------------------------------------------------- decoding
@triton.jit
def _e2m1_times_2pow_m14(code):
    """int32 E2M1 code (0..15) -> fp32 value * 2^-14, exact."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_times_2pow_m8(b):
    """int32 float8_e4m3fn bit pattern (0..255) -> fp32 value * 2^-8, exact (NaN not handled)."""
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp4_group_scale(s, smul, FMT: tl.constexpr):
    """uint8 block scale -> fp32 S = scale * smul, where smul = 2^(126 - c) folds in the 2^126 that the
    in-register E2M1 decode leaves out (c is applied to the accumulator instead; see _prepare)."""
    s = s.to(tl.int32)
    if FMT == 2:  # NVFP4: e4m3
        base = _e4m3_times_2pow_m8(s) * 256.0
    else:  # MXFP4: E8M0, 2^(s-127); s == 0 (2^-127) decodes to 0
        base = (s << 23).to(tl.float32, bitcast=True)
    return base * smul


# E2M1 -> bf16 for four packed bytes at once, two values per 32-bit register: a code c placed as bf16
# bits (c & 8) << 12 | (c & 7) << 6 is exactly value * 2^-126 (e=0 codes are bf16 subnormals, which
# fma.rn.bf16x2 keeps), so one bf16x2 FMA with S = scale * 2^(126-c) gives the exact weight * 2^-c.
# prmt spreads bytes 0,1 (2,3) into the two 16-bit halves; the low nibble needs shifts 6 (exponent and
# mantissa bits) and 12 (sign), the high nibble 2 and 8. About 3 instructions per weight.
_PRMT = ("prmt.b32 t0, {q}, 0, 0x4140;", "prmt.b32 t1, {q}, 0, 0x4342;")   # bytes 0,1 / 2,3 -> halves
_FP4_ASM = tl.constexpr(ptx.block("t0, t1, a, b, z", [p.format(q="$4") for p in _PRMT]
                                  + ptx.pair_shift("$0", "t0", False, "$5") + ptx.pair_shift("$1", "t1", False, "$6")
                                  + ptx.pair_shift("$2", "t0", True, "$7") + ptx.pair_shift("$3", "t1", True, "$8")))


@triton.jit
def _fp4_load(w_base, s_base, kb, HALF, ok, stride_wt, stride_st, BKH: tl.constexpr, GROUP: tl.constexpr):
    """Raw bytes of one split-half FP4 tile in the K-tiled layout (see _prepare): packed
    [BLOCK_N, BKH/GROUP, GROUP] (one contiguous BLOCK_N*BKH-byte block), scales of the low and the
    high half [BLOCK_N, BKH/GROUP] (bytes 0-1 and 2-3 of the row's 4-byte scale entry, see _prepare).
    `ok` masks rows (and, for prefetches past the end, everything)."""
    NG: tl.constexpr = BKH // GROUP
    og = tl.arange(0, NG)[None, :, None]
    oe = tl.arange(0, GROUP)[None, None, :]
    q = tl.load(w_base[:, :, None] + (kb // BKH) * stride_wt + og * GROUP + oe, mask=ok[:, None, None], other=0)
    s_lo = tl.load(s_base + (kb // BKH) * stride_st + tl.arange(0, NG)[None, :], mask=ok[:, None], other=0)
    s_hi = tl.load(s_base + (kb // BKH) * stride_st + 2 + tl.arange(0, NG)[None, :], mask=ok[:, None], other=0)
    return q, s_lo, s_hi


@triton.jit
def _fp4_dequant(q, s_lo, s_hi, smul, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BKH: tl.constexpr,
                 GROUP: tl.constexpr, ASM: tl.constexpr):
    """bf16 (lo, hi) [BLOCK_N, BKH/GROUP, GROUP], each weight * 2^-c (c: per-expert exponent offset,
    applied to the accumulator)."""
    NG: tl.constexpr = BKH // GROUP
    f_lo = _fp4_group_scale(s_lo, smul, FMT)[:, :, None]
    f_hi = _fp4_group_scale(s_hi, smul, FMT)[:, :, None]
    if ASM:
        b_lo = tl.broadcast_to(f_lo.to(tl.bfloat16), (BLOCK_N, NG, GROUP))
        b_hi = tl.broadcast_to(f_hi.to(tl.bfloat16), (BLOCK_N, NG, GROUP))
        lo, hi = tl.inline_asm_elementwise(_FP4_ASM, "=r,=r,=r,=r,r,r,r,r,r", [q, b_lo, b_hi],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:  # portable path (and the CPU interpreter): the same products in fp32
        qi = q.to(tl.int32)
        lo = (_e2m1_times_2pow_m14(qi & 15) * (f_lo * 1.925929944387236e-34)).to(tl.bfloat16)  # * 2^-112
        hi = (_e2m1_times_2pow_m14(qi >> 4) * (f_hi * 1.925929944387236e-34)).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _fp4_dequant2(q, s_lo, s_hi, smul, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BKH: tl.constexpr,
                  GROUP: tl.constexpr, ASM: tl.constexpr):
    lo, hi = _fp4_dequant(q, s_lo, s_hi, smul, FMT, BLOCK_N, BKH, GROUP, ASM)
    return tl.reshape(lo, (BLOCK_N, BKH)), tl.reshape(hi, (BLOCK_N, BKH))


@triton.jit
def _dense_tile(w_base, s_base, k0, n_ok, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """bf16 [BLOCK_N, BLOCK_K] weight tile for bf16 or fp8-block storage (s_base: per-row scale ptrs)."""
    w = tl.load(w_base + k0 + tl.arange(0, BLOCK_K)[None, :], mask=n_ok[:, None], other=0)
    if FMT == 1:
        sc = tl.load(s_base + k0 // 128, mask=n_ok[:, None], other=0.0) * 256.0
        w = (_e4m3_times_2pow_m8(w.to(tl.int32)) * sc).to(tl.bfloat16)
    return w


# The CPU interpreter (TRITON_INTERPRET=1, used to debug without a GPU) multiplies bf16 dot operands
# wrongly (Triton 3.9) and cannot run inline PTX; there the dots run on fp32 copies and the FP4
# decode takes the portable path. Never set on a GPU.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _mma(a, w, acc, SWAP: tl.constexpr, F32: tl.constexpr):
    """acc += a @ w^T ([BM, BN]); SWAP: acc^T += w @ a^T ([BN, BM]) so the dequantised weights are the
    left operand (kept in registers by wgmma) and the few token rows become the MMA's N dimension."""
    if SWAP:
        out = _dot(w, tl.trans(a), acc, F32)
    else:
        out = _dot(a, tl.trans(w), acc, F32)
    return out


@triton.jit
def _accumulate(a_lo, a_hi, lo, hi, acc, SWAP: tl.constexpr, F32: tl.constexpr):
    out = _mma(a_lo, lo, acc, SWAP, F32)
    return _mma(a_hi, hi, out, SWAP, F32)


@triton.jit
def _fp4_fma_loop(a_row_ptr, w_g, s_g, w_u, s_u, HALF, n_ok, offs_n, smul, stride_wt, stride_st, FMT: tl.constexpr,
                  BLOCK_N: tl.constexpr, BKH: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr,
                  GATED: tl.constexpr):
    """One token row times FP4 weight rows, on the CUDA cores: fp32 ([BLOCK_N] gate, [BLOCK_N] up).

    For decode (one row per expert) tensor-core tiles were latency-bound: every K step staged
    operands through shared memory behind barriers and waited for the MMA. Here each thread
    multiplies its own dequantised weights by the matching activations (loaded in the very same
    [BLOCK_N, BKH/GROUP, GROUP] layout, so no layout conversion), accumulates in fp32 registers, and
    the K reduction across threads happens once at the end."""
    NG: tl.constexpr = BKH // GROUP
    kk = (tl.arange(0, NG)[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]) + offs_n[:, None, None] * 0
    acc_g = tl.zeros([BLOCK_N, NG, GROUP], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, NG, GROUP], dtype=tl.float32)
    a_lo = tl.load(a_row_ptr + kk)
    a_hi = tl.load(a_row_ptr + HALF + kk)
    # raw weight bytes three tiles ahead: they are what bounds the decode (bytes in flight per SM),
    # and cost only 16 bytes per thread per tile
    ok1 = n_ok & ((offs_n * 0 + BKH) < HALF)
    ok2 = n_ok & ((offs_n * 0 + 2 * BKH) < HALF)
    qg0, slg0, shg0 = _fp4_load(w_g, s_g, 0, HALF, n_ok, stride_wt, stride_st, BKH, GROUP)
    qg1, slg1, shg1 = _fp4_load(w_g, s_g, BKH, HALF, ok1, stride_wt, stride_st, BKH, GROUP)
    qg2, slg2, shg2 = _fp4_load(w_g, s_g, 2 * BKH, HALF, ok2, stride_wt, stride_st, BKH, GROUP)
    qu0, slu0, shu0, qu1, slu1, shu1, qu2, slu2, shu2 = qg0, slg0, shg0, qg1, slg1, shg1, qg2, slg2, shg2
    if GATED:
        qu0, slu0, shu0 = _fp4_load(w_u, s_u, 0, HALF, n_ok, stride_wt, stride_st, BKH, GROUP)
        qu1, slu1, shu1 = _fp4_load(w_u, s_u, BKH, HALF, ok1, stride_wt, stride_st, BKH, GROUP)
        qu2, slu2, shu2 = _fp4_load(w_u, s_u, 2 * BKH, HALF, ok2, stride_wt, stride_st, BKH, GROUP)
    for kb in range(0, HALF, BKH):
        nxt = kb + BKH
        far = kb + 3 * BKH
        more = (kk + nxt) < HALF
        okf = n_ok & ((offs_n * 0 + far) < HALF)
        a_lo_n = tl.load(a_row_ptr + nxt + kk, mask=more, other=0.0)
        a_hi_n = tl.load(a_row_ptr + HALF + nxt + kk, mask=more, other=0.0)
        qgf, slgf, shgf = _fp4_load(w_g, s_g, far, HALF, okf, stride_wt, stride_st, BKH, GROUP)
        x_lo = a_lo.to(tl.float32)
        x_hi = a_hi.to(tl.float32)
        lo, hi = _fp4_dequant(qg0, slg0, shg0, smul, FMT, BLOCK_N, BKH, GROUP, ASM)
        acc_g += lo.to(tl.float32) * x_lo + hi.to(tl.float32) * x_hi
        qg0, slg0, shg0 = qg1, slg1, shg1
        qg1, slg1, shg1 = qg2, slg2, shg2
        qg2, slg2, shg2 = qgf, slgf, shgf
        if GATED:
            quf, sluf, shuf = _fp4_load(w_u, s_u, far, HALF, okf, stride_wt, stride_st, BKH, GROUP)
            lo, hi = _fp4_dequant(qu0, slu0, shu0, smul, FMT, BLOCK_N, BKH, GROUP, ASM)
            acc_u += lo.to(tl.float32) * x_lo + hi.to(tl.float32) * x_hi
            qu0, slu0, shu0 = qu1, slu1, shu1
            qu1, slu1, shu1 = qu2, slu2, shu2
            qu2, slu2, shu2 = quf, sluf, shuf
        a_lo, a_hi = a_lo_n, a_hi_n
    return tl.sum(tl.sum(acc_g, axis=2), axis=1), tl.sum(tl.sum(acc_u, axis=2), axis=1)


# Same decode as _FP4_ASM, but each bf16x2 product is split into two fp32 values in the asm itself
# (low half << 16, high half & 0xffff0000): 8 fp32 weights per 4 packed bytes, no bf16 unpacking.
def _fp4_asm_f32() -> str:
    body = [p.format(q="$8") for p in _PRMT]
    for i, (src, high) in enumerate([("t0", False), ("t1", False), ("t0", True), ("t1", True)]):
        body += ptx.pair_shift("r", src, high, f"${9 + i}") + [f"shl.b32 ${2 * i}, r, 16;",
                                                                f"and.b32 ${2 * i + 1}, r, 0xFFFF0000;"]
    return ptx.block("t0, t1, a, b, z, r", body)


_FP4_ASM_F32 = tl.constexpr(_fp4_asm_f32())


@triton.jit
def _fp4_pipe_step(w, s4, kb, n_ok, x_lo, x_hi, acc, smul, stride_wt, stride_st, FMT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BKH: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr):
    """acc += one K tile of one weight matrix times the activations, fp32 [BLOCK_N, BKH/GROUP, GROUP].
    The raw bytes and the row's 4-byte scale entry are plain loads in the loop body, so Triton's
    software pipeliner turns them into cp.async copies several tiles ahead."""
    NG: tl.constexpr = BKH // GROUP
    og = tl.arange(0, NG)[None, :, None]
    oe = tl.arange(0, GROUP)[None, None, :]
    q = tl.load(w[:, :, None] + (kb // BKH) * stride_wt + og * GROUP + oe, mask=n_ok[:, None, None], other=0)
    # the row's 4 scale bytes as one int32 (lo0, lo1, hi0, hi1; MXFP4: lo, 0, hi, 0)
    s = tl.load(s4 + (kb // BKH) * (stride_st // 4), mask=n_ok, other=0)
    if NG == 1:
        f_lo = _fp4_group_scale(s & 0xFF, smul, FMT)[:, None]
        f_hi = _fp4_group_scale((s >> 16) & 0xFF, smul, FMT)[:, None]
    else:
        f_lo = tl.join(_fp4_group_scale(s & 0xFF, smul, FMT), _fp4_group_scale((s >> 8) & 0xFF, smul, FMT))
        f_hi = tl.join(_fp4_group_scale((s >> 16) & 0xFF, smul, FMT), _fp4_group_scale((s >> 24) & 0xFF, smul, FMT))
    if ASM:
        b_lo = tl.broadcast_to(f_lo[:, :, None].to(tl.bfloat16), (BLOCK_N, NG, GROUP))
        b_hi = tl.broadcast_to(f_hi[:, :, None].to(tl.bfloat16), (BLOCK_N, NG, GROUP))
        lo, hi = tl.inline_asm_elementwise(_FP4_ASM_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r", [q, b_lo, b_hi],
                                           dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        qi = q.to(tl.int32)
        lo = (_e2m1_times_2pow_m14(qi & 15) * (f_lo[:, :, None] * 1.925929944387236e-34)).to(tl.bfloat16).to(tl.float32)
        hi = (_e2m1_times_2pow_m14(qi >> 4) * (f_hi[:, :, None] * 1.925929944387236e-34)).to(tl.bfloat16).to(tl.float32)
    acc += lo * x_lo
    acc += hi * x_hi
    return acc


# Tensor cores without a layout change (decode, one row per expert): mma.sync m16n8k16 with the
# activations as A (the same k slice in all 16 rows) and the weights as B (k x 8 rows). With Triton's
# blocked layout of a [BLOCK_N, BKH/GROUP, GROUP] byte tile at 8 bytes per thread, the 4 lanes of a
# lane group (lane // 4) hold one weight row and lane t holds bytes 8t..8t+7 of it, which is exactly
# the B fragment (column = lane group; k = 2t, 2t+1, 2t+8, 2t+9 <- bytes (0,1), (4,5) of the lane's 8
# in one mma, bytes (2,3), (6,7) in a second) when every lane feeds the activations of its own 8 bytes
# as A: rows g get bytes 0,1 / 4,5, rows g+8 bytes 2,3 / 6,7, so the first mma's rows g (c0, c1) and the
# second's rows g+8 (c2, c3) are the wanted dot products (the other halves are discarded). Each lane
# passes only its own registers (no moves), the mma does the k reduction across the 4 lanes. Row n's
# partial sums come back in the lanes with t = n // 2; _FP4_MMA_OUT moves them to row n's lane.
# Decode of two codes in a bf16x2 register: fp4_ptx.pair_mul.
def _fp4_asm_mma() -> str:
    """Operands: $0-$7 the two accumulators (out), $8-$9 the lane's 8 bytes, $10-$13 / $14-$17 the
    scale pairs of the low / high nibbles, $18-$21 / $22-$25 the activations (A) for them, $26-$33 the
    accumulators (in)."""
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    body = ["prmt.b32 t0, $8, 0, 0x4140;", "prmt.b32 t1, $8, 0, 0x4342;",
            "prmt.b32 t2, $9, 0, 0x4140;", "prmt.b32 t3, $9, 0, 0x4342;"]
    for high, scale, act, acc_in in ((False, 10, 18, ("$26, $27, $28, $29", "$30, $31, $32, $33")),
                                     (True, 14, 22, ("$0, $1, $2, $3", "$4, $5, $6, $7"))):
        for i in range(4):
            body += ptx.pair_mul(f"w{i}", f"t{i}", high, f"${scale + i}")
        x = ", ".join(f"${act + j}" for j in range(4))
        body += [f"{mma} {{$0, $1, $2, $3}}, {{{x}}}, {{w0, w2}}, {{{acc_in[0]}}};",
                 f"{mma} {{$4, $5, $6, $7}}, {{{x}}}, {{w1, w3}}, {{{acc_in[1]}}};"]
    return ptx.block("t0, t1, t2, t3, a, w0, w1, w2, w3, z", body)


_FP4_ASM_MMA = tl.constexpr(_fp4_asm_mma())

# Per 8-element pack of the mma accumulators: row n's partial sum (c0/c1 of the first mma, c2/c3 of the
# second, in lane n // 2) to lane group n, lane t == 0, element 0; every other element 0.
_MMA_CONS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 26))
_MMA_OUT_CONS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 8))
_FP4_MMA_OUT = tl.constexpr("""
{
.reg .b32 l, g, src, v0, v1, s;
.reg .f32 e0, e1;
.reg .pred p, q;
mov.u32 l, %laneid;
shr.u32 g, l, 2;
shr.u32 src, g, 1;
add.f32 e0, $8, $14;
add.f32 e1, $9, $15;
mov.b32 v0, e0;
mov.b32 v1, e1;
shfl.sync.idx.b32 v0, v0, src, 0x1f, 0xffffffff;
shfl.sync.idx.b32 v1, v1, src, 0x1f, 0xffffffff;
and.b32 s, g, 1;
setp.ne.u32 p, s, 0;
selp.b32 v0, v1, v0, p;
and.b32 s, l, 3;
setp.eq.u32 q, s, 0;
selp.b32 $0, v0, 0, q;
mov.b32 $1, 0;
mov.b32 $2, 0;
mov.b32 $3, 0;
mov.b32 $4, 0;
mov.b32 $5, 0;
mov.b32 $6, 0;
mov.b32 $7, 0;
}
""")


@triton.jit
def _fp4_pipe_step_mma(w, s4, kb, n_ok, x_lo, x_hi, acc, smul, stride_wt, stride_st, FMT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BKH: tl.constexpr, GROUP: tl.constexpr):
    """_fp4_pipe_step on the tensor cores (see _FP4_ASM_MMA); x_lo / x_hi bf16 [1, 1, BKH], acc in mma
    form. The tile is [BLOCK_N, 1, BKH] for both formats: Triton then lays it out 8 bytes per thread,
    4 threads per row (a [BLOCK_N, 2, 16] NVFP4 tile got 2 threads per row from Triton 3.6)."""
    oe = tl.arange(0, BKH)[None, None, :]
    q = tl.load(w[:, :, None] + (kb // BKH) * stride_wt + oe, mask=n_ok[:, None, None], other=0)
    s = tl.load(s4 + (kb // BKH) * (stride_st // 4), mask=n_ok, other=0)[:, None, None]
    if BKH == GROUP:  # MXFP4: one scale per half and tile
        b_lo = _fp4_group_scale(s & 0xFF, smul, FMT).to(tl.bfloat16)
        b_hi = _fp4_group_scale((s >> 16) & 0xFF, smul, FMT).to(tl.bfloat16)
    else:  # NVFP4: two groups of 16 per half and tile
        first = oe < GROUP
        b_lo = tl.where(first, _fp4_group_scale(s & 0xFF, smul, FMT).to(tl.bfloat16),
                        _fp4_group_scale((s >> 8) & 0xFF, smul, FMT).to(tl.bfloat16))
        b_hi = tl.where(first, _fp4_group_scale((s >> 16) & 0xFF, smul, FMT).to(tl.bfloat16),
                        _fp4_group_scale((s >> 24) & 0xFF, smul, FMT).to(tl.bfloat16))
    b_lo = tl.broadcast_to(b_lo, (BLOCK_N, 1, BKH))
    b_hi = tl.broadcast_to(b_hi, (BLOCK_N, 1, BKH))
    xl = tl.broadcast_to(x_lo, (BLOCK_N, 1, BKH))
    xh = tl.broadcast_to(x_hi, (BLOCK_N, 1, BKH))
    return tl.inline_asm_elementwise(_FP4_ASM_MMA, _MMA_CONS,
                                     [q, b_lo, b_hi, xl, xh, acc], dtype=tl.float32, is_pure=True, pack=8)

@triton.jit
def _fp4_fma_loop_pipe(a_row_ptr, w_g, s_g, w_u, s_u, HALF, n_ok, smul, stride_wt, stride_st,
                       FMT: tl.constexpr, BLOCK_N: tl.constexpr, BKH: tl.constexpr, GROUP: tl.constexpr,
                       ASM: tl.constexpr, GATED: tl.constexpr, PIPE: tl.constexpr, MMA: tl.constexpr):
    """_fp4_fma_loop with the prefetch left to Triton's software pipeliner (PIPE stages, cp.async into
    shared memory). The hand-rotated register prefetch of _fp4_fma_loop does not stay in flight: the
    rotation (and the uint8 unpacking) reads the just-loaded registers in the same iteration, so every
    K step waits a full memory round trip. Activations: one row slice per step, broadcast over rows.
    MMA: mma.sync on the decoded tiles (_fp4_pipe_step_mma), two K tiles per iteration."""
    NG: tl.constexpr = BKH // GROUP
    if MMA:  # tensor cores, bf16 activations (8 bytes per thread: BLOCK_N * BKH == 8 * 32 * num_warps)
        kk = tl.arange(0, BKH)[None, None, :]
        acc_g = tl.zeros([BLOCK_N, 1, BKH], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, 1, BKH], dtype=tl.float32)
        for kb in tl.range(0, HALF, 2 * BKH, num_stages=PIPE):  # two K tiles per iteration (loop overhead)
            x_lo = tl.load(a_row_ptr + kb + kk).to(tl.bfloat16)
            x_hi = tl.load(a_row_ptr + HALF + kb + kk).to(tl.bfloat16)
            acc_g = _fp4_pipe_step_mma(w_g, s_g, kb, n_ok, x_lo, x_hi, acc_g, smul, stride_wt, stride_st, FMT, BLOCK_N,
                                       BKH, GROUP)
            if GATED:
                acc_u = _fp4_pipe_step_mma(w_u, s_u, kb, n_ok, x_lo, x_hi, acc_u, smul, stride_wt, stride_st, FMT,
                                           BLOCK_N, BKH, GROUP)
            k2 = kb + BKH
            ok2 = n_ok & ((n_ok.to(tl.int32) * 0 + k2) < HALF)
            more = (kk + k2) < HALF
            x_lo = tl.load(a_row_ptr + k2 + kk, mask=more, other=0.0).to(tl.bfloat16)
            x_hi = tl.load(a_row_ptr + HALF + k2 + kk, mask=more, other=0.0).to(tl.bfloat16)
            acc_g = _fp4_pipe_step_mma(w_g, s_g, k2, ok2, x_lo, x_hi, acc_g, smul, stride_wt, stride_st, FMT, BLOCK_N,
                                       BKH, GROUP)
            if GATED:
                acc_u = _fp4_pipe_step_mma(w_u, s_u, k2, ok2, x_lo, x_hi, acc_u, smul, stride_wt, stride_st, FMT,
                                           BLOCK_N, BKH, GROUP)
        acc_g = tl.inline_asm_elementwise(_FP4_MMA_OUT, _MMA_OUT_CONS, [acc_g], dtype=tl.float32,
                                          is_pure=True, pack=8)
        acc_u = tl.inline_asm_elementwise(_FP4_MMA_OUT, _MMA_OUT_CONS, [acc_u], dtype=tl.float32,
                                          is_pure=True, pack=8)
        g = tl.sum(tl.sum(acc_g, axis=2), axis=1)
        u = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    else:
        kk = tl.arange(0, NG)[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
        acc_g = tl.zeros([BLOCK_N, NG, GROUP], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, NG, GROUP], dtype=tl.float32)
        for kb in tl.range(0, HALF, BKH, num_stages=PIPE):
            x_lo = tl.load(a_row_ptr + kb + kk).to(tl.float32)
            x_hi = tl.load(a_row_ptr + HALF + kb + kk).to(tl.float32)
            acc_g = _fp4_pipe_step(w_g, s_g, kb, n_ok, x_lo, x_hi, acc_g, smul, stride_wt, stride_st, FMT, BLOCK_N,
                                   BKH, GROUP, ASM)
            if GATED:
                acc_u = _fp4_pipe_step(w_u, s_u, kb, n_ok, x_lo, x_hi, acc_u, smul, stride_wt, stride_st, FMT,
                                       BLOCK_N, BKH, GROUP, ASM)
        g = tl.sum(tl.sum(acc_g, axis=2), axis=1)
        u = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    return g, u


# --------------------------------------------------------------------------------- kernel
@triton.jit
def _moe_gemm_kernel(
    a_ptr, stride_am,
    w_ptr, stride_we, stride_wn, stride_wt,
    s_ptr, stride_se, stride_sn, stride_st,
    p_ptr, stride_pe,
    c_ptr, stride_cm,
    sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
    N, K, num_pairs, up_offset, num_pid_m,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATED: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP: tl.constexpr, ASM: tl.constexpr, DOT_F32: tl.constexpr, FMA: tl.constexpr, DEPTH: tl.constexpr,
    PIPE: tl.constexpr = 0, PMMA: tl.constexpr = False,
):
    """C[rows of one expert block, N tile] = A[rows] @ W[e]^T; GATED: silu(A Wg^T) * (A Wu^T).
    p_ptr: per-expert fp32 [gate multiplier, up multiplier, FP4 scale multiplier, -]."""
    pid_m, pid_n = grouped_block(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if GATHER_A:
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_ok = pair < num_pairs
        a_rows = tl.where(row_ok, pair // TOP_K, 0)
    else:
        row_ok = offs_m >= 0
        a_rows = offs_m
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_g = offs_n.to(tl.int64)
    rows_u = rows_g + up_offset
    w_g = w_ptr + e * stride_we + rows_g[:, None] * stride_wn
    w_u = w_ptr + e * stride_we + rows_u[:, None] * stride_wn
    if FMT == 1:  # fp8: one scale per 128 rows x 128 cols
        s_g = s_ptr + e * stride_se + (rows_g // 128)[:, None] * stride_sn
        s_u = s_ptr + e * stride_se + (rows_u // 128)[:, None] * stride_sn
    else:
        s_g = s_ptr + e * stride_se + rows_g[:, None] * stride_sn
        s_u = s_ptr + e * stride_se + rows_u[:, None] * stride_sn

    if SWAP:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FMA:  # FP4, BLOCK_M == 1: one token row per block (see _fp4_fma_loop)
        smul = tl.load(p_ptr + e * stride_pe + 2)
        a_row_ptr = a_ptr + tl.sum(a_rows.to(tl.int64), axis=0) * stride_am
        if PIPE > 0:  # scale rows are 4 bytes (constexpr stride: aligned 4-byte cp.async)
            s_g4 = (s_ptr + e * stride_se).to(tl.pointer_type(tl.int32)) + rows_g
            s_u4 = (s_ptr + e * stride_se).to(tl.pointer_type(tl.int32)) + rows_u
            g, u = _fp4_fma_loop_pipe(a_row_ptr, w_g, s_g4, w_u, s_u4, K // 2, n_ok, smul, stride_wt, stride_st,
                                      FMT, BLOCK_N, BLOCK_K // 2, GROUP, ASM, GATED, PIPE, PMMA and ASM)
        else:
            g, u = _fp4_fma_loop(a_row_ptr, w_g, s_g, w_u, s_u, K // 2, n_ok, offs_n, smul, stride_wt, stride_st, FMT,
                                 BLOCK_N, BLOCK_K // 2,
                                 GROUP, ASM, GATED)
        acc_g = g[None, :]
        acc_u = u[None, :]
    elif FMT >= 2:
        smul = tl.load(p_ptr + e * stride_pe + 2)
        BKH: tl.constexpr = BLOCK_K // 2
        HALF = K // 2
        offs_b = tl.arange(0, BKH)[None, :]
        # Triton does not software-pipeline loads whose values go through ALU work before the dot, so
        # the raw weight bytes are prefetched by hand, DEPTH (1 or 3) tiles ahead.
        a_lo = tl.load(a_base + offs_b, mask=row_ok[:, None], other=0.0)
        a_hi = tl.load(a_base + HALF + offs_b, mask=row_ok[:, None], other=0.0)
        qg0, slg0, shg0 = _fp4_load(w_g, s_g, 0, HALF, n_ok, stride_wt, stride_st, BKH, GROUP)
        qu0, slu0, shu0 = qg0, slg0, shg0
        if GATED:
            qu0, slu0, shu0 = _fp4_load(w_u, s_u, 0, HALF, n_ok, stride_wt, stride_st, BKH, GROUP)
        qg1, slg1, shg1, qg2, slg2, shg2 = qg0, slg0, shg0, qg0, slg0, shg0
        qu1, slu1, shu1, qu2, slu2, shu2 = qu0, slu0, shu0, qu0, slu0, shu0
        if DEPTH == 3:
            ok1 = n_ok & ((offs_n * 0 + BKH) < HALF)
            ok2 = n_ok & ((offs_n * 0 + 2 * BKH) < HALF)
            qg1, slg1, shg1 = _fp4_load(w_g, s_g, BKH, HALF, ok1, stride_wt, stride_st, BKH, GROUP)
            qg2, slg2, shg2 = _fp4_load(w_g, s_g, 2 * BKH, HALF, ok2, stride_wt, stride_st, BKH, GROUP)
            if GATED:
                qu1, slu1, shu1 = _fp4_load(w_u, s_u, BKH, HALF, ok1, stride_wt, stride_st, BKH, GROUP)
                qu2, slu2, shu2 = _fp4_load(w_u, s_u, 2 * BKH, HALF, ok2, stride_wt, stride_st, BKH, GROUP)
        for kb in range(0, HALF, BKH):
            nxt = kb + BKH
            far = kb + DEPTH * BKH
            okf = n_ok & ((offs_n * 0 + far) < HALF)  # tensor masks: interpreter-safe
            a_ok = row_ok[:, None] & ((offs_b + nxt) < HALF)
            a_lo_n = tl.load(a_base + nxt + offs_b, mask=a_ok, other=0.0)
            a_hi_n = tl.load(a_base + HALF + nxt + offs_b, mask=a_ok, other=0.0)
            qgf, slgf, shgf = _fp4_load(w_g, s_g, far, HALF, okf, stride_wt, stride_st, BKH, GROUP)
            lo, hi = _fp4_dequant2(qg0, slg0, shg0, smul, FMT, BLOCK_N, BKH, GROUP, ASM)
            acc_g = _accumulate(a_lo, a_hi, lo, hi, acc_g, SWAP, DOT_F32)
            if DEPTH == 3:
                qg0, slg0, shg0 = qg1, slg1, shg1
                qg1, slg1, shg1 = qg2, slg2, shg2
                qg2, slg2, shg2 = qgf, slgf, shgf
            else:
                qg0, slg0, shg0 = qgf, slgf, shgf
            if GATED:
                quf, sluf, shuf = _fp4_load(w_u, s_u, far, HALF, okf, stride_wt, stride_st, BKH, GROUP)
                lo, hi = _fp4_dequant2(qu0, slu0, shu0, smul, FMT, BLOCK_N, BKH, GROUP, ASM)
                acc_u = _accumulate(a_lo, a_hi, lo, hi, acc_u, SWAP, DOT_F32)
                if DEPTH == 3:
                    qu0, slu0, shu0 = qu1, slu1, shu1
                    qu1, slu1, shu1 = qu2, slu2, shu2
                    qu2, slu2, shu2 = quf, sluf, shuf
                else:
                    qu0, slu0, shu0 = quf, sluf, shuf
            a_lo, a_hi = a_lo_n, a_hi_n
    else:
        offs_k = tl.arange(0, BLOCK_K)[None, :]
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_base + k0 + offs_k, mask=row_ok[:, None], other=0.0)
            acc_g = _mma(a, _dense_tile(w_g, s_g, k0, n_ok, FMT, BLOCK_K), acc_g, SWAP, DOT_F32)
            if GATED:
                acc_u = _mma(a, _dense_tile(w_u, s_u, k0, n_ok, FMT, BLOCK_K), acc_u, SWAP, DOT_F32)

    if FMT >= 2:  # NVFP4 global scale (gate, up) / FP4 exponent offset 2^c, per expert
        acc_g = acc_g * tl.load(p_ptr + e * stride_pe)
        if GATED:
            acc_u = acc_u * tl.load(p_ptr + e * stride_pe + 1)
    if GATED:
        out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        out = acc_g
    if SWAP:
        c = c_ptr + offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
        tl.store(c, out.to(c_ptr.dtype.element_ty), mask=n_ok[:, None])
    else:
        c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c, out.to(c_ptr.dtype.element_ty), mask=n_ok[None, :])


# --------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 1
    swap: bool = False  # weights as the MMA's left operand (token rows as its N dimension)
    depth: int = 1      # FP4: raw tiles prefetched ahead (1 or 3)
    fma: bool = False   # FP4: CUDA-core FMA instead of tensor cores (decode: 1-8 rows per block)
    pipe: int = 0       # FP4 + fma: software-pipeline stages of the cp.async loop (0: hand-prefetch loop)
    mma: bool = False   # FP4 + pipe: mma.sync instead of CUDA-core FMAs (num_warps := block_n / 8)


@dataclass(frozen=True)
class FragConfig:
    """FP4 fragment-order kernel (triton_frag.py): 8*nt token rows per block; each warp takes rt
    16-row weight tiles; wn x wk warps per program (wk: warps splitting K); pipe: cp.async stages."""
    nt: int = 1
    rt: int = 1
    wn: int = 4
    wk: int = 1
    pipe: int = 4
    group_m: int = 1


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    gemm1: GemmConfig | FragConfig
    gemm2: GemmConfig | FragConfig
    # fragment kernel, mixed blocks (triton_align.align_mixed): gemm1/gemm2 (nt=2) run the 16-row blocks
    # of experts with > 8 rows, these two (nt=1) the one 8-row block of each other expert
    small: tuple[FragConfig, FragConfig] | None = None
    # tl.dot tiles (block_m rows) with 16-row fragment-kernel tail blocks (triton_align.align_split):
    # an expert's remainder of at most tail_rows rows past its full block_m blocks runs in these two
    # (nt=2) configs instead of one more, mostly padded, block_m-row tile. Needs the fragment copy.
    tail: tuple[FragConfig, FragConfig] | None = None
    tail_rows: int = 0
    # one token (pairwise) under PDL: launch the gate/up GEMM early too (its programs are then placed
    # beside the previous kernel's, which can stack them unevenly over the SMs; see default_config)
    gate_up_pdl: bool = True

    @property
    def frag(self) -> bool:
        return isinstance(self.gemm1, FragConfig)


def default_config(fmt: str, num_pairs: int, num_experts: int, frag: bool = False) -> MoEConfig:
    """Tile choice by rows per touched expert (measured on an H200, see bench/README.md).

    FP4 with the fragment copy (frag=True), up to FRAG_MAX_ROWS rows per expert: the fragment-order
    kernel (triton_frag.py) with 8-row blocks (one token: pairwise, no alignment launches), above
    FRAG_NT1_ROWS mixed 8/16-row blocks, above FRAG_MIXED_ROWS 16-row blocks; beyond FRAG_MAX_ROWS
    128-row tiles with 16-row fragment tail blocks (align_split). Without it, FP4 decode runs the one-row cp.async loop with
    mma.sync (_fp4_fma_loop_pipe) and small batches 16-row tensor-core tiles. Large batches: 128-row
    tiles reuse each dequantised weight tile 128 times. Register counts were read from the compiled
    SM90 cubins (no spills)."""
    rows = num_pairs / max(1, min(num_experts, num_pairs))
    fp4 = fmt in ("nvfp4", "mxfp4")
    nt2 = FragConfig(2, 4, 1, 1, 3)   # 16-row blocks, four row tiles per warp
    if fp4 and frag and rows <= FRAG_MAX_ROWS:
        # (nt, rt, wn, wk, pipe[, group_m]) from the H200 sweeps in bench/README.md. MXFP4 GEMM1 keeps
        # two row tiles per warp with 8-row blocks at 2-8 rows per expert (four: more registers in its
        # 4-sub-step loop; slower there, faster at one token since the cheaper word decode).
        if rows <= 1.5:   # decode: few programs, so GEMM1 splits K over two warps to fill the SMs.
            # Launched early (PDL), GEMM1's programs are placed while the previous kernel's are still
            # resident: where three fit on an SM (NVFP4 with 4 stages), some SMs got three and others
            # none (+20% time). MXFP4's 3-stage programs take > 1/3 of an SM's shared memory (at most
            # two per SM): launched early. NVFP4 keeps 4 stages and waits for the previous kernel
            # (64.6 us against 65.5 with 5 stages launched early; one-token A/B in bench/README.md).
            # Down GEMM: one-warp programs (also the fused finalize's column blocks).
            if fmt == "nvfp4":
                return MoEConfig(8, FragConfig(1, 4, 1, 2, 4), FragConfig(1, 4, 1, 1, 3), gate_up_pdl=False)
            return MoEConfig(8, FragConfig(1, 4, 1, 2, 3), FragConfig(1, 4, 1, 1, 3))
        if rows <= FRAG_NT1_ROWS:   # 8-row token blocks: nearly every expert fits in one
            g1 = FragConfig(1, 4, 1, 2, 3) if fmt == "nvfp4" else FragConfig(1, 2, 2, 1, 3)
            g2 = FragConfig(1, 4, 1, 1, 4, 2) if fmt == "nvfp4" else FragConfig(1, 4, 2, 1, 3, 2)
            return MoEConfig(8, g1, g2)
        if rows <= FRAG_MIXED_ROWS:
            # mixed blocks: 16-row blocks for the experts with > 8 rows (one block instead of re-reading
            # and re-decoding their weights for a second 8-row block), one 8-row block for the others.
            # Measured at 256 tokens: 2% (NVFP4) / 6% (MXFP4) faster than 16-row blocks only; with every
            # row real, both block sizes cost ~1.4x the bandwidth limit per weight byte there
            small = ((FragConfig(1, 4, 1, 2, 3) if fmt == "nvfp4" else FragConfig(1, 2, 2, 1, 3)),
                     (FragConfig(1, 4, 1, 1, 4, 2) if fmt == "nvfp4" else FragConfig(1, 4, 2, 1, 3, 2)))
            return MoEConfig(16, nt2, nt2, small)
        # 16-row blocks only: at 1024 tokens (~32 rows per expert) 5.5 ms NVFP4 against 8.5 ms for
        # 32-row tl.dot tiles (MXFP4 5.9 / 6.6), at 2048 (~64 rows) 10.3 / 13.1-17.6 ms for 64-row
        # tiles with or without tails (MXFP4 10.9 / 10.9-13.8)
        return MoEConfig(16, nt2, nt2)
    if fp4 and frag:
        # 128-row tl.dot tiles; an expert's remainder of up to a quarter tile goes to 16-row tail blocks
        # instead of one more, mostly padded tile (align_split; at 4096 tokens about half the experts
        # have a few rows over 128: 12.8 ms against 16.4 ms for both formats, any bound from 32 to 96)
        return MoEConfig(128, _TILE128, _TILE128, tail=(nt2, nt2), tail_rows=32)
    if not fp4:  # bf16 / fp8: not tuned; plain tiles
        if rows <= 16:
            return MoEConfig(16, GemmConfig(64, 128, 4, 4, swap=True), GemmConfig(64, 128, 4, 4, swap=True))
        return MoEConfig(64, GemmConfig(64, 64, 4, 3, 8), GemmConfig(128, 64, 8, 3, 8))
    if rows <= FMA_MAX_ROWS:
        return MoEConfig(1, GemmConfig(32, 64, 4, 1, fma=True, pipe=4, mma=True),
                         GemmConfig(32, 64, 4, 1, fma=True, pipe=4, mma=True))
    if rows <= 16:
        return MoEConfig(16, GemmConfig(64, 64, 4, 2), GemmConfig(64, 64, 4, 2))
    if rows <= 48:
        return MoEConfig(32, GemmConfig(64, 64, 4, 2, 4, swap=True), GemmConfig(128, 64, 8, 2, 4, swap=True))
    if rows <= 96:
        return MoEConfig(64, GemmConfig(64, 64, 4, 2, 8), GemmConfig(128, 64, 8, 2, 8))
    return MoEConfig(128, _TILE128, _TILE128)


# 128-row tl.dot tiles of large batches (both GEMMs)
_TILE128 = GemmConfig(128, 64, 8, 2, 8)

# Above this many rows per expert, mixed blocks (align_mixed: 16-row blocks for experts with > 8 rows,
# one 8-row block for the others) instead of 8-row blocks only, of which an expert with 9-16 rows
# needs two (its weights read and decoded twice). Below, hardly any expert has > 8 rows (Poisson:
# P(rows > 8) < 4% at 4 rows), so the extra two launches of the mixed path are not worth it.
# Set from the 256-token runs, not measured at the boundary itself.
FRAG_NT1_ROWS = 6
# Up to this many rows per expert, mixed 8/16-row blocks; above, 16-row blocks only.
FRAG_MIXED_ROWS = 12
# Rows per expert up to which the fragment-order kernel (8 or 16 token rows per block, no shared-memory
# operand staging) is used; above, 128-row tensor-core tiles share activations between warps. Measured
# at 32 and 64 rows (1024, 2048 tokens: frag faster) and 128 (4096: frag 19.6-20.5 ms against
# 12.8-13.3 for tiles + tails); the crossover between 64 and 128 rows is interpolated, not measured.
FRAG_MAX_ROWS = 80

# Rows per expert up to which the one-row CUDA-core path wins: it re-reads an expert's weights for
# every row, so it pays off only while nearly every expert has a single row.
FMA_MAX_ROWS = 1.5


def _fit(dim: int, want: int, minimum: int) -> int:
    """Largest power of two <= want dividing dim (>= minimum)."""
    b = want
    while b >= minimum:
        if dim % b == 0:
            return b
        b //= 2
    raise ValueError(f"dimension {dim} is not a multiple of {minimum}")


# -------------------------------------------------------------------------------- weights
def _split_half_repack(packed: torch.Tensor) -> torch.Tensor:
    """Standard E2M1 packing [..., N, K/2] -> split-half packing (byte j = elements j and K/2 + j).
    Done one expert at a time to keep the temporary small."""
    out = torch.empty_like(packed)
    for e in range(packed.shape[0]):
        codes = F.unpack_e2m1(packed[e])
        half = codes.shape[-1] // 2
        out[e] = (codes[..., :half] & 0x0F) | (codes[..., half:] << 4)
    return out


@dataclass
class _Operand:
    w: torch.Tensor       # storage: bf16 / e4m3 [E, N, K], or FP4 K-tiled uint8 [E, K/2/KT, N, KT]
    s: torch.Tensor       # block scales (fp32 [E, N/128, K/128] fp8; FP4 K-tiled uint8 [E, ., N, KT/G])
    p: torch.Tensor       # fp32 [E, 4]: gate / up accumulator multipliers, FP4 scale multiplier, unused
    row_w: int = 0        # element stride between rows (within a K tile for FP4)
    tile_w: int = 0       # FP4: stride between K tiles
    row_s: int = 0
    tile_s: int = 0


# FP4 K tile: 32 packed bytes (64 weights) per row. Storing each K tile of all rows contiguously makes
# a block of rows x one K step one contiguous 1-4 KB read instead of 32-byte pieces 3.5 KB apart
# (which streamed at under 1 TB/s).
FP4_KT = 32


def _tile_k(t: torch.Tensor, width: int) -> torch.Tensor:
    """[E, N, C] -> [E, C/width, N, width] contiguous."""
    e, n, c = t.shape
    return t.reshape(e, n, c // width, width).permute(0, 2, 1, 3).contiguous()


# In-register FP4 weights come out as weight * 2^-c (see _fp4_group_scale): NVFP4 uses c = 9 so that
# e4m3 scales up to 448 times 2^(126-9) stay finite in bf16; the 2^9 goes into the global scale.
_NVFP4_C = 9


def _prepare(t, fmt: str) -> _Operand:
    if fmt in ("bf16", "fp8"):
        w = t.contiguous() if fmt == "bf16" else t.weight.view(torch.uint8).contiguous()
        s = w if fmt == "bf16" else t.scale_inv.float().contiguous()
        return _Operand(w, s, torch.ones(1, 4, dtype=torch.float32, device=w.device), w.stride(1), 0, s.stride(1), 0)
    w = _split_half_repack(t.packed.contiguous())
    e, n, half = w.shape
    if half % FP4_KT:
        raise ValueError(f"FP4 kernels need K to be a multiple of {2 * FP4_KT}, got {2 * half}")
    p = torch.zeros(e, 4, dtype=torch.float32, device=w.device)
    if fmt == "nvfp4":
        s = t.block_scale.view(torch.uint8).contiguous()
        gs = t.global_scale.float().reshape(e, -1)
        if gs.shape[1] not in (1, 2):
            raise ValueError(f"NVFP4 global scale must be [E] or [E, 2], got {tuple(t.global_scale.shape)}")
        p[:, :2] = gs.expand(-1, 2) * 2.0 ** _NVFP4_C
        p[:, 2] = 2.0 ** (126 - _NVFP4_C)
    else:
        s = t.scale.contiguous()
        # per-expert offset c keeps 2^(s-127) * 2^(126-c) finite for the largest scale of the expert
        c = (s.reshape(e, -1).amax(dim=1).to(torch.int32) - 127).clamp(min=0).float()
        p[:, 0] = p[:, 1] = torch.exp2(c)
        p[:, 2] = torch.exp2(126.0 - c)
    per_tile = FP4_KT // (F.NVFP4_BLOCK if fmt == "nvfp4" else F.MXFP4_BLOCK)
    return _Operand(_tile_k(w, FP4_KT), _scale_tiles(s, per_tile), p, FP4_KT, n * FP4_KT, 4, n * 4)


def _scale_tiles(s: torch.Tensor, per_tile: int) -> torch.Tensor:
    """Block scales uint8 [E, N, K/G] -> [E, K/2/FP4_KT, N, 4]: per row and K tile of the split-half
    packing, the scales of its low half (bytes 0-1) and of its high half (bytes 2-3); MXFP4 (one
    scale per half and tile) leaves bytes 1 and 3 zero. 4 bytes per row, so the pipelined decode
    loop can copy them with cp.async (1-byte loads cannot be)."""
    e, n, g = s.shape
    lo = s[..., : g // 2].reshape(e, n, -1, per_tile)
    hi = s[..., g // 2:].reshape(e, n, -1, per_tile)
    if per_tile == 1:
        lo = torch.nn.functional.pad(lo, (0, 1))
        hi = torch.nn.functional.pad(hi, (0, 1))
    return torch.cat([lo, hi], dim=-1).permute(0, 2, 1, 3).contiguous()


def _constant(cache: dict, key, make):
    """cache[key], made on first use. Not kept when made during CUDA-graph capture: it would live in
    the graph's private pool (the captured graph keeps its own copy alive)."""
    value = cache.get(key)
    if value is None:
        value = make()
        if not torch.cuda.is_current_stream_capturing():
            cache[key] = value
    return value


@dataclass
class _FusedFinalize:
    """The one-token finalize done by the pairwise down GEMM (triton_frag._arrive_and_finalize)."""
    weights: torch.Tensor          # topk_weights [1, K], fp32 or bf16
    shared: torch.Tensor | None    # shared expert's output [1, H] bf16
    out: torch.Tensor              # [1, H] bf16, the layer's output
    counts: torch.Tensor           # int32 arrival counter per column block, zero between forwards
    routed_scale: float


class TritonExperts:
    """Weight-only (W4A16 / W8A16 / bf16) grouped-GEMM MoE experts in Triton. CUDA tensors only."""

    def __init__(self, weights: ExpertWeights, config: MoEConfig | None = None, asm: bool = True,
                 frag: bool | None = None, pdl: bool | None = None):
        if weights.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("TritonExperts needs the expert weights on a CUDA device")
        # (the ExpertWeights are not kept: only the re-laid-out copies below live on the GPU)
        self.fmt = weights.format
        self.fmt_id = _FMT_ID[weights.format]
        self.config = config
        self.asm = asm  # inline-PTX FP4 decode (NVIDIA only); False: the portable Triton decode
        e, h, i = weights.num_experts, weights.hidden_size, weights.intermediate_size
        self.E, self.H, self.I = e, h, i
        group = _GROUP[self.fmt_id]
        if self.fmt_id >= FMT_NVFP4 and ((h // 2) % group or (i // 2) % group):
            raise ValueError(f"{self.fmt} needs H/2 and I/2 to be multiples of {group} (H={h}, I={i})")
        self.w13 = _prepare(weights.w13, self.fmt)
        self.w2 = _prepare(weights.w2, self.fmt)
        # FP4: the fragment-order copy for <= FRAG_MAX_ROWS rows per expert and for tail blocks.
        # A second copy of the weights (same bytes again); frag=False keeps only the tiled one.
        fits = (self.fmt_id >= FMT_NVFP4 and i % 16 == 0 and h % 16 == 0
                and h % STEP_K[self.fmt] == 0 and i % STEP_K[self.fmt] == 0)
        if frag and not fits:
            raise ValueError(f"the fragment kernel needs FP4 weights with H, I multiples of "
                             f"{STEP_K.get(self.fmt, 128)} (got {self.fmt}, H={h}, I={i})")
        # mma.sync bf16 and the bf16x2 decode need SM80+; the interpreter cannot run inline PTX
        sm80 = weights.device.type == "cuda" and torch.cuda.get_device_capability(weights.device)[0] >= 8
        if frag and not sm80 and not _INTERPRET:
            raise ValueError("the fragment kernel needs an SM80+ NVIDIA GPU")
        self.frag = bool(fits if frag is None else frag) and sm80 and not _INTERPRET
        self.f13 = FragWeights.pack(weights.w13, self.fmt) if self.frag else None
        self.f2 = FragWeights.pack(weights.w2, self.fmt) if self.frag else None
        self._pairwise_perm: dict = {}
        # fragment kernel: GEMM2 reads (and GEMM1 writes) the intermediate activations in the coalesced
        # order (triton_frag.coalesce_activations); GEMM1 reads a reordered copy of x, except for one
        # token (pairwise: one row, the copy would cost more than it saves)
        self.coalesce = True
        # one-token (pairwise) forward: GEMM1 and GEMM2 (which finalizes) launched with PDL where supported (pdl.py)
        self.pdl = (self.frag and pdl_supported(weights.device)) if pdl is None else bool(pdl and self.frag)
        # one token: the down GEMM finalizes (triton_frag._arrive_and_finalize) instead of a finalize
        # launch; its arrival counters (one int32 per column block, zero between forwards: the last
        # program of a block resets its own) are per device. Forwards of this object must therefore not
        # run concurrently on two streams.
        self.fuse_finalize = True
        self._fin_counts: dict = {}

    def _launch(self, op: _Operand, a, c, al, n, k, cfg: GemmConfig, gather: bool, gated: bool, top_k: int,
                num_pairs: int):
        bk = _fit(k, cfg.block_k, 32 if self.fmt_id >= FMT_NVFP4 else 16)
        if self.fmt_id == FMT_FP8:
            bk = min(bk, 128)
        if self.fmt_id >= FMT_NVFP4:
            bk = 2 * FP4_KT  # one K tile of the K-tiled storage per step
        bn = min(cfg.block_n, max(16, triton.next_power_of_2(n)))
        fp4 = self.fmt_id >= FMT_NVFP4
        fma = cfg.fma and fp4
        if fma and al.block_m != 1:
            raise ValueError("the FMA path handles one row per block (block_m=1)")
        pmma = bool(cfg.mma and fma and cfg.pipe)
        num_warps = cfg.num_warps
        if pmma:  # 8 bytes of a [block_n, 32-byte] tile per thread (see _FP4_ASM_MMA)
            num_warps = bn * FP4_KT // (8 * 32)
        grid = (al.max_blocks * triton.cdiv(n, bn),)
        _moe_gemm_kernel[grid](
            a, a.stride(0),
            op.w, op.w.stride(0), op.row_w, op.tile_w,
            op.s, op.s.stride(0), op.row_s, op.tile_s,
            op.p, op.p.stride(0),
            c, c.stride(0),
            al.sorted_ids, al.expert_ids, al.num_post_pad,
            n, k, num_pairs, self.I if gated else 0, al.max_blocks,
            TOP_K=top_k, GATHER_A=gather, GATED=gated, FMT=self.fmt_id, GROUP=_GROUP[self.fmt_id],
            BLOCK_M=al.block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, SWAP=cfg.swap and not fma,
            ASM=self.asm and not _INTERPRET, DOT_F32=_INTERPRET, FMA=fma, DEPTH=cfg.depth if fp4 else 1,
            PIPE=cfg.pipe if fma else 0, PMMA=pmma,
            num_warps=num_warps, num_stages=cfg.num_stages,
        )

    def _forward_frag(self, cfg: MoEConfig, x, topk_weights, topk_ids, shared_output, routed_scale, defer_finalize):
        t, top_k = topk_ids.shape
        num_pairs = t * top_k
        if cfg.small is not None:   # two block sizes (16-row blocks first in the row space)
            if cfg.block_m != 16 or cfg.gemm1.nt != 2 or cfg.small[0].nt != 1:
                raise ValueError("mixed fragment configs: 16-row blocks (nt=2) and small (nt=1) configs")
            mixed = align_mixed(topk_ids, self.E)
            parts = [(mixed.big, cfg.gemm1, cfg.gemm2), (mixed.small, *cfg.small)]
            perm, p_max, pairwise = mixed.perm, mixed.p_max, False
        else:
            if t == 1 and cfg.block_m == 8:
                al = self._pairwise(topk_ids)   # one token: its experts are distinct; no sort needed
            else:
                al = align_by_expert(topk_ids, self.E, cfg.block_m)
            parts = [(al, cfg.gemm1, cfg.gemm2)]
            perm, p_max, pairwise = al.perm, al.p_max, al.pairwise
        inter, gemm2_out = self._buffers(p_max, x.device)
        co = self.coalesce
        xco = co and not pairwise
        fin = None
        if pairwise and not defer_finalize and self.fuse_finalize:
            fin = self._fused_finalize_args(gemm2_out, topk_weights, perm, shared_output, routed_scale)
        if num_pairs:
            xin = coalesce_activations(x, self.fmt) if xco else x
            for al, g1, _ in parts:
                self._launch_frag(self.f13, xin, inter, al, self.I, g1, True, True, top_k, num_pairs, xco, co,
                                  gate_up_pdl=cfg.gate_up_pdl)
            for al, _, g2 in parts:
                self._launch_frag(self.f2, inter, gemm2_out, al, self.H, g2, False, False, top_k, num_pairs, co,
                                  fin=fin)
        if fin is not None:
            return fin.out
        return self._finish(gemm2_out, topk_weights, perm, shared_output, routed_scale, defer_finalize,
                            pdl=self.pdl and pairwise)

    def _fused_finalize_args(self, gemm2_out, topk_weights, perm, shared_output, routed_scale) -> _FusedFinalize:
        """What the pairwise down GEMM needs to finalize the one token itself (FIN in triton_frag)."""
        _check_finalize(gemm2_out, topk_weights, perm, shared_output)
        shared = None
        if shared_output is not None:
            if shared_output.shape[1] != self.H:
                raise TypeError(f"shared_output must be bf16 [T, {self.H}], got {tuple(shared_output.shape)}")
            shared = shared_output.contiguous()
        dev = gemm2_out.device
        # one counter per 16-row column block at most, zeroed once
        counts = _constant(self._fin_counts, dev, lambda: torch.zeros(triton.cdiv(self.H, 16), dtype=torch.int32,
                                                                       device=dev))
        out = torch.empty(1, self.H, dtype=torch.bfloat16, device=dev)
        return _FusedFinalize(topk_weights.contiguous(), shared, out, counts, float(routed_scale))

    def _pairwise(self, topk_ids: torch.Tensor) -> Alignment:
        """One 8-row block per (token, expert) pair, pair i on row 8i: no alignment launches (the
        fragment kernel reads the expert of block i from topk_ids itself). The row map is a constant,
        made once per top-k outside graph capture."""
        ids = topk_ids.reshape(-1)
        n = ids.numel()
        perm = _constant(self._pairwise_perm, (n, ids.device),
                         lambda: torch.arange(0, 8 * n, 8, dtype=torch.int32, device=ids.device))
        return Alignment(ids, ids, ids, perm, 8, n, pairwise=True)

    def _launch_frag(self, fw: FragWeights, a, c, al, n: int, cfg: FragConfig, gather: bool, gated: bool,
                     top_k: int, num_pairs: int, xco: bool = False, operm: bool = False,
                     fin: _FusedFinalize | None = None, gate_up_pdl: bool = True):
        """xco: `a` is in the coalesced order (coalesce_activations); operm: write `c` in that order.
        fin: the fused one-token finalize (pairwise down GEMM only)."""
        if fin is not None and not (al.pairwise and not gated):
            raise ValueError("the fused finalize is for the one-token (pairwise) down GEMM")
        steps = fw.k // STEP_K[self.fmt]
        wk = math.gcd(cfg.wk, steps)   # K-splitting warps: a divisor of the step count
        if al.block_m != 8 * cfg.nt:
            raise ValueError(f"fragment kernel with nt={cfg.nt} needs block_m={8 * cfg.nt}, got {al.block_m}")
        if a.stride(1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16:
            a = a.contiguous().clone()
        grid = (al.max_blocks * triton.cdiv(n, 16 * cfg.wn * cfg.rt),)
        pdl = self.pdl and al.pairwise   # measured: -1.5 us at 1 token, +0-2% at 8-64 tokens
        # the gate/up GEMM keeps its PDL code (it lets the down GEMM launch early) but is itself launched
        # early only with gate_up_pdl (MoEConfig): its programs are placed beside the previous kernel's
        launch_pdl = pdl and (not gated or gate_up_pdl)
        frag_moe_kernel[grid](
            a, a.stride(0) // 2,
            fw.w, fw.w.stride(0), fw.w.stride(1),
            fw.s, fw.s.stride(0), fw.s.stride(1),
            fw.p,
            c, c.stride(0),
            al.sorted_ids, al.expert_ids, al.num_post_pad,
            n, steps, num_pairs, (fw.n // 2) // 16 if gated else 0, al.max_blocks, self.E,
            TOP_K=top_k, GATHER_A=gather, GATED=gated, SUBS=fw.sub, PAIRWISE=al.pairwise, ROW_START=al.row_start,
            PDL=pdl, XCO=xco, OPERM=operm, NT=cfg.nt, RT=cfg.rt, WN=cfg.wn,
            WK=wk, GROUP_M=cfg.group_m, PIPE=cfg.pipe, **frag_asm_args(self.fmt, cfg.nt, cfg.rt),
            # (unused pointer arguments without FIN: any tensor)
            fin_w_ptr=fin.weights if fin else c, fin_s_ptr=fin.shared if fin and fin.shared is not None else c,
            fin_out_ptr=fin.out if fin else c, fin_count_ptr=fin.counts if fin else c,
            routed_scale=fin.routed_scale if fin else 1.0, FIN=fin is not None,
            FIN_SHARED=fin is not None and fin.shared is not None,
            num_warps=cfg.wn * wk, **({"launch_pdl": True} if launch_pdl else {}),
        )

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                shared_output: torch.Tensor | None = None, routed_scale: float = 1.0,
                defer_finalize: bool = False):
        _check_inputs(x, topk_weights, topk_ids, self.H)
        t, top_k = topk_ids.shape
        num_pairs = t * top_k
        cfg = self.config or default_config(self.fmt, num_pairs, self.E, self.frag)
        if (cfg.frag or cfg.tail is not None) and not self.frag:
            raise ValueError("a fragment-kernel config (or tail blocks, MoEConfig.tail) needs TritonExperts(frag=True) "
                             "FP4 weights on an SM80+ GPU")
        x = x.to(torch.bfloat16).contiguous()
        if cfg.frag:
            return self._forward_frag(cfg, x, topk_weights, topk_ids, shared_output, routed_scale, defer_finalize)
        if cfg.tail is not None and num_pairs:
            return self._forward_split(cfg, x, topk_weights, topk_ids, shared_output, routed_scale, defer_finalize)
        al = align_by_expert(topk_ids, self.E, cfg.block_m)
        # the CUDA-core path keeps the SiLU*up activations in fp32 (no bf16 rounding between the GEMMs)
        # (not with mma.sync in GEMM2: its operands are bf16, as in the reference)
        fma = (cfg.gemm1.fma and cfg.gemm2.fma and self.fmt_id >= FMT_NVFP4
               and not (cfg.gemm2.mma and cfg.gemm2.pipe))
        inter, gemm2_out = self._buffers(al.p_max, x.device, torch.float32 if fma else torch.bfloat16)
        if num_pairs:
            self._launch(self.w13, x, inter, al, self.I, self.H, cfg.gemm1, True, True, top_k, num_pairs)
            self._launch(self.w2, inter, gemm2_out, al, self.H, self.I, cfg.gemm2, False, False, top_k, num_pairs)
        return self._finish(gemm2_out, topk_weights, al.perm, shared_output, routed_scale, defer_finalize)

    def _forward_split(self, cfg: MoEConfig, x, topk_weights, topk_ids, shared_output, routed_scale,
                       defer_finalize):
        """Large batches: block_m-row tl.dot tiles for the rows that fill them, an expert's remainder
        of <= cfg.tail_rows rows in 16-row fragment-kernel blocks (align_split)."""
        t, top_k = topk_ids.shape
        num_pairs = t * top_k
        if cfg.tail[0].nt != TAIL_M // 8 or cfg.tail[1].nt != TAIL_M // 8:
            raise ValueError(f"tail configs run {TAIL_M}-row blocks (nt={TAIL_M // 8})")
        split = align_split(topk_ids, self.E, cfg.block_m, cfg.tail_rows)
        inter, gemm2_out = self._buffers(split.p_max, x.device)
        self._launch(self.w13, x, inter, split.big, self.I, self.H, cfg.gemm1, True, True, top_k, num_pairs)
        # tail rows: GEMM1 reads x as it is (a reordered copy of all of x is not worth a few rows per
        # expert) and writes the intermediate in the coalesced order for GEMM2
        co = self.coalesce
        self._launch_frag(self.f13, x, inter, split.small, self.I, cfg.tail[0], True, True, top_k, num_pairs,
                          False, co)
        self._launch(self.w2, inter, gemm2_out, split.big, self.H, self.I, cfg.gemm2, False, False, top_k, num_pairs)
        self._launch_frag(self.f2, inter, gemm2_out, split.small, self.H, cfg.tail[1], False, False, top_k,
                          num_pairs, co)
        return self._finish(gemm2_out, topk_weights, split.perm, shared_output, routed_scale, defer_finalize)

    def _buffers(self, p_max: int, device, inter_dtype: torch.dtype = torch.bfloat16):
        """GEMM1's output (the intermediate activations) and GEMM2's (un-weighted rows), p_max rows each."""
        return (torch.empty(p_max, self.I, dtype=inter_dtype, device=device),
                torch.empty(p_max, self.H, dtype=torch.bfloat16, device=device))

    @staticmethod
    def _finish(gemm2_out, topk_weights, perm, shared_output, routed_scale, defer_finalize: bool, pdl: bool = False):
        """Hand the rows over (deferred finalize) or finalize them here, with the shared expert's output."""
        if defer_finalize:
            return DeferredMoEOutput(gemm2_out, topk_weights, perm, float(routed_scale))
        return moe_finalize_fuse_shared(gemm2_out, topk_weights, perm, shared_output, float(routed_scale), pdl=pdl)

    __call__ = forward
