"""In-register weight decode of the tile kernel (triton_tile.py) and the one-row loop (triton_row.py).

Without lookup tables: an E2M1 code c placed as bf16 bits (c & 8) << 12 | (c & 7) << 6 is exactly
value * 2^-126 (e=0 codes are bf16 subnormals, which fma.rn.bf16x2 keeps), so one bf16x2 FMA by
S = scale * 2^(126-c) gives the exact weight * 2^-c, two per instruction (inline PTX, _FP4_ASM; e2m1 *
e4m3/e8m0 has at most 6 significant bits). c is a per-expert exponent offset applied to the fp32
accumulator (triton_layout.prepare). The portable path (CPU interpreter, MoEConfig.asm=False)
computes the same products in fp32 via fp16 bit patterns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import fp4_ptx as ptx


@triton.jit
def e2m1_times_2pow_m14(code):
    """int32 E2M1 code (0..15) -> fp32 value * 2^-14, exact."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_times_2pow_m8(b):
    """int32 float8_e4m3fn bit pattern (0..255) -> fp32 value * 2^-8, exact (NaN not handled)."""
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp4_group_scale(s, smul, FMT: tl.constexpr):
    """uint8 block scale -> fp32 S = scale * smul, where smul = 2^(126 - c) folds in the 2^126 that the
    in-register E2M1 decode leaves out (c is applied to the accumulator instead)."""
    s = s.to(tl.int32)
    if FMT == 2:  # NVFP4: e4m3
        base = _e4m3_times_2pow_m8(s) * 256.0
    else:  # MXFP4: E8M0, 2^(s-127); s == 0 (2^-127) decodes to 0
        base = (s << 23).to(tl.float32, bitcast=True)
    return base * smul


# E2M1 -> bf16 for four packed bytes at once, two values per 32-bit register. prmt spreads bytes 0,1
# (2,3) into the two 16-bit halves; the low nibble needs shifts 6 (exponent and mantissa bits) and 12
# (sign), the high nibble 2 and 8. About 3 instructions per weight.
_PRMT = ("prmt.b32 t0, {q}, 0, 0x4140;", "prmt.b32 t1, {q}, 0, 0x4342;")   # bytes 0,1 / 2,3 -> halves
_FP4_ASM = tl.constexpr(ptx.block("t0, t1, a, b, z", [p.format(q="$4") for p in _PRMT]
                                  + ptx.pair_shift("$0", "t0", False, "$5") + ptx.pair_shift("$1", "t1", False, "$6")
                                  + ptx.pair_shift("$2", "t0", True, "$7") + ptx.pair_shift("$3", "t1", True, "$8")))


@triton.jit
def fp4_dequant(q, s_lo, s_hi, smul, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BKH: tl.constexpr,
                GROUP: tl.constexpr, ASM: tl.constexpr):
    """bf16 (lo, hi) [BLOCK_N, BKH/GROUP, GROUP] of a raw split-half tile q with its scale bytes
    s_lo / s_hi [BLOCK_N, BKH/GROUP], each weight * 2^-c."""
    NG: tl.constexpr = BKH // GROUP
    f_lo = fp4_group_scale(s_lo, smul, FMT)[:, :, None]
    f_hi = fp4_group_scale(s_hi, smul, FMT)[:, :, None]
    if ASM:
        b_lo = tl.broadcast_to(f_lo.to(tl.bfloat16), (BLOCK_N, NG, GROUP))
        b_hi = tl.broadcast_to(f_hi.to(tl.bfloat16), (BLOCK_N, NG, GROUP))
        lo, hi = tl.inline_asm_elementwise(_FP4_ASM, "=r,=r,=r,=r,r,r,r,r,r", [q, b_lo, b_hi],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        qi = q.to(tl.int32)   # (the same products in fp32; inlined: a helper call changed the schedule)
        lo = (e2m1_times_2pow_m14(qi & 15) * (f_lo * 1.925929944387236e-34)).to(tl.bfloat16)  # * 2^-112
        hi = (e2m1_times_2pow_m14(qi >> 4) * (f_hi * 1.925929944387236e-34)).to(tl.bfloat16)
    return lo, hi


@triton.jit
def dense_tile(w_base, s_base, k0, n_ok, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """bf16 [BLOCK_N, BLOCK_K] weight tile for bf16 or fp8-block storage (s_base: per-row scale ptrs)."""
    w = tl.load(w_base + k0 + tl.arange(0, BLOCK_K)[None, :], mask=n_ok[:, None], other=0)
    if FMT == 1:
        sc = tl.load(s_base + k0 // 128, mask=n_ok[:, None], other=0.0) * 256.0
        w = (_e4m3_times_2pow_m8(w.to(tl.int32)) * sc).to(tl.bfloat16)
    return w
