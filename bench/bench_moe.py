"""DeepSeek-V3 MoE layer on one GPU: our Triton FP4 experts vs torch bf16 `torch._grouped_mm`.

Shapes: 256 experts, hidden 7168, intermediate 2048, top-8, random (softmax top-k) routing.
For each token count: time of our full experts forward (align + gate/up GEMM + down GEMM + finalize),
time of the bf16 baseline (two `_grouped_mm` with SiLU*up between, on pre-sorted tokens: the GEMMs
only, as in the project's baseline table), achieved bandwidth over the FP4 bytes of the touched
experts, ratio to bf16, and the fraction of the limit (those bytes over the measured copy bandwidth).
Correctness is checked against the torch reference at every size. All numbers come from one run.

  python bench/bench_moe.py [--tokens 1,8,...] [--formats nvfp4,mxfp4] [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))

from moe_kernels.experts import ExpertWeights  # noqa: E402
from moe_kernels.formats import MxFp4Tensor, NvFp4Tensor  # noqa: E402
from moe_kernels.reference import TorchExperts  # noqa: E402
from moe_kernels.routing import softmax_topk  # noqa: E402
from moe_kernels.triton_config import FragConfig, GemmConfig, MoEConfig, default_config  # noqa: E402
from moe_kernels.triton_moe import TritonExperts  # noqa: E402

E, H, I, K = 256, 7168, 2048, 8
DEV = "cuda"


def bench(fn, graph=True, rep=100):
    """Median time in seconds; CUDA-graph replay when the function is capturable. rep: ms per
    measurement (do_bench_cudagraph replays a graph of ~rep ms ten times; eager: do_bench)."""
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e-3
        except Exception as exc:  # noqa: BLE001 - fall back to eager timing, say so
            print(f"  (graph capture failed: {type(exc).__name__}; eager timing)")
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e-3


@contextlib.contextmanager
def config_with(ex: TritonExperts, num_pairs: int, **fields):
    """ex runs the config it would for num_pairs pairs with `fields` replaced (same-run A/Bs of the
    MoEConfig path switches); its own config is restored afterwards."""
    saved = ex.config
    ex.config = dataclasses.replace(ex.config_for(num_pairs), **fields)
    try:
        yield
    finally:
        ex.config = saved


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of bf16 per buffer
    a = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a), graph=False)
    del a, b
    return 2 * n * 2 / t  # bytes read + written


def random_weights(fmt: str, g: torch.Generator, e: int = E, h: int = H, i: int = I) -> ExpertWeights:
    """Random FP4 codes and plausible scales (weights ~ N(0, 0.02)-sized), generated on the GPU.
    (e, h, i): experts, hidden, intermediate size (default: the DeepSeek-V3 layer above)."""
    def packed(n, k):
        return torch.randint(0, 256, (e, n, k // 2), device=DEV, dtype=torch.uint8, generator=g)

    if fmt == "nvfp4":
        def bs(n, k):  # e4m3 codes for values 1..8
            return torch.randint(0x38, 0x50, (e, n, k // 16), device=DEV, dtype=torch.uint8, generator=g
                                 ).view(torch.float8_e4m3fn)
        gs = torch.full((e,), 2e-3, device=DEV)
        return ExpertWeights("nvfp4", NvFp4Tensor(packed(2 * i, h), bs(2 * i, h), gs),
                             NvFp4Tensor(packed(h, i), bs(h, i), gs.clone()))

    def sc(n, k):  # 2^-8 .. 2^-5
        return torch.randint(119, 123, (e, n, k // 32), device=DEV, dtype=torch.uint8, generator=g)
    return ExpertWeights("mxfp4", MxFp4Tensor(packed(2 * i, h), sc(2 * i, h)), MxFp4Tensor(packed(h, i), sc(h, i)))


def dequantized_bf16(weights: ExpertWeights):
    """[E, 2I, H] and [E, H, I] bf16, dequantised one expert at a time (bounded temporaries)."""
    e_, h_, i_ = weights.num_experts, weights.hidden_size, weights.intermediate_size
    w13 = torch.empty(e_, 2 * i_, h_, device=DEV, dtype=torch.bfloat16)
    w2 = torch.empty(e_, h_, i_, device=DEV, dtype=torch.bfloat16)
    for e in range(e_):
        w13[e], w2[e] = weights.dequantize_expert(e)
    return w13, w2


def grouped_mm_layer(w13t, w2t):
    """bf16 baseline on tokens already sorted by expert (offs: int32 cumulative row ends)."""
    def run(xs, offs):
        h = torch._grouped_mm(xs, w13t, offs=offs)
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        return torch._grouped_mm(a, w2t, offs=offs)
    return run


def rel(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm())


def _c(bm, g1, g2):
    return MoEConfig(bm, GemmConfig(*g1), GemmConfig(*g2))


# (block_n, block_k, num_warps, num_stages, group_m, swap) per GEMM
def _f(g1, g2):  # one-row loop configs: (block_n, block_k, num_warps)
    return MoEConfig(1, GemmConfig(*g1, 1, one_row=True), GemmConfig(*g2, 1, one_row=True))


SWEEP = {
    "decode": [
        _f((32, 64, 4), (64, 64, 4)),
        _f((64, 64, 4), (64, 64, 4)),
        _f((32, 64, 4), (32, 64, 4)),
        _f((16, 64, 4), (32, 64, 4)),
        _c(16, (64, 64, 4, 2, 1, False), (64, 64, 4, 2, 1, False)),
    ],
    "large": [
        _c(128, (128, 64, 8, 2, 8, False), (128, 64, 8, 2, 8, False)),
        MoEConfig(128, GemmConfig(128, 64, 8, 2, 8, swap=True), GemmConfig(128, 64, 8, 2, 8, swap=True)),
        MoEConfig(128, GemmConfig(128, 64, 8, 3, 8), GemmConfig(128, 64, 8, 3, 8)),
        MoEConfig(128, GemmConfig(64, 64, 4, 2, 8, swap=True), GemmConfig(64, 64, 4, 2, 8, swap=True)),
        MoEConfig(64, GemmConfig(128, 64, 8, 2, 8, swap=True), GemmConfig(128, 64, 8, 2, 8, swap=True)),
        MoEConfig(128, GemmConfig(256, 64, 8, 2, 8, swap=True), GemmConfig(256, 64, 8, 2, 8, swap=True)),
    ],
}


# fragment-order kernel (8-row blocks here): (rt, wn, wk, pipe[, group_m]) candidates per format and
# regime (decode: <= 1.5 rows per expert); GEMM1 swept with GEMM2 fixed, then GEMM2 with the best GEMM1
FRAG_CANDIDATES = {
    ("nvfp4", "decode"): ([(4, 1, 2, 4), (4, 1, 4, 4), (4, 1, 4, 3), (2, 1, 4, 4), (2, 2, 2, 4), (4, 2, 2, 3)],
                          [(4, 1, 1, 4), (4, 1, 2, 4), (2, 1, 2, 4), (4, 2, 1, 4), (2, 2, 1, 4)]),
    ("nvfp4", "batch"): ([(4, 2, 1, 3), (4, 2, 1, 3, 2), (4, 1, 1, 3), (4, 1, 2, 3), (4, 4, 1, 3)],
                         [(4, 1, 1, 4), (4, 1, 1, 4, 2), (4, 2, 1, 3), (4, 1, 2, 4)]),
    ("mxfp4", "decode"): ([(2, 2, 1, 4), (2, 1, 2, 4), (4, 1, 2, 4), (4, 1, 1, 4), (4, 1, 2, 3), (2, 2, 2, 4)],
                          [(4, 2, 1, 3), (4, 1, 1, 4), (4, 1, 2, 4), (2, 2, 1, 4), (2, 1, 2, 4)]),
    ("mxfp4", "batch"): ([(2, 2, 1, 3), (2, 2, 1, 4), (2, 4, 1, 4), (2, 1, 1, 4), (4, 1, 2, 3), (4, 2, 1, 3)],
                         [(4, 2, 1, 3), (4, 2, 1, 3, 2), (4, 1, 1, 4), (4, 1, 1, 3)]),
    # 16-row token blocks (nt=2)
    ("nvfp4", "nt2"): ([(4, 1, 1, 3), (4, 2, 1, 3), (4, 1, 2, 3), (2, 1, 1, 3)],
                       [(4, 1, 1, 3), (4, 1, 1, 4), (4, 2, 1, 3), (4, 4, 1, 3), (4, 1, 1, 2), (4, 2, 1, 4),
                        (4, 1, 2, 3), (2, 2, 1, 3)]),
    ("mxfp4", "nt2"): ([(4, 1, 1, 3), (2, 1, 1, 3), (2, 2, 1, 3)],
                       [(4, 1, 1, 3), (4, 1, 1, 4), (4, 2, 1, 3), (4, 4, 1, 3), (4, 1, 1, 2), (4, 1, 2, 3)]),
}


def frag_sweep(ex: TritonExperts, tokens: list[int], g, nt2: bool = False, mixed: bool = False,
               mixed_big: bool = False):
    for t in tokens:
        x = torch.randn(t, H, device=DEV, generator=g).to(torch.bfloat16)
        w, ids = softmax_topk(torch.randn(t, E, device=DEV, generator=g), K, True)
        rows = t * K / min(E, t * K)
        regime = "decode" if rows <= 1.5 else ("nt2" if nt2 or mixed_big else "batch")
        nt = 2 if nt2 or mixed_big else 1
        g1s, g2s = FRAG_CANDIDATES[(ex.fmt, regime)]
        big = default_config(ex.fmt, 8 * E, E, True)   # the 16-row configs of the mixed default (8 rows)

        def make(g1, g2):
            if mixed:   # sweep the 8-row (small) configs, the 16-row blocks on their default
                return MoEConfig(16, big.gemm1, big.gemm2, (FragConfig(1, *g1), FragConfig(1, *g2)))
            if mixed_big:   # sweep the 16-row configs of mixed blocks, the 8-row ones on their default
                return MoEConfig(16, FragConfig(2, *g1), FragConfig(2, *g2), big.small)
            return MoEConfig(8 * nt, FragConfig(nt, *g1), FragConfig(nt, *g2))

        def run(g1, g2):
            ex.config = make(g1, g2)
            try:
                us = bench(lambda: ex.forward(x, w, ids)) * 1e6
            except Exception as exc:  # noqa: BLE001
                print(f"  frag-sweep {ex.fmt} T={t} {g1} {g2}: failed {type(exc).__name__}: {str(exc)[:300]}")
                return float("inf")
            print(f"  frag-sweep {ex.fmt} T={t} g1={g1} g2={g2}: {us:.1f} us", flush=True)
            return us
        best1 = min(g1s, key=lambda c: run(c, g2s[0]))
        best2 = min(g2s, key=lambda c: run(best1, c))
        print(f"  frag-best {ex.fmt} T={t} nt={nt} g1={best1} g2={best2}", flush=True)
    ex.config = None


def split_sweep(ex: TritonExperts, ref: TorchExperts, tokens: list[int], g):
    """Large batches: the tl.dot default without tail blocks, with 16-row fragment tail blocks for
    remainders of up to R rows (align_split), and the fragment kernel alone (16-row blocks)."""
    tail = (FragConfig(2, 4, 1, 1, 3), FragConfig(2, 4, 1, 1, 3))
    for t in tokens:
        x = torch.randn(t, H, device=DEV, generator=g).to(torch.bfloat16)
        w, ids = softmax_topk(torch.randn(t, E, device=DEV, generator=g), K, True)
        want = ref.forward(x, w, ids)
        base = default_config(ex.fmt, t * K, E, False)
        bm = base.block_m
        cands = [("tiles only", MoEConfig(bm, base.gemm1, base.gemm2))]
        cands += [(f"tail <= {r}", MoEConfig(bm, base.gemm1, base.gemm2, tail=tail, tail_rows=r))
                  for r in sorted({bm // 8, bm // 4, bm // 2, 3 * bm // 4, bm - 1} - {0})]
        cands += [("16-row fragment blocks", MoEConfig(16, *tail))]
        for name, cfg in cands:
            ex.config = cfg
            try:
                err = rel(ex.forward(x, w, ids), want)
                us = bench(lambda: ex.forward(x, w, ids)) * 1e6
            except Exception as exc:  # noqa: BLE001
                print(f"  split-sweep {ex.fmt} T={t} {name}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            print(f"  split-sweep {ex.fmt} T={t} block_m={bm} {name}: {us:.1f} us, rel err {err:.1e}", flush=True)
    ex.config = None


def sweep(ex: TritonExperts, tokens: list[int], g):
    """Time a few tile configs per size (tuning aid; the table below uses the default config)."""
    for t in tokens:
        x = torch.randn(t, H, device=DEV, generator=g).to(torch.bfloat16)
        w, ids = softmax_topk(torch.randn(t, E, device=DEV, generator=g), K, True)
        cands = SWEEP["decode"] if t * K / min(E, t * K) <= 16 else SWEEP["large"]
        for i, cfg in enumerate(cands):
            for asm in ((True, False) if i == 0 and t == tokens[0] else (True,)):
                ex.config = dataclasses.replace(cfg, asm=asm)
                try:
                    us = bench(lambda: ex.forward(x, w, ids)) * 1e6
                    print(f"  sweep {ex.fmt} T={t} #{i} asm={int(asm)} {cfg}: {us:.1f} us", flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"  sweep {ex.fmt} T={t} #{i} {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}",
                          flush=True)
        ex.config = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096")
    ap.add_argument("--formats", default="nvfp4,mxfp4")
    ap.add_argument("--sweep", default="", help="token counts to sweep tile configs at, e.g. 1,64,4096")
    ap.add_argument("--frag-sweep", default="", help="token counts to sweep fragment-kernel configs at")
    ap.add_argument("--frag-nt2", action="store_true", help="sweep 16-row token blocks (nt=2) instead")
    ap.add_argument("--frag-mixed", action="store_true", help="sweep the 8-row configs of mixed blocks instead")
    ap.add_argument("--frag-mixed-big", action="store_true", help="sweep the 16-row configs of mixed blocks instead")
    ap.add_argument("--split-sweep", default="", help="token counts to compare tail-block splits at (>= 1024)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    g = torch.Generator(device=DEV).manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    results = {"copy_bw": bw, "rows": []}
    w13t = w2t = None
    for fmt in args.formats.split(","):
        t0 = time.time()
        weights = random_weights(fmt, g)
        ex = TritonExperts(weights)
        ref = TorchExperts(weights)
        if w13t is None:  # one bf16 copy of the (first format's) weights for the baseline
            w13, w2 = dequantized_bf16(weights)
            w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, K, N] views, K contiguous
            base = grouped_mm_layer(w13t, w2t)
        per_expert = weights.nbytes_per_expert()
        print(f"[{fmt}] setup {time.time() - t0:.1f}s, {per_expert / 1e6:.2f} MB per expert", flush=True)
        if args.sweep and fmt == args.formats.split(",")[0]:
            sweep(ex, [int(t) for t in args.sweep.split(",")], g)
        if args.frag_sweep:
            frag_sweep(ex, [int(t) for t in args.frag_sweep.split(",")], g, args.frag_nt2, args.frag_mixed,
                       args.frag_mixed_big)
        if args.split_sweep:
            split_sweep(ex, ref, [int(t) for t in args.split_sweep.split(",")], g)
        for t in tokens:
            x = torch.randn(t, H, device=DEV, generator=g).to(torch.bfloat16)
            w, ids = softmax_topk(torch.randn(t, E, device=DEV, generator=g), K, True)
            touched = int(torch.unique(ids).numel())
            nbytes = touched * per_expert
            out = ex.forward(x, w, ids)
            err = rel(out, ref.forward(x, w, ids))
            t_ours = bench(lambda: ex.forward(x, w, ids))
            fwd = lambda: ex.forward(x, w, ids)  # noqa: E731
            # same-run A/Bs: without programmatic dependent launch (one token), the finalize as its own
            # launch (one token), the fragment kernels on activations in natural K order (more tokens)
            cfg = ex.config_for(t * K)
            t_nopdl = t_unfused = t_nat = None
            if ex.can_pdl and cfg.pdl and t == 1:
                with config_with(ex, t * K, pdl=False):
                    t_nopdl = bench(fwd)
            if ex.frag and cfg.fuse_finalize and t == 1:
                with config_with(ex, t * K, fuse_finalize=False):
                    t_unfused = bench(fwd)
            if ex.frag and cfg.coalesce and t > 1:
                with config_with(ex, t * K, coalesce=False):
                    t_nat = bench(fwd)
            # baseline inputs: tokens sorted by expert, int32 offsets
            flat = ids.flatten().long()
            order = torch.argsort(flat, stable=True)
            xs = x[order // K].contiguous()
            offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
            t_bf16 = bench(lambda: base(xs, offs))
            limit = nbytes / bw
            row = dict(fmt=fmt, tokens=t, experts=touched, us=t_ours * 1e6, tbs=nbytes / t_ours / 1e12,
                       bf16_us=t_bf16 * 1e6, speedup=t_bf16 / t_ours, limit_us=limit * 1e6,
                       frac_limit=limit / t_ours, rel_err=err,
                       no_pdl_us=None if t_nopdl is None else t_nopdl * 1e6,
                       finalize_launch_us=None if t_unfused is None else t_unfused * 1e6,
                       natural_order_us=None if t_nat is None else t_nat * 1e6)
            results["rows"].append(row)
            print(f"  T={t:5d} experts={touched:3d}  ours {row['us']:9.1f} us {row['tbs']:5.2f} TB/s | "
                  f"bf16 {row['bf16_us']:9.1f} us  x{row['speedup']:5.2f} | limit {row['limit_us']:8.1f} us "
                  f"{100 * row['frac_limit']:5.1f}% | rel err {err:.2e}"
                  + ("" if t_nopdl is None else f" | without PDL {t_nopdl * 1e6:.1f} us")
                  + ("" if t_unfused is None else f" | finalize launch {t_unfused * 1e6:.1f} us")
                  + ("" if t_nat is None else f" | natural-order activations {t_nat * 1e6:.1f} us"), flush=True)
        del ex, ref, weights
        torch.cuda.empty_cache()
    print("\n| format | tokens | experts | ours (us) | TB/s | bf16 _grouped_mm (us) | speedup vs bf16 | "
          "limit (us) | % of limit | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        print(f"| {r['fmt']} | {r['tokens']} | {r['experts']} | {r['us']:.1f} | {r['tbs']:.2f} | {r['bf16_us']:.1f} | "
              f"{r['speedup']:.2f}x | {r['limit_us']:.1f} | {100 * r['frac_limit']:.1f}% | {r['rel_err']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
