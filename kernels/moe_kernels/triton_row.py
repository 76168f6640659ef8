"""The one-row FP4 decode loop of the tile kernel (GemmConfig.one_row: one token row per block).

Used by default only where the fragment kernel (triton_frag.py) does not apply: FP4 decode without
the fragment copy (pre-SM80, K not a multiple of its step, TritonExperts(frag=False)). The raw bytes
and the 4-byte scale entries are plain loads in the loop body, so Triton's software pipeliner issues
them as cp.async copies PIPE - 1 tiles ahead; the products run on mma.sync fed straight from each
thread's registers (no shared-memory staging). History and the retired variants: bench/README.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import fp4_ptx as ptx
from .triton_decode import e2m1_times_2pow_m14, fp4_group_scale


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
def _step_mma(w, s4, kb, n_ok, x_lo, x_hi, acc, smul, stride_wt, stride_st, FMT: tl.constexpr,
              BLOCK_N: tl.constexpr, BKH: tl.constexpr, GROUP: tl.constexpr):
    """acc += one K tile of one weight matrix times the activations, on the tensor cores (see
    _FP4_ASM_MMA); x_lo / x_hi bf16 [1, 1, BKH], acc in mma form. The tile is [BLOCK_N, 1, BKH] for
    both formats: Triton then lays it out 8 bytes per thread, 4 threads per row (a [BLOCK_N, 2, 16]
    NVFP4 tile got 2 threads per row from Triton 3.6)."""
    oe = tl.arange(0, BKH)[None, None, :]
    q = tl.load(w[:, :, None] + (kb // BKH) * stride_wt + oe, mask=n_ok[:, None, None], other=0)
    s = tl.load(s4 + (kb // BKH) * (stride_st // 4), mask=n_ok, other=0)[:, None, None]
    if BKH == GROUP:  # MXFP4: one scale per half and tile
        b_lo = fp4_group_scale(s & 0xFF, smul, FMT).to(tl.bfloat16)
        b_hi = fp4_group_scale((s >> 16) & 0xFF, smul, FMT).to(tl.bfloat16)
    else:  # NVFP4: two groups of 16 per half and tile
        first = oe < GROUP
        b_lo = tl.where(first, fp4_group_scale(s & 0xFF, smul, FMT).to(tl.bfloat16),
                        fp4_group_scale((s >> 8) & 0xFF, smul, FMT).to(tl.bfloat16))
        b_hi = tl.where(first, fp4_group_scale((s >> 16) & 0xFF, smul, FMT).to(tl.bfloat16),
                        fp4_group_scale((s >> 24) & 0xFF, smul, FMT).to(tl.bfloat16))
    b_lo = tl.broadcast_to(b_lo, (BLOCK_N, 1, BKH))
    b_hi = tl.broadcast_to(b_hi, (BLOCK_N, 1, BKH))
    xl = tl.broadcast_to(x_lo, (BLOCK_N, 1, BKH))
    xh = tl.broadcast_to(x_hi, (BLOCK_N, 1, BKH))
    return tl.inline_asm_elementwise(_FP4_ASM_MMA, _MMA_CONS,
                                     [q, b_lo, b_hi, xl, xh, acc], dtype=tl.float32, is_pure=True, pack=8)


@triton.jit
def _step_portable(w, s4, kb, n_ok, x_lo, x_hi, acc, smul, stride_wt, stride_st, FMT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BKH: tl.constexpr, GROUP: tl.constexpr):
    """acc += one K tile times the activations, fp32 [BLOCK_N, BKH/GROUP, GROUP], without inline PTX
    (the CPU interpreter cannot run it; MoEConfig.asm=False)."""
    NG: tl.constexpr = BKH // GROUP
    og = tl.arange(0, NG)[None, :, None]
    oe = tl.arange(0, GROUP)[None, None, :]
    q = tl.load(w[:, :, None] + (kb // BKH) * stride_wt + og * GROUP + oe, mask=n_ok[:, None, None], other=0)
    # the row's 4 scale bytes as one int32 (lo0, lo1, hi0, hi1; MXFP4: lo, 0, hi, 0)
    s = tl.load(s4 + (kb // BKH) * (stride_st // 4), mask=n_ok, other=0)
    if NG == 1:
        f_lo = fp4_group_scale(s & 0xFF, smul, FMT)[:, None]
        f_hi = fp4_group_scale((s >> 16) & 0xFF, smul, FMT)[:, None]
    else:
        f_lo = tl.join(fp4_group_scale(s & 0xFF, smul, FMT), fp4_group_scale((s >> 8) & 0xFF, smul, FMT))
        f_hi = tl.join(fp4_group_scale((s >> 16) & 0xFF, smul, FMT), fp4_group_scale((s >> 24) & 0xFF, smul, FMT))
    qi = q.to(tl.int32)   # (triton_decode.fp4_dequant's portable products, as fp32)
    lo = (e2m1_times_2pow_m14(qi & 15) * (f_lo[:, :, None] * 1.925929944387236e-34)).to(tl.bfloat16).to(tl.float32)
    hi = (e2m1_times_2pow_m14(qi >> 4) * (f_hi[:, :, None] * 1.925929944387236e-34)).to(tl.bfloat16).to(tl.float32)
    acc += lo * x_lo
    acc += hi * x_hi
    return acc


@triton.jit
def fp4_row_loop(a_row_ptr, w_g, s_g, w_u, s_u, HALF, n_ok, smul, stride_wt, stride_st,
                 FMT: tl.constexpr, BLOCK_N: tl.constexpr, BKH: tl.constexpr, GROUP: tl.constexpr,
                 ASM: tl.constexpr, GATED: tl.constexpr, PIPE: tl.constexpr):
    """One token row times BLOCK_N FP4 weight rows (gate and, GATED, up): fp32 ([BLOCK_N], [BLOCK_N]).
    s_g / s_u point at the rows' 4-byte scale entries (int32). Activations: one row slice per step,
    broadcast over the weight rows. ASM: mma.sync on the decoded tiles, two K tiles per iteration
    (loop overhead); otherwise the portable decode with fp32 products."""
    NG: tl.constexpr = BKH // GROUP
    if ASM:  # tensor cores, bf16 activations (8 bytes per thread: BLOCK_N * BKH == 8 * 32 * num_warps)
        kk = tl.arange(0, BKH)[None, None, :]
        acc_g = tl.zeros([BLOCK_N, 1, BKH], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, 1, BKH], dtype=tl.float32)
        for kb in tl.range(0, HALF, 2 * BKH, num_stages=PIPE):
            x_lo = tl.load(a_row_ptr + kb + kk).to(tl.bfloat16)
            x_hi = tl.load(a_row_ptr + HALF + kb + kk).to(tl.bfloat16)
            acc_g = _step_mma(w_g, s_g, kb, n_ok, x_lo, x_hi, acc_g, smul, stride_wt, stride_st, FMT, BLOCK_N,
                              BKH, GROUP)
            if GATED:
                acc_u = _step_mma(w_u, s_u, kb, n_ok, x_lo, x_hi, acc_u, smul, stride_wt, stride_st, FMT,
                                  BLOCK_N, BKH, GROUP)
            k2 = kb + BKH
            ok2 = n_ok & ((n_ok.to(tl.int32) * 0 + k2) < HALF)
            more = (kk + k2) < HALF
            x_lo = tl.load(a_row_ptr + k2 + kk, mask=more, other=0.0).to(tl.bfloat16)
            x_hi = tl.load(a_row_ptr + HALF + k2 + kk, mask=more, other=0.0).to(tl.bfloat16)
            acc_g = _step_mma(w_g, s_g, k2, ok2, x_lo, x_hi, acc_g, smul, stride_wt, stride_st, FMT, BLOCK_N,
                              BKH, GROUP)
            if GATED:
                acc_u = _step_mma(w_u, s_u, k2, ok2, x_lo, x_hi, acc_u, smul, stride_wt, stride_st, FMT,
                                  BLOCK_N, BKH, GROUP)
        acc_g = tl.inline_asm_elementwise(_FP4_MMA_OUT, _MMA_OUT_CONS, [acc_g], dtype=tl.float32,
                                          is_pure=True, pack=8)
        acc_u = tl.inline_asm_elementwise(_FP4_MMA_OUT, _MMA_OUT_CONS, [acc_u], dtype=tl.float32,
                                          is_pure=True, pack=8)
    else:
        kk = tl.arange(0, NG)[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
        acc_g = tl.zeros([BLOCK_N, NG, GROUP], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, NG, GROUP], dtype=tl.float32)
        for kb in tl.range(0, HALF, BKH, num_stages=PIPE):
            x_lo = tl.load(a_row_ptr + kb + kk).to(tl.float32)
            x_hi = tl.load(a_row_ptr + HALF + kb + kk).to(tl.float32)
            acc_g = _step_portable(w_g, s_g, kb, n_ok, x_lo, x_hi, acc_g, smul, stride_wt, stride_st, FMT,
                                   BLOCK_N, BKH, GROUP)
            if GATED:
                acc_u = _step_portable(w_u, s_u, kb, n_ok, x_lo, x_hi, acc_u, smul, stride_wt, stride_st, FMT,
                                       BLOCK_N, BKH, GROUP)
    return tl.sum(tl.sum(acc_g, axis=2), axis=1), tl.sum(tl.sum(acc_u, axis=2), axis=1)
