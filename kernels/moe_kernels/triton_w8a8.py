"""FP8 block W8A8 experts (issue 29 item 3): FP8 e4m3 weights with 128 x 128 block scales (the
DeepSeek-V3 / Qwen3 FP8 checkpoints), activations quantized to e4m3 per token and 128-wide K group
inside the GEMM's own loads (no separate quantization pass: GEMM1 quantizes the gathered x rows,
GEMM2 the bf16 intermediate), FP8 tensor-core dots (tl.dot on e4m3: wgmma on SM90, mma on SM89).

Numerics (reference.act_fp8_roundtrip is the definition): per row and 128-group, s = max|a| / 448
(at least 1e-10), q = e4m3(a / s); each K step adds dot(q, w) * s * w_scale to the fp32 accumulator.
Opt-in: TritonExperts(act_quant="fp8"), since it is lossy against the exact W8A16 path.

Tile structure as the prefill kernel (triton_prefill.py): gate and up rows in one accumulator, split
in the epilogue; persistent programs over (expert block, N tile). The activations are the MMA's
register operand (quantized in registers), the weights its shared-memory operand, loaded as they are.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_frag import gated_activation, grouped_block

FP8_MAX = 448.0
GROUP_K = 128


@triton.jit
def _e4m3_grid(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value (ties to even), as fp32: the CPU
    interpreter's fp32 -> e4m3 cast drops the carry into the exponent (-1.97 -> -1.0, Triton 3.9)."""
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    qe = tl.maximum(e, -6) - 3                      # 3 mantissa bits; subnormals below 2^-6
    quantum = ((qe + 127) << 23).to(tl.float32, bitcast=True)
    r = x / quantum
    r = (r + 12582912.0) - 12582912.0               # 1.5 * 2^23: round half to even in fp32
    return r * quantum


@triton.jit
def _quant_rows(a, EMULATE: tl.constexpr):
    """[BM, 128] fp32 -> (e4m3 [BM, 128] (EMULATE: its values in fp32), fp32 scale [BM]): one scale
    per row of the group."""
    s = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10) / 448.0
    x = tl.clamp(a / s[:, None], -448.0, 448.0)
    if EMULATE:
        q = _e4m3_grid(x)
    else:
        q = x.to(tl.float8e4nv)
    return q, s


@triton.jit
def w8a8_gemm_kernel(
    a_ptr, stride_am,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    c_ptr, stride_cm,
    sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
    N, K, num_pairs, up_offset, num_progs,
    bias_ptr, stride_be, alpha, limit,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_F32: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr,
):
    """C[expert block rows, N tile] = q(A[rows]) @ W[e]^T with the block scales (GATED: act(gate, up)
    on BLOCK_N/2 output columns). w_ptr: uint8 (e4m3 bits) [E, N_rows, K]; s_ptr: fp32 [E, N_rows/128,
    K/128] (scale_inv); BIAS: fp32 bias_ptr [E, N_rows], added before the activation."""
    BK: tl.constexpr = 128
    if GATED:
        BN_OUT: tl.constexpr = BLOCK_N // 2
    else:
        BN_OUT: tl.constexpr = BLOCK_N
    num_pid_n = tl.cdiv(N, BN_OUT)
    num_pid_m = tl.load(num_post_pad_ptr) // BLOCK_M
    num_tiles = num_pid_m * num_pid_n
    j = tl.arange(0, BLOCK_N)
    jo = j % BN_OUT
    offs_k = tl.arange(0, BK)[None, :]

    for tile in tl.range(tl.program_id(0), num_tiles, num_progs):
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
        w_rows = w_ptr + e * stride_we + wrow.to(tl.int64)[:, None] * stride_wn
        s_rows = s_ptr + e * stride_se + (wrow // 128).to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_base + k0 + offs_k).to(tl.float32)
            w = tl.load(w_rows + k0 + offs_k).to(tl.float8e4nv, bitcast=True)
            ws = tl.load(s_rows + k0 // BK)
            q, s = _quant_rows(a, DOT_F32)
            if DOT_F32:   # the CPU interpreter: e4m3 values are exact in fp32
                part = tl.dot(q, tl.trans(w.to(tl.float32)))
            else:
                part = tl.dot(q, tl.trans(w))
            acc += part * s[:, None] * ws[None, :]

        if BIAS:
            acc += tl.load(bias_ptr + e * stride_be + wrow, mask=n_ok, other=0.0)[None, :]
        cols = pid_n * BN_OUT + tl.arange(0, BN_OUT)
        if GATED:
            g, u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BN_OUT)), (0, 2, 1)))
            out = gated_activation(g, u, ACT, alpha, limit)
        else:
            out = acc
        c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(c, out.to(c_ptr.dtype.element_ty), mask=(cols < N)[None, :])
