"""Fused MoE finalize (Triton) vs the unfused torch path, 4096 tokens, top-8, hidden 7168.

Unfused torch: gather the K rows per token, multiply by the weights, sum over K, add the shared
output (each step a pass over memory). Bytes counted for the floor: gemm2_out rows read once
(T*K*H), shared read (T*H), output written (T*H), all bf16.

  python bench/bench_finalize.py [--tokens 4096] [--topk 8] [--hidden 7168]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))

from moe_kernels.finalize import finalize_reference, moe_finalize_fuse_shared  # noqa: E402

DEV = "cuda"


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3


def unfused(gemm2_out, w, perm, shared, rs):
    t, k = w.shape
    rows = gemm2_out.index_select(0, perm.clamp(min=0).long()).view(t, k, -1)
    wk = torch.where(perm.view(t, k) >= 0, w.float() * rs, 0.0)
    return ((rows.float() * wk[..., None]).sum(1) + shared.float()).to(torch.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    args = ap.parse_args()
    t, k, h = args.tokens, args.topk, args.hidden
    n = 1 << 30
    a = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    bw = 2 * n * 2 / (triton.testing.do_bench(lambda: b.copy_(a), rep=100, return_mode="median") * 1e-3)
    del a, b
    p = t * k + 256 * 16  # padded rows as the experts kernel leaves them
    gemm2_out = torch.randn(p, h, device=DEV).to(torch.bfloat16)
    perm = torch.randperm(p, device=DEV)[: t * k].to(torch.int32)
    w = torch.rand(t, k, device=DEV)
    shared = torch.randn(t, h, device=DEV).to(torch.bfloat16)
    rs = 2.5
    fused_out = moe_finalize_fuse_shared(gemm2_out, w, perm, shared, rs)
    ref = finalize_reference(gemm2_out, w, perm, shared, rs)
    err = float((fused_out.float() - ref.float()).abs().max())
    t_fused = bench(lambda: moe_finalize_fuse_shared(gemm2_out, w, perm, shared, rs))
    t_unfused = bench(lambda: unfused(gemm2_out, w, perm, shared, rs))
    nbytes = (t * k * h + 2 * t * h) * 2
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; T={t} K={k} H={h}; bytes {nbytes / 1e6:.1f} MB; "
          f"max abs diff vs reference {err:.2e}")
    print("| path | time (us) | TB/s | % of copy BW | speedup |")
    print("|---|---|---|---|---|")
    for name, tt in (("fused Triton", t_fused), ("unfused torch", t_unfused)):
        print(f"| {name} | {tt * 1e6:.1f} | {nbytes / tt / 1e12:.2f} | {100 * nbytes / tt / bw:.1f}% | "
              f"{t_unfused / tt:.2f}x |")


if __name__ == "__main__":
    main()
