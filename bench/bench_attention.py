"""Paged decode attention (moe_kernels.attention_decode) on the issue-28 grid: batch 1/8/64 x context
1k/8k/32k, MLA (DeepSeek-V3: latent 512 + rope 64) at 128 and 16 heads, GQA gpt-oss-120b (64 q / 8 kv
x 64) and Qwen3-30B (32 q / 4 kv x 128); bf16 cache, block 16, shuffled block tables. Per cell: us
(median of CUDA-graph replays; each replay runs the kernel over several disjoint block tables so the
cache is not L2-resident), GB/s of KV read once, the roofline max(KV bytes / measured copy bandwidth,
FLOPs / measured bf16 matmul peak) and our ratio to it, max error vs the torch reference (on up to 4
sequences). The old kernel's numbers (one program per head, no split) are the issue's table.

--fp8: the same decode cells with an e4m3 cache (per-tensor scale): the byte roofline halves; error vs
the reference on the same fp8 cache and vs the bf16 cache (the quantization error).

--prefill: prefill/extend (moe_kernels.attention_prefill) over a paged bf16 cache: B rows of S new
tokens after a cached prefix of P tokens (P = 0: plain prefill; P > 0: chunked prefill / prefix hit).
Per cell: us, TFLOP/s of the visible (causal) score and P.V FLOPs, their ratio to the measured bf16
matmul peak, the torch reference (the padded path the models use today) in the same run where its
[B, h, S, L] fp32 scores fit in 4 GiB, and for prefix 0 without sinks torch's SDPA (flash) on dense
q/k/v as the peer. MLA runs the absorbed form (mla128/mla16) and the non-absorbed one (mla*-mha).

PYTHONPATH=kernels python bench/bench_attention.py [--json out.json] [--sweep] [--fp8] [--prefill] [--no-decode]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from moe_kernels import attention_decode as ad
from moe_kernels import attention_prefill as ap
from moe_kernels.paged_attention import paged_attention_gqa_ref, paged_attention_mla_ref, quantize_fp8

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


FP8_SCALE = 4.0 / 448  # randn values: |x| <= ~4 uses e4m3's range


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def cell(shape, B, ctx, bw, peak, config=None, check=True, fp8=False):
    spec = SHAPES[shape]
    bs, nb = 16, ctx // 16
    if spec[0] == "mla":
        H, C, R = spec[1], 512, 64
        tok_bytes, flops_tok = (C + R) * 2, H * 2 * (C + R + C)
    else:
        H, kvh, d = spec[1:]
        tok_bytes, flops_tok = kvh * d * 2 * 2, H * 2 * 2 * d
    if fp8:
        tok_bytes //= 2
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
        sc = FP8_SCALE if fp8 else 1.0
        c_, r_ = (quantize_fp8(ckv, sc), quantize_fp8(kr, sc)) if fp8 else (ckv, kr)
        fn = lambda bt: ad.decode_mla(qa, qr, c_, r_, bt, lens, 192 ** -0.5, None, config, kv_scale=sc)  # noqa: E731
        ref = lambda n, q8=True: paged_attention_mla_ref(  # noqa: E731
            qa[:n, None], qr[:n, None], c_ if q8 else ckv, r_ if q8 else kr, perm[0, :n], (lens[:n] - 1)[:, None], ctx,
            192 ** -0.5, sc if q8 else 1.0)[:, 0]
    else:
        k = torch.randn(NB, bs, kvh, d, device="cuda", generator=g).bfloat16()
        v = torch.randn(NB, bs, kvh, d, device="cuda", generator=g).bfloat16()
        q = torch.randn(B, H, d, device="cuda", generator=g).bfloat16()
        s = torch.randn(H, device="cuda", generator=g) if shape == "gptoss" else None
        sc = FP8_SCALE if fp8 else 1.0
        k_, v_ = (quantize_fp8(k, sc), quantize_fp8(v, sc)) if fp8 else (k, v)
        fn = lambda bt: ad.decode_gqa(q, k_, v_, bt, lens, d ** -0.5, s, None, None, config, sc, sc)  # noqa: E731
        ref = lambda n, q8=True: paged_attention_gqa_ref(  # noqa: E731
            q[:n, None], k_ if q8 else k, v_ if q8 else v, perm[0, :n], (lens[:n] - 1)[:, None], ctx, d ** -0.5, s, None,
            sc if q8 else 1.0, sc if q8 else 1.0)[:, 0]
    err = err_bf16 = None
    if check:
        n = min(B, 4)
        got = fn(perm[0])[:n]
        err = _rel(got, ref(n))
        if fp8:
            err_bf16 = _rel(got, ref(n, False))
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
            "max_rel_err": err, "fp8": fp8, "max_rel_err_vs_bf16": err_bf16,
            "old_us": None if fp8 else OLD_US.get((shape, B, ctx)), "config": config}


PREFILL_CELLS = ((1, 1024, 0), (1, 8192, 0), (8, 1024, 0), (1, 2048, 6144), (4, 512, 4096))
PREFILL_SHAPES = ("gptoss", "qwen3", "mla128", "mla16", "mla128-mha", "mla16-mha")


def prefill_cell(shape, B, S, P, peak, config=None):
    """B rows of S new tokens after P cached ones; FLOPs of the visible pairs (causal), the form's own."""
    kind = shape.split("-")[0]
    spec = SHAPES[kind]
    bs, L = 16, P + S
    nb = -(-L // bs)
    NB = B * nb + 7
    g = torch.Generator(device="cuda").manual_seed(1)
    bt = torch.randperm(NB, device="cuda", generator=g)[:B * nb].view(B, nb).int()
    pos = (P + torch.arange(S, device="cuda"))[None].expand(B, -1).contiguous()
    pairs = B * (S * P + S * (S + 1) // 2)
    sdpa, extra = None, {}
    if spec[0] == "mla":
        H, C, R, nope, vd = spec[1], 512, 64, 128, 128
        ckv = torch.randn(NB, bs, C, device="cuda", generator=g).bfloat16()
        kr = torch.randn(NB, bs, R, device="cuda", generator=g).bfloat16()
        qr = torch.randn(B, S, H, R, device="cuda", generator=g).bfloat16()
        if shape.endswith("-mha"):
            w_uk = (torch.randn(H, nope, C, device="cuda", generator=g) / C ** 0.5).bfloat16()
            w_uv = (torch.randn(H, vd, C, device="cuda", generator=g) / C ** 0.5).bfloat16()
            qn = torch.randn(B, S, H, nope, device="cuda", generator=g).bfloat16()
            flops = pairs * H * 2 * (nope + R + vd) + B * L * H * 2 * C * (nope + vd)
            fn = lambda: ap.prefill_mla_mha(qn, qr, ckv, kr, w_uk, w_uv, bt, pos, L, 192 ** -0.5, config=config)  # noqa: E731
            extra["decompress_us"] = triton.testing.do_bench(
                lambda: ap.mla_decompress(ckv, kr, w_uk, w_uv, bt, L, torch.bfloat16), warmup=5, rep=60,
                return_mode="median") * 1e3

            def ref(rows):
                lat = paged_attention_mla_ref(torch.einsum("bshd,hdc->bshc", qn[:, rows], w_uk), qr[:, rows], ckv, kr, bt,
                                              pos[:, rows], L, 192 ** -0.5)
                return torch.einsum("bshc,hvc->bshv", lat, w_uv)
        else:
            qa = (torch.randn(B, S, H, C, device="cuda", generator=g) / C ** 0.5).bfloat16()
            flops = pairs * H * 2 * (2 * C + R)
            fn = lambda: ap.prefill_mla(qa, qr, ckv, kr, bt, pos, L, 192 ** -0.5, config=config)  # noqa: E731
            ref = lambda rows: paged_attention_mla_ref(qa[:, rows], qr[:, rows], ckv, kr, bt, pos[:, rows], L,  # noqa: E731
                                                       192 ** -0.5)
    else:
        H, kvh, d = spec[1:]
        k = torch.randn(NB, bs, kvh, d, device="cuda", generator=g).bfloat16()
        v = torch.randn(NB, bs, kvh, d, device="cuda", generator=g).bfloat16()
        q = torch.randn(B, S, H, d, device="cuda", generator=g).bfloat16()
        sk = torch.randn(H, device="cuda", generator=g) if kind == "gptoss" else None
        flops = pairs * H * 4 * d
        fn = lambda: ap.prefill_gqa(q, k, v, bt, pos, L, d ** -0.5, sk, config=config)  # noqa: E731
        ref = lambda rows: paged_attention_gqa_ref(q[:, rows], k, v, bt, pos[:, rows], L, d ** -0.5, sk)  # noqa: E731
        if P == 0:  # the peer: flash SDPA over dense q/k/v (no sinks: an upper bound for this shape)
            kd = torch.randn(B, kvh, S, d, device="cuda", generator=g).bfloat16()
            vd_ = torch.randn(B, kvh, S, d, device="cuda", generator=g).bfloat16()
            qd = q.transpose(1, 2)
            sdpa = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd_, is_causal=True, enable_gqa=True), warmup=10, rep=100, return_mode="median") * 1e3
    got = fn()
    rows = torch.arange(max(0, S - 128), S, device="cuda")  # the rows with the most keys
    err = _rel(got[:, rows], ref(rows))
    t = triton.testing.do_bench(fn, warmup=10, rep=150, return_mode="median") * 1e3
    ref_us = None
    if B * H * S * L * 4 <= 4 << 30:
        allrows = torch.arange(S, device="cuda")
        ref_us = triton.testing.do_bench(lambda: ref(allrows), warmup=3, rep=60, return_mode="median") * 1e3
    return {"shape": shape, "batch": B, "new": S, "prefix": P, "us": t, "TFLOPs": flops / (t * 1e-6) / 1e12,
            "of_peak": flops / (t * 1e-6) / peak, "roofline_us": flops / peak * 1e6, "ratio": t / (flops / peak * 1e6),
            "ref_us": ref_us, "sdpa_us": sdpa, "max_rel_err": err, "config": config, **extra}


