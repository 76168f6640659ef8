"""The tile kernel: one expert block of token rows x a weight-row tile per program, bf16 tensor-core
tiles (tl.dot) on weights dequantised in registers (triton_decode.py), or the one-row FP4 decode
loop (triton_row.py). Storage: triton_layout.py; configs: triton_config.GemmConfig.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_decode import dense_tile, fp4_dequant
from .triton_frag import gated_activation, grouped_block
from .triton_row import fp4_row_loop


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    # F32: the CPU interpreter multiplies bf16 dot operands wrongly (Triton 3.9): fp32 copies there
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
def _fp4_load(w_base, s_base, kb, ok, stride_wt, stride_st, BKH: tl.constexpr, GROUP: tl.constexpr):
    """Raw bytes of one split-half FP4 tile in the K-tiled layout (triton_layout): packed
    [BLOCK_N, BKH/GROUP, GROUP] (one contiguous BLOCK_N*BKH-byte block), scales of the low and the
    high half [BLOCK_N, BKH/GROUP] (bytes 0-1 and 2-3 of the row's 4-byte scale entry).
    `ok` masks rows (and, for the prefetch past the end, everything)."""
    NG: tl.constexpr = BKH // GROUP
    og = tl.arange(0, NG)[None, :, None]
    oe = tl.arange(0, GROUP)[None, None, :]
    q = tl.load(w_base[:, :, None] + (kb // BKH) * stride_wt + og * GROUP + oe, mask=ok[:, None, None], other=0)
    s_lo = tl.load(s_base + (kb // BKH) * stride_st + tl.arange(0, NG)[None, :], mask=ok[:, None], other=0)
    s_hi = tl.load(s_base + (kb // BKH) * stride_st + 2 + tl.arange(0, NG)[None, :], mask=ok[:, None], other=0)
    return q, s_lo, s_hi


@triton.jit
def _fp4_accumulate(a_lo, a_hi, q, s_lo, s_hi, smul, acc, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                    BKH: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr, SWAP: tl.constexpr,
                    F32: tl.constexpr):
    """acc += the activations' two K halves times one decoded split-half tile."""
    lo, hi = fp4_dequant(q, s_lo, s_hi, smul, FMT, BLOCK_N, BKH, GROUP, ASM)
    lo = tl.reshape(lo, (BLOCK_N, BKH))
    hi = tl.reshape(hi, (BLOCK_N, BKH))
    out = _mma(a_lo, lo, acc, SWAP, F32)
    return _mma(a_hi, hi, out, SWAP, F32)


@triton.jit
def moe_gemm_kernel(
    a_ptr, stride_am,
    w_ptr, stride_we, stride_wn, stride_wt,
    s_ptr, stride_se, stride_sn, stride_st,
    p_ptr, stride_pe,
    c_ptr, stride_cm,
    sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
    N, K, num_pairs, up_offset, num_pid_m,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATED: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP: tl.constexpr, ASM: tl.constexpr, DOT_F32: tl.constexpr, ONE_ROW: tl.constexpr, PIPE: tl.constexpr,
    bias_ptr=None, stride_be=0, alpha=1.0, limit=0.0, BIAS: tl.constexpr = False, ACT: tl.constexpr = 0,
):
    """C[rows of one expert block, N tile] = A[rows] @ W[e]^T; GATED: act(A Wg^T, A Wu^T)
    (triton_frag.gated_activation: ACT 0 SiLU, 1 gpt-oss's clamped SwiGLU with alpha, limit).
    p_ptr: per-expert fp32 [gate multiplier, up multiplier, FP4 scale multiplier, -].
    BIAS: the expert's fp32 bias row (bias_ptr [E, N or N + up_offset], stride_be) added to the
    accumulators before the activation (bias_ptr: any tensor without BIAS)."""
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
    if ONE_ROW:  # FP4, BLOCK_M == 1
        smul = tl.load(p_ptr + e * stride_pe + 2)
        a_row_ptr = a_ptr + tl.sum(a_rows.to(tl.int64), axis=0) * stride_am
        # scale rows are 4 bytes (constexpr stride: aligned 4-byte cp.async)
        s_g4 = (s_ptr + e * stride_se).to(tl.pointer_type(tl.int32)) + rows_g
        s_u4 = (s_ptr + e * stride_se).to(tl.pointer_type(tl.int32)) + rows_u
        g, u = fp4_row_loop(a_row_ptr, w_g, s_g4, w_u, s_u4, K // 2, n_ok, smul, stride_wt, stride_st,
                            FMT, BLOCK_N, BLOCK_K // 2, GROUP, ASM, GATED, PIPE)
        acc_g = g[None, :]
        acc_u = u[None, :]
    elif FMT >= 2:
        smul = tl.load(p_ptr + e * stride_pe + 2)
        BKH: tl.constexpr = BLOCK_K // 2
        HALF = K // 2
        offs_b = tl.arange(0, BKH)[None, :]
        # Triton does not software-pipeline loads whose values go through ALU work before the dot, so
        # the next raw weight tile is prefetched by hand, one tile ahead
        a_lo = tl.load(a_base + offs_b, mask=row_ok[:, None], other=0.0)
        a_hi = tl.load(a_base + HALF + offs_b, mask=row_ok[:, None], other=0.0)
        qg, slg, shg = _fp4_load(w_g, s_g, 0, n_ok, stride_wt, stride_st, BKH, GROUP)
        qu, slu, shu = qg, slg, shg
        if GATED:
            qu, slu, shu = _fp4_load(w_u, s_u, 0, n_ok, stride_wt, stride_st, BKH, GROUP)
        for kb in range(0, HALF, BKH):
            nxt = kb + BKH
            ok_n = n_ok & ((offs_n * 0 + nxt) < HALF)  # tensor masks: interpreter-safe
            a_ok = row_ok[:, None] & ((offs_b + nxt) < HALF)
            a_lo_n = tl.load(a_base + nxt + offs_b, mask=a_ok, other=0.0)
            a_hi_n = tl.load(a_base + HALF + nxt + offs_b, mask=a_ok, other=0.0)
            qg_n, slg_n, shg_n = _fp4_load(w_g, s_g, nxt, ok_n, stride_wt, stride_st, BKH, GROUP)
            acc_g = _fp4_accumulate(a_lo, a_hi, qg, slg, shg, smul, acc_g, FMT, BLOCK_N, BKH, GROUP, ASM, SWAP,
                                    DOT_F32)
            qg, slg, shg = qg_n, slg_n, shg_n
            if GATED:
                qu_n, slu_n, shu_n = _fp4_load(w_u, s_u, nxt, ok_n, stride_wt, stride_st, BKH, GROUP)
                acc_u = _fp4_accumulate(a_lo, a_hi, qu, slu, shu, smul, acc_u, FMT, BLOCK_N, BKH, GROUP, ASM,
                                        SWAP, DOT_F32)
                qu, slu, shu = qu_n, slu_n, shu_n
            a_lo, a_hi = a_lo_n, a_hi_n
    else:
        offs_k = tl.arange(0, BLOCK_K)[None, :]
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_base + k0 + offs_k, mask=row_ok[:, None], other=0.0)
            acc_g = _mma(a, dense_tile(w_g, s_g, k0, n_ok, FMT, BLOCK_K), acc_g, SWAP, DOT_F32)
            if GATED:
                acc_u = _mma(a, dense_tile(w_u, s_u, k0, n_ok, FMT, BLOCK_K), acc_u, SWAP, DOT_F32)

    if FMT >= 2:  # NVFP4 global scale (gate, up) / FP4 exponent offset 2^c, per expert
        acc_g = acc_g * tl.load(p_ptr + e * stride_pe)
        if GATED:
            acc_u = acc_u * tl.load(p_ptr + e * stride_pe + 1)
    if BIAS:
        b_row = bias_ptr + e * stride_be
        bg = tl.load(b_row + offs_n, mask=n_ok, other=0.0)
        if SWAP:
            acc_g += bg[:, None]
        else:
            acc_g += bg[None, :]
        if GATED:
            bu = tl.load(b_row + up_offset + offs_n, mask=n_ok, other=0.0)
            if SWAP:
                acc_u += bu[:, None]
            else:
                acc_u += bu[None, :]
    if GATED:
        out = gated_activation(acc_g, acc_u, ACT, alpha, limit)
    else:
        out = acc_g
    if SWAP:
        c = c_ptr + offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
        tl.store(c, out.to(c_ptr.dtype.element_ty), mask=n_ok[:, None])
    else:
        c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c, out.to(c_ptr.dtype.element_ty), mask=n_ok[None, :])
