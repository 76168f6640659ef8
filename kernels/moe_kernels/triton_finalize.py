"""Triton kernel for the fused MoE finalize (see finalize.py for the semantics).

One program per (token, chunk of H): the top_k row loads are unrolled and independent, so all of
them are in flight at once; 16-byte vector loads along H. This is a pure streaming kernel: its
floor is (T*K + 2*T) * H * 2 bytes over the copy bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _finalize_kernel(g_ptr, stride_g, w_ptr, perm_ptr, s_ptr, stride_s, out_ptr, stride_o, H, routed_scale,
                     TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched before the GEMM that writes gemm2_out has finished: wait for it first
        gdc_wait()
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = tl.load(perm_ptr + t * TOP_K + j)
        w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32) * routed_scale
        row = tl.load(g_ptr + p.to(tl.int64) * stride_g + offs, mask=hmask & (p >= 0), other=0.0)
        acc += tl.where(p >= 0, w, 0.0) * row.to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    if HAS_SHARED:
        acc += tl.load(s_ptr + t.to(tl.int64) * stride_s + offs, mask=hmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(tl.bfloat16), mask=hmask)


def finalize_triton(gemm2_out: torch.Tensor, expert_weights: torch.Tensor, perm: torch.Tensor,
                    shared_output: torch.Tensor | None, routed_scale: float, pdl: bool = False) -> torch.Tensor:
    t, k = expert_weights.shape
    h = shared_output.shape[1] if shared_output is not None else gemm2_out.shape[1]
    out = torch.empty(t, h, dtype=torch.bfloat16, device=gemm2_out.device)
    if t == 0:
        return out
    if gemm2_out.stride(1) != 1:
        gemm2_out = gemm2_out.contiguous()
    w = expert_weights.contiguous()
    perm = perm.contiguous()
    shared = shared_output if shared_output is not None else out
    if shared.stride(1) != 1:
        shared = shared.contiguous()
    # 1024 bf16 per program = 4 warps x 32 lanes x 8 elements (one 16-byte load each).
    block_h = min(1024, triton.next_power_of_2(h))
    grid = (t, triton.cdiv(h, block_h))
    _finalize_kernel[grid](gemm2_out, gemm2_out.stride(0), w, perm, shared, shared.stride(0), out, out.stride(0),
                           h, routed_scale, TOP_K=k, HAS_SHARED=shared_output is not None, BLOCK_H=block_h,
                           PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out
