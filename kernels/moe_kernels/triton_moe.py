"""Triton MoE experts for SM90 (and any NVIDIA GPU Triton supports): weight-only, bf16 tensor-core math.

Pipeline per forward (4 launches + finalize):
  align (2 launches, triton_align.py) -> GEMM1 (gathered x @ [gate; up]^T, SiLU(gate)*up fused in the
  epilogue, rows in expert-padded order) -> GEMM2 (act @ w2^T, un-weighted rows = gemm2_out)
  -> finalize (weights, top-k sum, shared add; triton_finalize.py), or hand gemm2_out over (deferred).

Weights are dequantised in registers, tile by tile, to bf16 (exact for FP4: e2m1 * e4m3/e8m0 has at
most 6 significant bits), and the NVFP4 per-expert global scale is applied to the fp32 accumulator.

FP4 layout (re-packed once in __init__): "split-half" packing. Byte j of a row holds element j in its
low nibble and element K/2 + j in its high nibble, so one contiguous byte tile gives two contiguous
K ranges, each multiplied against a contiguous slice of the activations. No nibble interleaving is
needed in registers, and a 16-byte vector load covers exactly one NVFP4 scale group per half.

Decoding without lookup tables: an E2M1 code c placed as fp16 bits ((c & 8) << 12) | ((c & 7) << 9)
is exactly value * 2^-14 (e=0 codes land on fp16 subnormals, which convert to fp32 exactly); an e4m3
byte b as fp16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 7) is exactly value * 2^-8. The 2^14 and 2^8
are folded into the per-group scale, so each weight costs a few integer ops and one fp32 multiply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import formats as F
from .experts import ExpertWeights
from .finalize import DeferredMoEOutput, moe_finalize_fuse_shared
from .reference import _check_inputs
from .triton_align import align_by_expert

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
def _fp4_group_scale(s, FMT: tl.constexpr):
    """uint8 block scale -> fp32 multiplier for _e2m1_times_2pow_m14 values (includes 2^14)."""
    s = s.to(tl.int32)
    if FMT == 2:  # NVFP4: e4m3
        return _e4m3_times_2pow_m8(s) * 4194304.0  # 2^8 * 2^14
    else:  # MXFP4: E8M0, 2^(s-127); s == 0 (2^-127) decodes to 0
        return (s << 23).to(tl.float32, bitcast=True) * 16384.0


@triton.jit
def _fp4_tile(w_base, s_base, kb, HALF, n_ok, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BKH: tl.constexpr,
              GROUP: tl.constexpr):
    """Load and dequantise one split-half FP4 tile: bf16 (lo [BLOCK_N, BKH], hi [BLOCK_N, BKH])."""
    NG: tl.constexpr = BKH // GROUP
    og = tl.arange(0, NG)[None, :, None]
    oe = tl.arange(0, GROUP)[None, None, :]
    q = tl.load(w_base[:, :, None] + kb + og * GROUP + oe, mask=n_ok[:, None, None], other=0).to(tl.int32)
    s_lo = tl.load(s_base + kb // GROUP + tl.arange(0, NG)[None, :], mask=n_ok[:, None], other=0)
    s_hi = tl.load(s_base + (HALF + kb) // GROUP + tl.arange(0, NG)[None, :], mask=n_ok[:, None], other=0)
    lo = _e2m1_times_2pow_m14(q & 15) * _fp4_group_scale(s_lo, FMT)[:, :, None]
    hi = _e2m1_times_2pow_m14(q >> 4) * _fp4_group_scale(s_hi, FMT)[:, :, None]
    lo = tl.reshape(lo.to(tl.bfloat16), (BLOCK_N, BKH))
    hi = tl.reshape(hi.to(tl.bfloat16), (BLOCK_N, BKH))
    return lo, hi


@triton.jit
def _dense_tile(w_base, s_base, k0, n_ok, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """bf16 [BLOCK_N, BLOCK_K] weight tile for bf16 or fp8-block storage (s_base: per-row scale ptrs)."""
    w = tl.load(w_base + k0 + tl.arange(0, BLOCK_K)[None, :], mask=n_ok[:, None], other=0)
    if FMT == 1:
        sc = tl.load(s_base + k0 // 128, mask=n_ok[:, None], other=0.0) * 256.0
        w = (_e4m3_times_2pow_m8(w.to(tl.int32)) * sc).to(tl.bfloat16)
    return w


# The CPU interpreter (TRITON_INTERPRET=1, used to debug without a GPU) multiplies bf16 dot operands
# wrongly (Triton 3.9); there the dots run on fp32 copies. Never set on a GPU.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


# --------------------------------------------------------------------------------- kernel
@triton.jit
def _moe_gemm_kernel(
    a_ptr, stride_am,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    gs_ptr, stride_gse,
    c_ptr, stride_cm,
    sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
    N, K, num_pairs, up_offset, num_pid_m,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATED: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr,
):
    """C[rows of one expert block, N tile] = A[rows] @ W[e]^T; GATED: silu(A Wg^T) * (A Wu^T)."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Group GROUP_M row blocks (usually one expert) per column sweep so weight tiles are reused in L2.
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
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

    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FMT >= 2:
        BKH: tl.constexpr = BLOCK_K // 2
        HALF = K // 2
        offs_b = tl.arange(0, BKH)[None, :]
        for kb in range(0, HALF, BKH):
            a_lo = tl.load(a_base + kb + offs_b, mask=row_ok[:, None], other=0.0)
            a_hi = tl.load(a_base + HALF + kb + offs_b, mask=row_ok[:, None], other=0.0)
            lo, hi = _fp4_tile(w_g, s_g, kb, HALF, n_ok, FMT, BLOCK_N, BKH, GROUP)
            acc_g = _dot(a_lo, tl.trans(lo), acc_g, DOT_F32)
            acc_g = _dot(a_hi, tl.trans(hi), acc_g, DOT_F32)
            if GATED:
                lo, hi = _fp4_tile(w_u, s_u, kb, HALF, n_ok, FMT, BLOCK_N, BKH, GROUP)
                acc_u = _dot(a_lo, tl.trans(lo), acc_u, DOT_F32)
                acc_u = _dot(a_hi, tl.trans(hi), acc_u, DOT_F32)
    else:
        offs_k = tl.arange(0, BLOCK_K)[None, :]
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_base + k0 + offs_k, mask=row_ok[:, None], other=0.0)
            acc_g = _dot(a, tl.trans(_dense_tile(w_g, s_g, k0, n_ok, FMT, BLOCK_K)), acc_g, DOT_F32)
            if GATED:
                acc_u = _dot(a, tl.trans(_dense_tile(w_u, s_u, k0, n_ok, FMT, BLOCK_K)), acc_u, DOT_F32)

    if FMT == 2:  # NVFP4 per-expert global scales: [gate, up] (column 1 unused for w2)
        acc_g = acc_g * tl.load(gs_ptr + e * stride_gse)
        if GATED:
            acc_u = acc_u * tl.load(gs_ptr + e * stride_gse + 1)
    if GATED:
        out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        out = acc_g
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, out.to(tl.bfloat16), mask=n_ok[None, :])


