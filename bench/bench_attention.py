"""Paged decode attention (moe_kernels.attention_decode) on the issue-28 grid: batch 1/8/64 x context
1k/8k/32k, MLA (DeepSeek-V3: latent 512 + rope 64) at 128 and 16 heads, GQA gpt-oss-120b (64 q / 8 kv
x 64) and Qwen3-30B (32 q / 4 kv x 128); bf16 cache, block 16, shuffled block tables. Per cell: us
(median of CUDA-graph replays; each replay runs the kernel over several disjoint block tables so the
cache is not L2-resident), GB/s of KV read once, the roofline max(KV bytes / measured copy bandwidth,
FLOPs / measured bf16 matmul peak) and our ratio to it, max error vs the torch reference (on up to 4
sequences). The old kernel's numbers (one program per head, no split) are the issue's table.

PYTHONPATH=kernels python bench/bench_attention.py [--json out.json] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from moe_kernels import attention_decode as ad
from moe_kernels.paged_attention import paged_attention_gqa_ref, paged_attention_mla_ref

SHAPES = {"mla128": ("mla", 128), "mla16": ("mla", 16), "gptoss": ("gqa", 64, 8, 64), "qwen3": ("gqa", 32, 4, 128)}
OLD_US = {("mla128", 1, 1024): 259, ("mla128", 1, 32768): 8200, ("mla128", 8, 8192): 11900, ("mla128", 64, 8192): 94000,
          ("gptoss", 1, 1024): 116, ("gptoss", 1, 32768): 3500, ("gptoss", 8, 8192): 990, ("gptoss", 64, 8192): 6600,
          ("qwen3", 1, 1024): 152, ("qwen3", 1, 32768): 4700, ("qwen3", 8, 8192): 1200, ("qwen3", 64, 8192): 6000}


def ceilings():
    x = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")  # 512 MiB
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    bw = 2 * x.numel() / (t * 1e-3)
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    b = torch.randn(8192, 8192, device="cuda").bfloat16()
    t = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return bw, 2 * 8192 ** 3 / (t * 1e-3)


def cell(shape, B, ctx, bw, peak, config=None, check=True):
    spec = SHAPES[shape]
    bs, nb = 16, ctx // 16
    if spec[0] == "mla":
        H, C, R = spec[1], 512, 64
        tok_bytes, flops_tok = (C + R) * 2, H * 2 * (C + R + C)
    else:
        H, kvh, d = spec[1:]
        tok_bytes, flops_tok = kvh * d * 2 * 2, H * 2 * 2 * d
    kv_bytes = B * ctx * tok_bytes
    rot = max(1, min(16, -(-(256 << 20) // kv_bytes)))  # disjoint block tables per replay: >= 256 MiB touched
    NB = B * nb * rot
    g = torch.Generator(device="cuda").manual_seed(0)
    perm = torch.randperm(NB, device="cuda", generator=g).view(rot, B, nb).int()
    lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    if spec[0] == "mla":
        ckv = torch.randn(NB, bs, C, device="cuda", generator=g).bfloat16()
        kr = torch.randn(NB, bs, R, device="cuda", generator=g).bfloat16()
        qa = (torch.randn(B, H, C, device="cuda", generator=g) / C ** 0.5).bfloat16()
        qr = torch.randn(B, H, R, device="cuda", generator=g).bfloat16()
        fn = lambda bt: ad.decode_mla(qa, qr, ckv, kr, bt, lens, 192 ** -0.5, None, config)  # noqa: E731
        ref = lambda n: paged_attention_mla_ref(qa[:n, None], qr[:n, None], ckv, kr, perm[0, :n], (lens[:n] - 1)[:, None],  # noqa: E731
                                                ctx, 192 ** -0.5)[:, 0]
    else:
        k = torch.randn(NB, bs, kvh, d, device="cuda", generator=g).bfloat16()
        v = torch.randn(NB, bs, kvh, d, device="cuda", generator=g).bfloat16()
        q = torch.randn(B, H, d, device="cuda", generator=g).bfloat16()
        s = torch.randn(H, device="cuda", generator=g) if shape == "gptoss" else None
        fn = lambda bt: ad.decode_gqa(q, k, v, bt, lens, d ** -0.5, s, None, None, config)  # noqa: E731
        ref = lambda n: paged_attention_gqa_ref(q[:n, None], k, v, perm[0, :n], (lens[:n] - 1)[:, None], ctx,  # noqa: E731
                                                d ** -0.5, s)[:, 0]
    err = None
    if check:
        n = min(B, 4)
        err = float((fn(perm[0])[:n].float() - ref(n).float()).abs().max() / ref(n).float().abs().max())
    for i in range(rot):
        fn(perm[i])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(rot):
            fn(perm[i])
    t = triton.testing.do_bench(graph.replay, warmup=20, rep=150, return_mode="median") / rot
    del graph
    us = t * 1e3
    roof = max(kv_bytes / bw, B * ctx * flops_tok / peak) * 1e6
    return {"shape": shape, "batch": B, "ctx": ctx, "us": us, "GBps": kv_bytes / (us * 1e-6) / 1e9,
            "roofline_us": roof, "ratio": us / roof, "bound": "flops" if B * ctx * flops_tok / peak > kv_bytes / bw else "bytes",
            "max_rel_err": err, "old_us": OLD_US.get((shape, B, ctx)), "config": config}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true", help="also time candidate kernel configs on a few cells")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--ctxs", default="1024,8192,32768")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    t0 = time.time()
    bw, peak = ceilings()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    rows, sweep = [], []
    for shape in a.shapes.split(","):
        for B in map(int, a.batches.split(",")):
            for ctx in map(int, a.ctxs.split(",")):
                r = cell(shape, B, ctx, bw, peak)
                rows.append(r)
                print(f"{shape:7s} B={B:3d} ctx={ctx:6d} {r['us']:9.1f} us {r['GBps']:7.0f} GB/s roof {r['roofline_us']:8.1f} us "
                      f"({r['bound']}) x{r['ratio']:5.2f} err {r['max_rel_err']:.1e}"
                      + (f" old {r['old_us']} us" if r["old_us"] else ""), flush=True)
                torch.cuda.empty_cache()
    if a.sweep:
        cands = {"mla128": [(64, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (64, 16, 4, 3), (128, 32, 8, 2)],
                 "mla16": [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 8, 3), (16, 128, 8, 2)],
                 "gptoss": [(32, 4, 3), (64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 4, 4)],
                 "qwen3": [(32, 4, 3), (64, 4, 3), (128, 8, 3), (64, 8, 3)]}
        for shape, cs in cands.items():
            for B, ctx in ((1, 32768), (64, 8192)):
                for c in cs:
                    try:
                        r = cell(shape, B, ctx, bw, peak, c, check=False)
                    except Exception as e:  # a config the compiler refuses (shared memory)
                        r = {"shape": shape, "batch": B, "ctx": ctx, "config": c, "error": str(e)[:200]}
                    sweep.append(r)
                    print("sweep", shape, B, ctx, c, f"{r.get('us', float('nan')):.1f} us x{r.get('ratio', float('nan')):.2f}",
                          r.get("error", ""), flush=True)
                    torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_Bps": bw, "bf16_flops": peak, "rows": rows, "sweep": sweep, "seconds": time.time() - t0}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
