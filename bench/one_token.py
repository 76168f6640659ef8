"""One decode token through a DeepSeek-V3 MoE layer, launch by launch (fragment kernel, pairwise blocks).

Prints, per FP4 format, in one run: the whole forward (fused one-token finalize, the separate
finalize launch, no finalize at all), the gate/up and the down GEMM alone, each against its own
limit (its FP4 bytes over the copy bandwidth measured in the same run), then optional per-launch
config sweeps of both GEMMs. Sweep kernels are compiled first by worker processes in parallel (same
argument shapes, zero weights), so the main process finds them in Triton's cache.

  python bench/one_token.py [--formats nvfp4,mxfp4] [--sweep] [--workers 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))

from bench_moe import DEV, E, H, I, K, config_with, copy_bandwidth, random_weights  # noqa: E402
from moe_kernels.triton_config import FragConfig, MoEConfig, default_config  # noqa: E402
from moe_kernels.triton_frag import STEP_K, SUB, FragWeights  # noqa: E402
from moe_kernels.triton_moe import TritonExperts  # noqa: E402


def us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def candidates(gemm: int):
    """(rt, wn, wk, pipe) per GEMM: GEMM1 (K = 7168) also splits K over up to 4 warps."""
    if gemm == 1:
        return ([(4, wn, wk, p) for wn in (1, 2) for wk in (1, 2, 4) for p in (2, 3, 4, 5)]
                + [(2, 1, wk, p) for wk in (1, 2, 4) for p in (3, 4)] + [(2, 2, 2, 3), (1, 1, 4, 4)])
    return ([(4, wn, wk, p) for wn in (1, 2, 4) for wk in (1, 2) for p in (2, 3, 4, 5)]
            + [(2, wn, 1, p) for wn in (1, 2, 4) for p in (3, 4)] + [(2, 2, 2, 3), (1, 4, 1, 4)])


def _stub_experts(fmt: str, experts: int) -> TritonExperts:
    """A TritonExperts with zero fragment weights of the real shapes (no packing), for compiling."""
    ex = object.__new__(TritonExperts)
    ex.fmt, ex.E, ex.H, ex.I = fmt, experts, H, I
    ex.config, ex.can_pdl, ex._pairwise_perm, ex._fin_counts = None, True, {}, {}
    ex.b13 = ex.b2 = None
    ex._no_bias, ex.act_id, ex.alpha, ex.limit = torch.zeros(1, device=DEV), 0, 1.0, 0.0

    def zeros(n, k):
        step, sub = STEP_K[fmt], SUB[fmt]
        return FragWeights(fmt, torch.zeros(experts, n // 16, k // step, sub, 32, 4, dtype=torch.int32, device=DEV),
                           torch.zeros(experts, n // 16, k // step, 32, dtype=torch.int32, device=DEV),
                           torch.ones(experts, 2, device=DEV), n, k)
    ex.f13, ex.f2 = zeros(2 * I, H), zeros(H, I)
    return ex


def launches(ex: TritonExperts, x, w, ids, which: int, cfg: FragConfig, fin: bool = False, pdl: bool | None = None):
    """The one launch of GEMM `which` (1: gate/up, 2: down) on the pairwise blocks of one token, as the
    forward launches it (coalesced intermediate; pdl: PDL code and launch, None: where the forward uses it)."""
    al = ex._pairwise(ids)
    inter, gemm2_out = ex._buffers(al.p_max, x.device)
    fargs = ex._fused_finalize_args(gemm2_out, w, al.perm, None, 1.0) if fin else None
    pdl = ex.can_pdl if pdl is None else pdl
    if which == 1:
        return lambda: ex._launch_frag(ex.f13, x, inter, al, ex.I, cfg, True, K, K, operm=True, pdl=pdl)
    return lambda: ex._launch_frag(ex.f2, inter, gemm2_out, al, ex.H, cfg, False, K, K, xco=True, fin=fargs, pdl=pdl)


def forward_us(ex: TritonExperts, x, w, ids, g1, g2, gate_up_pdl: bool = True) -> float:
    ex.config = MoEConfig(8, FragConfig(1, *g1), FragConfig(1, *g2), gate_up_pdl=gate_up_pdl)
    try:
        return us(lambda: ex.forward(x, w, ids))
    except Exception as exc:  # noqa: BLE001
        print(f"  forward {g1}/{g2}: failed {type(exc).__name__}: {str(exc)[:200]}")
        return float("inf")
    finally:
        ex.config = None


def _compile_worker(job):
    fmt, which, cfgs = job
    ex = _stub_experts(fmt, 16)
    x = torch.zeros(1, H, dtype=torch.bfloat16, device=DEV)
    w = torch.full((1, K), 1.0 / K, device=DEV)
    ids = torch.arange(K, dtype=torch.int32, device=DEV).view(1, K)
    for c in cfgs:
        try:
            launches(ex, x, w, ids, which, FragConfig(1, *c))()
            if which == 2:   # the down GEMM of the forward, with the fused finalize
                launches(ex, x, w, ids, which, FragConfig(1, *c), fin=True)()
        except Exception as exc:  # noqa: BLE001 - reported again (with the error) by the timed run
            print(f"  compile {fmt} gemm{which} {c}: {type(exc).__name__}", flush=True)
    torch.cuda.synchronize()
    return len(cfgs)


def precompile(formats, workers: int):
    jobs = [(f, g, [c]) for f in formats for g in (1, 2) for c in candidates(g)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        n = sum(pool.imap_unordered(_compile_worker, jobs))
    print(f"precompiled {n} sweep kernels in {time.time() - t0:.0f} s with {workers} workers", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="nvfp4,mxfp4")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    formats = args.formats.split(",")
    if args.sweep:
        precompile(formats, args.workers)
    g = torch.Generator(device=DEV).manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    res = {"copy_bw": bw, "formats": {}}
    for fmt in formats:
        weights = random_weights(fmt, g)
        ex = TritonExperts(weights)
        x = torch.randn(1, H, device=DEV, generator=g).to(torch.bfloat16)
        gate = torch.randn(1, E, device=DEV, generator=g)
        w, ids = torch.topk(torch.softmax(gate, -1), K)
        w, ids = w / w.sum(-1, keepdim=True), ids.to(torch.int32)
        experts = ids.flatten().long()

        def nbytes(fw: FragWeights):
            return (fw.w[experts].numel() + fw.s[experts].numel()) * 4

        b1, b2 = nbytes(ex.f13), nbytes(ex.f2)
        cfg = default_config(fmt, K, E, True)
        row = {"limit_us": (b1 + b2) / bw * 1e6, "g1_limit_us": b1 / bw * 1e6, "g2_limit_us": b2 / bw * 1e6}
        row["forward_fused"] = us(lambda: ex.forward(x, w, ids))
        with config_with(ex, K, fuse_finalize=False):
            row["forward_unfused"] = us(lambda: ex.forward(x, w, ids))
            unfused = ex.forward(x, w, ids)
        row["bit_equal"] = bool(torch.equal(ex.forward(x, w, ids), unfused))
        # A/B, interleaved three times: finalize fused into the down GEMM, or its own launch
        ab = {"fused finalize": [], "finalize launch": []}
        for _ in range(3):
            for name in ab:
                with config_with(ex, K, fuse_finalize=name == "fused finalize"):
                    ab[name].append(us(lambda: ex.forward(x, w, ids)))
        # gate/up GEMM launched with PDL (placed beside the previous kernel's programs) or not, at 4 and 5
        # stages (NVFP4: three 4-stage programs fit on an SM)
        d1 = default_config(fmt, K, E, True).gemm1
        for pl in (True, False):
            for pipe in (d1.pipe - 1, d1.pipe, d1.pipe + 1):
                name = f"gate/up {'PDL' if pl else 'no PDL'} launch, {pipe} stages"
                ab[name] = []
                for _ in range(3):
                    ab[name].append(forward_us(ex, x, w, ids, (d1.rt, d1.wn, d1.wk, pipe),
                                               (cfg.gemm2.rt, cfg.gemm2.wn, cfg.gemm2.wk, cfg.gemm2.pipe), pl))
        row["ab"] = ab
        print(f"[{fmt}] A/B (us, 3 runs each): " + "; ".join(f"{k} " + " / ".join(f"{v:.1f}" for v in vs)
                                                          for k, vs in ab.items()), flush=True)
        row["forward_no_finalize"] = us(lambda: ex.forward(x, w, ids, defer_finalize=True))
        row["gemm1"] = us(launches(ex, x, w, ids, 1, cfg.gemm1))
        row["gemm2"] = us(launches(ex, x, w, ids, 2, cfg.gemm2))
        row["gemm2_fin"] = us(launches(ex, x, w, ids, 2, cfg.gemm2, fin=True))
        lim = row["limit_us"]
        print(f"[{fmt}] limit {lim:.1f} us (gate/up {row['g1_limit_us']:.1f}, down {row['g2_limit_us']:.1f})\n"
              f"  forward: fused finalize {row['forward_fused']:.1f} us ({100 * lim / row['forward_fused']:.1f}%), "
              f"finalize launch {row['forward_unfused']:.1f} ({100 * lim / row['forward_unfused']:.1f}%), "
              f"no finalize {row['forward_no_finalize']:.1f}; fused == unfused bits: {row['bit_equal']}\n"
              f"  alone: gate/up {row['gemm1']:.1f} us ({100 * row['g1_limit_us'] / row['gemm1']:.1f}% of its limit), "
              f"down {row['gemm2']:.1f} us ({100 * row['g2_limit_us'] / row['gemm2']:.1f}%), "
              f"down + fused finalize {row['gemm2_fin']:.1f} us", flush=True)
        if args.sweep:
            # each launch alone, without PDL: with it, a launch's CTAs are placed while the previous
            # replay's are still resident, which unbalances them over the SMs (see bench/README.md)
            best = {}
            for which in (1, 2):
                lim_g = row[f"g{which}_limit_us"]
                times = {}
                for c in candidates(which):
                    try:
                        times[c] = us(launches(ex, x, w, ids, which, FragConfig(1, *c), pdl=False))
                    except Exception as exc:  # noqa: BLE001
                        print(f"  gemm{which} {c}: failed {type(exc).__name__}: {str(exc)[:200]}")
                best[which] = [c for c, _ in sorted(times.items(), key=lambda kv: kv[1])]
                print(f"  gemm{which} alone, no PDL (rt, wn, wk, pipe): " + ", ".join(
                    f"{c} {times[c]:.1f} ({100 * lim_g / times[c]:.0f}%)" for c in best[which]), flush=True)
                row[f"sweep{which}"] = {str(c): times[c] for c in best[which]}
            # whole forwards (fused finalize, PDL) on the best few of each
            d1 = (cfg.gemm1.rt, cfg.gemm1.wn, cfg.gemm1.wk, cfg.gemm1.pipe)
            d2 = (cfg.gemm2.rt, cfg.gemm2.wn, cfg.gemm2.wk, cfg.gemm2.pipe)
            deeper = (d1[0], d1[1], d1[2], d1[3] + 1)   # fewer CTAs fit per SM: PDL cannot stack them
            pairs = [(d1, d2), (deeper, d2)] + [(c, d2) for c in best[1][:5] if c not in (d1, deeper)]
            fwd = {}
            for g1, g2 in pairs:
                fwd[(g1, g2)] = forward_us(ex, x, w, ids, g1, g2, cfg.gate_up_pdl)
            b1 = min(fwd, key=fwd.get)[0]
            for g2 in best[2][:4]:
                if (b1, g2) not in fwd:
                    fwd[(b1, g2)] = forward_us(ex, x, w, ids, b1, g2, cfg.gate_up_pdl)
            print("  forward (gate/up, down): " + ", ".join(
                f"{a}/{b} {t:.1f} ({100 * lim / t:.1f}%)" for (a, b), t in sorted(fwd.items(), key=lambda kv: kv[1])),
                flush=True)
            row["forward_sweep"] = {f"{a}/{b}": t for (a, b), t in fwd.items()}
        res["formats"][fmt] = row
        del ex, weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