# --------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 1


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    gemm1: GemmConfig
    gemm2: GemmConfig


def default_config(fmt: str, num_pairs: int, num_experts: int) -> MoEConfig:
    """Tile choice by rows per touched expert. Decode (<= 16 rows) is weight-streaming: narrow N tiles
    give every SM several programs and deep pipelines keep bytes in flight; large batches are
    compute-bound: wide M tiles reuse each dequantised weight tile across more rows."""
    rows = num_pairs / max(1, min(num_experts, num_pairs))
    fp4 = fmt in ("nvfp4", "mxfp4")
    bk = 256 if fp4 else 128
    if rows <= 16:
        g = GemmConfig(64, bk, 4, 4)
        return MoEConfig(16, g, g)
    if rows <= 48:
        g = GemmConfig(64, bk, 4, 4, 4)
        return MoEConfig(32, g, g)
    if rows <= 96:
        g = GemmConfig(64, 128, 4, 3, 8)
        return MoEConfig(64, g, g)
    return MoEConfig(128, GemmConfig(64, 128, 8, 3, 8), GemmConfig(128, 128, 8, 3, 8))


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
    w: torch.Tensor       # storage, [E, N, K'] (uint8 split-half, uint8 e4m3, or bf16)
    s: torch.Tensor       # block scales (uint8 [E, N, K/G] or fp32 [E, N/128, K/128]); dummy for bf16
    gs: torch.Tensor      # fp32 [E, 2] NVFP4 global scales (gate, up); dummy otherwise