def _print_prefill(r):
    extra = (f" ref {r['ref_us']:9.1f} us (x{r['ref_us'] / r['us']:.1f} slower)" if r["ref_us"] else " ref  (too big)") + \
            (f" sdpa {r['sdpa_us']:8.1f} us" if r["sdpa_us"] else "") + \
            (f" (decompress {r['decompress_us']:.1f} us)" if r.get("decompress_us") else "")
    print(f"prefill {r['shape']:10s} B={r['batch']:2d} S={r['new']:5d} P={r['prefix']:5d} {r['us']:9.1f} us "
          f"{r['TFLOPs']:6.1f} TFLOP/s ({100 * r['of_peak']:4.1f}% of peak, x{r['ratio']:.2f}) err {r['max_rel_err']:.1e}"
          + extra, flush=True)


def main():
    ap_ = argparse.ArgumentParser()
    ap_.add_argument("--json")
    ap_.add_argument("--sweep", action="store_true", help="also time candidate kernel configs on a few cells")
    ap_.add_argument("--batches", default="1,8,64")
    ap_.add_argument("--ctxs", default="1024,8192,32768")
    ap_.add_argument("--shapes", default=",".join(SHAPES))
    ap_.add_argument("--fp8", action="store_true", help="also the decode cells with an fp8 cache (--fp8-cells)")
    ap_.add_argument("--fp8-cells", default="1x32768,8x8192,64x8192,64x32768")
    ap_.add_argument("--prefill", action="store_true", help="also the prefill/extend cells")
    ap_.add_argument("--no-decode", action="store_true", help="skip the bf16 decode grid")
    ap_.add_argument("--prefill-shapes", default=",".join(PREFILL_SHAPES))
    ap_.add_argument("--sweep-fp8", action="store_true", help="fp8 decode: fp16 vs q-dtype dots, larger tiles")
    ap_.add_argument("--sweep-prefill", action="store_true", help="prefill kernel configs on two cells per shape")
    a = ap_.parse_args()
    t0 = time.time()
    bw, peak = ceilings()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    rows, sweep, fp8_rows, pre_rows = [], [], [], []

    def dump():
        if a.json:  # after every section: a run cut short still leaves its numbers
            out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "copy_Bps": bw, "bf16_flops": peak, "rows": rows, "fp8_rows": fp8_rows, "prefill_rows": pre_rows,
                   "sweep": sweep, "seconds": time.time() - t0}
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)

    for shape in ([] if a.no_decode else a.shapes.split(",")):
        for B in map(int, a.batches.split(",")):
            for ctx in map(int, a.ctxs.split(",")):
                r = cell(shape, B, ctx, bw, peak)
                rows.append(r)
                print(f"{shape:7s} B={B:3d} ctx={ctx:6d} {r['us']:9.1f} us {r['GBps']:7.0f} GB/s roof {r['roofline_us']:8.1f} us "
                      f"({r['bound']}) x{r['ratio']:5.2f} err {r['max_rel_err']:.1e}"
                      + (f" old {r['old_us']} us" if r["old_us"] else ""), flush=True)
                torch.cuda.empty_cache()
    dump()
    if a.fp8:
        for shape in a.shapes.split(","):
            for c in a.fp8_cells.split(","):
                B, ctx = map(int, c.split("x"))
                pair = []
                for fp8 in (False, True):
                    r = cell(shape, B, ctx, bw, peak, fp8=fp8)
                    fp8_rows.append(r)
                    pair.append(r)
                    torch.cuda.empty_cache()
                b16, f8 = pair
                print(f"fp8 {shape:7s} B={B:3d} ctx={ctx:6d} bf16 {b16['us']:8.1f} us  fp8 {f8['us']:8.1f} us "
                      f"(x{b16['us'] / f8['us']:.2f} faster; fp8 roof {f8['roofline_us']:.1f} us, x{f8['ratio']:.2f}) "
                      f"err vs fp8 ref {f8['max_rel_err']:.1e} vs bf16 {f8['max_rel_err_vs_bf16']:.1e}", flush=True)
        dump()
    if a.prefill:
        for shape in a.prefill_shapes.split(","):
            for B, S, P in PREFILL_CELLS:
                try:
                    r = prefill_cell(shape, B, S, P, peak)
                except Exception as e:  # keep the rest of the grid: the failure is reported in the row
                    r = {"shape": shape, "batch": B, "new": S, "prefix": P, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print("prefill", shape, B, S, P, "ERROR", r["error"], flush=True)
                else:
                    _print_prefill(r)
                pre_rows.append(r)
                torch.cuda.empty_cache()
        dump()
    if a.sweep_fp8:
        cands = {"mla128": [(64, 64, 8, 2), (64, 128, 8, 2), (64, 32, 8, 3), (32, 64, 4, 2)],
                 "mla16": [(16, 128, 8, 2), (16, 256, 8, 2), (16, 128, 4, 3), (16, 64, 4, 3)],
                 "gptoss": [(128, 4, 3), (256, 4, 3), (256, 8, 3), (128, 4, 4)],
                 "qwen3": [(64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 4, 4)]}
        for shape, cs in cands.items():
            for B, ctx in ((1, 32768), (64, 8192)):
                for f16 in (True, False):
                    ad.FP8_DOT_F16 = f16
                    for c in (cs if f16 else cs[:1]):
                        try:
                            r = cell(shape, B, ctx, bw, peak, c, check=True, fp8=True)
                        except Exception as e:
                            r = {"shape": shape, "batch": B, "ctx": ctx, "config": c, "error": str(e)[:200]}
                        r["f16_dots"] = f16
                        sweep.append(r)
                        print("sweep-fp8", shape, B, ctx, "f16" if f16 else "qdtype", c,
                              f"{r.get('us', float('nan')):.1f} us x{r.get('ratio', float('nan')):.2f} "
                              f"err {r.get('max_rel_err') or float('nan'):.1e}", r.get("error", ""), flush=True)
                        torch.cuda.empty_cache()
        ad.FP8_DOT_F16 = True
        dump()
    if a.sweep_prefill:
        cands = {"gptoss": [(16, 8, 64, 4, 2), (16, 8, 128, 8, 2), (16, 8, 64, 4, 3), (32, 8, 64, 8, 2), (16, 8, 128, 4, 3)],
                 "qwen3": [(16, 8, 64, 8, 2), (16, 8, 128, 8, 2), (16, 8, 64, 8, 3), (8, 8, 64, 4, 2), (16, 8, 32, 4, 3)],
                 "mla128": [(4, 16, 32, 8, 2), (1, 64, 32, 8, 2), (4, 16, 64, 8, 2), (2, 16, 32, 4, 2)],
                 "mla128-mha": [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3)]}
        for shape, cs in cands.items():
            for B, S, P in ((1, 8192, 0), (4, 512, 4096)):
                for c in cs:
                    try:
                        r = prefill_cell(shape, B, S, P, peak, c)
                    except Exception as e:
                        r = {"shape": shape, "batch": B, "new": S, "prefix": P, "config": c, "error": str(e)[:200]}
                        print("sweep-prefill", shape, B, S, P, c, "ERROR", r["error"], flush=True)
                    else:
                        print("sweep-prefill", c, end=" ")
                        _print_prefill(r)
                    sweep.append(r)
                    torch.cuda.empty_cache()
        dump()
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
    dump()


if __name__ == "__main__":
    main()
