"""Prefill-grade FP4 grouped GEMM (W4A16) for large batches: persistent programs over (expert block,
N tile) in grouped order, bf16 tensor-core tiles (tl.dot: wgmma on SM90) on NVFP4 / MXFP4 weights
decoded in registers (triton_decode.fp4_dequant), reading the tile kernel's K-tiled storage
(triton_layout) several 32-byte K tiles per step.

Differences from the tile kernel (triton_tile.py), each for the MMA's sake:
- gate and up in ONE accumulator: an N tile is BLOCK_N/2 gate rows and the matching BLOCK_N/2 up
  rows (loaded from both row ranges), split in the epilogue; one dot per K half instead of two, half
  the accumulator registers per output column block.
- K steps of BKH packed bytes (2 * BKH weights, BKH / 32 K tiles), so each dot has K = BKH.
- no masks in the K loop (K / 2 is a multiple of BKH; rows past N read row 0 and are not stored;
  padding token rows read row 0 of the activations): loads Triton's pipeliner can stage as they are.
- persistent: grid = min(tiles, programs) with the tile count read on the device (num_post_pad),
  so no program is launched for the host-side worst-case block count.
Which batches use it: triton_config.default_config (PrefillConfig); numbers: bench/README.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_decode import fp4_dequant
from .triton_frag import gated_activation, grouped_block
from .triton_tile import _mma


@triton.jit
def _step_scales(sw, FMT: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr):
    """Scale words [BLOCK_N, NT] (int32: bytes 0-1 low-half groups, 2-3 high-half groups of a K tile)
    -> scale bytes of the low and high halves [BLOCK_N, NG], NG groups per step in K order."""
    if FMT == 2:   # NVFP4: two 16-groups per half and tile
        lo = tl.reshape(tl.join(sw & 255, (sw >> 8) & 255), (BLOCK_N, NG))
        hi = tl.reshape(tl.join((sw >> 16) & 255, (sw >> 24) & 255), (BLOCK_N, NG))
    else:          # MXFP4: one 32-group per half and tile (bytes 1 and 3 are zero)
        lo = sw & 255
        hi = (sw >> 16) & 255
    return lo, hi


@triton.jit
def prefill_gemm_kernel(
    a_ptr, stride_am,
    w_ptr, stride_we, stride_wt,
    s_ptr, stride_se, stride_st,
    p_ptr, stride_pe,
    c_ptr, stride_cm,
    sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
    N, K, num_pairs, up_offset, num_progs,
    bias_ptr, stride_be, alpha, limit,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATED: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKH: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP: tl.constexpr, ASM: tl.constexpr, DOT_F32: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr,
    FLATTEN: tl.constexpr = False, WS: tl.constexpr = False,
):
    """C[expert block rows, N tile] = A[rows] @ W[e]^T (GATED: act(gate, up), BLOCK_N/2 output
    columns per tile). w_ptr: uint8 [E, K/64, N_rows, 32] (row stride 32); s_ptr: int32 [E, K/64,
    N_rows] (one scale word per row and K tile); p_ptr: fp32 [E, 4] (gate / up multipliers, scale
    multiplier); BIAS: fp32 bias_ptr [E, N_rows] added before the activation."""
    HALF = K // 2
    NT: tl.constexpr = BKH // 32
    NG: tl.constexpr = BKH // GROUP
    if GATED:
        BN_OUT: tl.constexpr = BLOCK_N // 2
    else:
        BN_OUT: tl.constexpr = BLOCK_N
    num_pid_n = tl.cdiv(N, BN_OUT)
    num_pid_m = tl.load(num_post_pad_ptr) // BLOCK_M
    num_tiles = num_pid_m * num_pid_n

    j = tl.arange(0, BLOCK_N)
    jo = j % BN_OUT
    kk = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]   # [NG, GROUP]: byte of the step
    woff = (kk // 32) * stride_wt + kk % 32
    toff = tl.arange(0, NT) * stride_st
    offs_k = tl.arange(0, BKH)[None, :]

    # FLATTEN: Triton pipelines across tiles (the next tile's loads under this one's epilogue);
    # WS: Triton's warp specialisation of the K loop (loads in producer warps). Both A/B knobs.
    for tile in tl.range(tl.program_id(0), num_tiles, num_progs, flatten=FLATTEN):
        pid_m, pid_n = grouped_block(tile, num_pid_m, num_pid_n, GROUP_M)
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if GATHER_A:
            pair = tl.load(sorted_ids_ptr + offs_m)
            a_rows = tl.where(pair < num_pairs, pair // TOP_K, 0)
        else:
            a_rows = offs_m
        a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
        col = pid_n * BN_OUT + jo
        n_ok = col < N
        wrow = col
        if GATED:
            wrow = col + (j >= BN_OUT).to(tl.int32) * up_offset
        wrow = tl.where(n_ok, wrow, 0)
        w_rows = w_ptr + e * stride_we + wrow.to(tl.int64) * 32
        s_rows = s_ptr + e * stride_se + wrow
        smul = tl.load(p_ptr + e * stride_pe + 2)
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in tl.range(0, HALF, BKH, warp_specialize=WS):
            kt = kb // 32
            q = tl.load(w_rows[:, None, None] + kt * stride_wt + woff[None, :, :])
            sw = tl.load(s_rows[:, None] + kt * stride_st + toff[None, :])
            a_lo = tl.load(a_base + kb + offs_k)
            a_hi = tl.load(a_base + HALF + kb + offs_k)
            s_lo, s_hi = _step_scales(sw, FMT, BLOCK_N, NG)
            lo, hi = fp4_dequant(q, s_lo, s_hi, smul, FMT, BLOCK_N, BKH, GROUP, ASM)
            acc = _mma(a_lo, tl.reshape(lo, (BLOCK_N, BKH)), acc, SWAP, DOT_F32)
            acc = _mma(a_hi, tl.reshape(hi, (BLOCK_N, BKH)), acc, SWAP, DOT_F32)

        # per-column multipliers (NVFP4 global scale of gate / up, the FP4 exponent offset), bias
        pg = tl.load(p_ptr + e * stride_pe)
        mul = pg + tl.zeros([BLOCK_N], dtype=tl.float32)
        if GATED:
            mul = tl.where(j >= BN_OUT, tl.load(p_ptr + e * stride_pe + 1), mul)
        if SWAP:
            acc = acc * mul[:, None]
        else:
            acc = acc * mul[None, :]
        if BIAS:
            b = tl.load(bias_ptr + e * stride_be + wrow, mask=n_ok, other=0.0)
            if SWAP:
                acc += b[:, None]
            else:
                acc += b[None, :]
        cols = pid_n * BN_OUT + tl.arange(0, BN_OUT)
        if GATED:
            if SWAP:   # [BLOCK_N, BM]: gate rows first
                g, u = tl.split(tl.permute(tl.reshape(acc, (2, BN_OUT, BLOCK_M)), (1, 2, 0)))
            else:
                g, u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BN_OUT)), (0, 2, 1)))
            out = gated_activation(g, u, ACT, alpha, limit)
        else:
            out = acc
        if SWAP:
            c = c_ptr + offs_m.to(tl.int64)[None, :] * stride_cm + cols[:, None]
            tl.store(c, out.to(c_ptr.dtype.element_ty), mask=(cols < N)[:, None])
        else:
            c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + cols[None, :]
            tl.store(c, out.to(c_ptr.dtype.element_ty), mask=(cols < N)[None, :])


def check_config(fmt: str, gated: bool, block_n: int, swap: bool) -> None:
    """Refuse the combination measured wrong: MXFP4 gate/up with swap at 256 weight rows gave rel err
    1.1e-2 / 2.8e-2 against the torch reference on the H200 (Triton 3.6; NVFP4 with the same config,
    and MXFP4 at 128 rows or without swap: 4.6e-3), 2026-12-02. The CPU interpreter computes that
    config right (7e-3 against the reference), so the fault is in the GPU build; cause not found."""
    if fmt == "mxfp4" and gated and swap and block_n >= 256:
        raise ValueError("prefill kernel: MXFP4 gate/up with swap at block_n >= 256 computes wrong results "
                         "(measured on the H200); use block_n=128 or swap=False")


def step_bytes(half: int, want: int) -> int:
    """Packed bytes per K step: the largest power of two <= want (>= 32) dividing K / 2."""
    b = max(32, want)
    while b > 32 and half % b:
        b //= 2
    if half % b:
        raise ValueError(f"the prefill kernel needs K to be a multiple of 64, got {2 * half}")
    return b