def _prepare(t, fmt: str, shards: int) -> _Operand:
    if fmt == "bf16":
        w = t.contiguous()
        return _Operand(w, w, torch.ones(1, 2, dtype=torch.float32, device=w.device))
    if fmt == "fp8":
        w = t.weight.view(torch.uint8).contiguous()
        return _Operand(w, t.scale_inv.float().contiguous(), torch.ones(1, 2, dtype=torch.float32, device=w.device))
    w = _split_half_repack(t.packed.contiguous())
    if fmt == "nvfp4":
        s = t.block_scale.view(torch.uint8).contiguous()
        gs = t.global_scale.float().reshape(w.shape[0], -1)
        gs = gs.expand(-1, 2).contiguous() if gs.shape[1] == 1 else gs.contiguous()
        if gs.shape[1] != 2:
            raise ValueError(f"NVFP4 global scale must be [E] or [E, 2], got {tuple(t.global_scale.shape)}")
        return _Operand(w, s, gs)
    return _Operand(w, t.scale.contiguous(), torch.ones(1, 2, dtype=torch.float32, device=w.device))


class TritonExperts:
    """Weight-only (W4A16 / W8A16 / bf16) grouped-GEMM MoE experts in Triton. CUDA tensors only."""

    def __init__(self, weights: ExpertWeights, config: MoEConfig | None = None):
        if weights.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("TritonExperts needs the expert weights on a CUDA device")
        self.weights = weights
        self.fmt = weights.format
        self.fmt_id = _FMT_ID[weights.format]
        self.config = config
        e, h, i = weights.num_experts, weights.hidden_size, weights.intermediate_size
        self.E, self.H, self.I = e, h, i
        group = _GROUP[self.fmt_id]
        if self.fmt_id >= FMT_NVFP4 and ((h // 2) % group or (i // 2) % group):
            raise ValueError(f"{self.fmt} needs H/2 and I/2 to be multiples of {group} (H={h}, I={i})")
        self.w13 = _prepare(weights.w13, self.fmt, 2)
        self.w2 = _prepare(weights.w2, self.fmt, 1)

    def _launch(self, op: _Operand, a, c, al, n, k, cfg: GemmConfig, gather: bool, gated: bool, top_k: int,
                num_pairs: int):
        bk = _fit(k, cfg.block_k, 32 if self.fmt_id >= FMT_NVFP4 else 16)
        if self.fmt_id == FMT_FP8:
            bk = min(bk, 128)
        if self.fmt_id >= FMT_NVFP4:
            bk = max(bk, 2 * _GROUP[self.fmt_id])
            if (k // 2) % (bk // 2):
                raise ValueError(f"K={k} does not split into FP4 tiles of {bk}")
        bn = min(cfg.block_n, max(16, triton.next_power_of_2(n)))
        grid = (al.max_blocks * triton.cdiv(n, bn),)
        _moe_gemm_kernel[grid](
            a, a.stride(0),
            op.w, op.w.stride(0), op.w.stride(1),
            op.s, op.s.stride(0), op.s.stride(1),
            op.gs, op.gs.stride(0),
            c, c.stride(0),
            al.sorted_ids, al.expert_ids, al.num_post_pad,
            n, k, num_pairs, self.I if gated else 0, al.max_blocks,
            TOP_K=top_k, GATHER_A=gather, GATED=gated, FMT=self.fmt_id, GROUP=_GROUP[self.fmt_id],
            BLOCK_M=al.block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, DOT_F32=_INTERPRET,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                shared_output: torch.Tensor | None = None, routed_scale: float = 1.0,
                defer_finalize: bool = False):
        _check_inputs(x, topk_weights, topk_ids, self.H)
        t, top_k = topk_ids.shape
        num_pairs = t * top_k
        cfg = self.config or default_config(self.fmt, num_pairs, self.E)
        x = x.to(torch.bfloat16).contiguous()
        al = align_by_expert(topk_ids, self.E, cfg.block_m)
        inter = torch.empty(al.p_max, self.I, dtype=torch.bfloat16, device=x.device)
        gemm2_out = torch.empty(al.p_max, self.H, dtype=torch.bfloat16, device=x.device)
        if num_pairs:
            self._launch(self.w13, x, inter, al, self.I, self.H, cfg.gemm1, True, True, top_k, num_pairs)
            self._launch(self.w2, inter, gemm2_out, al, self.H, self.I, cfg.gemm2, False, False, top_k, num_pairs)
        if defer_finalize:
            return DeferredMoEOutput(gemm2_out, topk_weights, al.perm, float(routed_scale))
        return moe_finalize_fuse_shared(gemm2_out, topk_weights, al.perm, shared_output, float(routed_scale))

    __call__ = forward
