"""Tune the Triton MoE experts for one (shape, format, GPU) and write the winners as a JSON table.

  python -m moe_kernels.tune --shape 256,7168,256,8 --format nvfp4 --tokens 1,8,64,256,1024,4096 \
      [-o kernels/moe_kernels/configs/NVIDIA_H200.json] [--max-candidates 12] [--rep 25] [--tol 2e-2]

For each token count: random routed tokens (softmax top-k) on random weights of the shape (FP4:
random codes and plausible scales), the candidates of candidate_configs (the default config first),
each one's output checked against the torch reference (moe_kernels.reference) before it is timed
(CUDA-graph replays, median): a candidate that fails to compile or launch, or whose relative error
exceeds --tol, is reported and dropped. Where the best gate/up and the best down variant came from
different candidates, their combination is tried too. The winner of each token count goes into the
table (entries[shape_key][tokens] = {config, us, default_us, rel_err}), merged into the file when it
exists; then the file is read back through the kernels' own lookup (triton_config.load_table /
TritonExperts(tuned_table=...)) and the configs it yields are run once more against the reference.

The kernels read the table of their GPU model (triton_config.table_path: $MOE_KERNELS_TUNED_CONFIGS,
else kernels/moe_kernels/configs/<device>.json); without one they use default_config. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

from .triton_config import (PREFILL, TABLE_VERSION, TILE128, FragConfig, GemmConfig, MoEConfig,  # noqa: F401
                            PrefillConfig,
                            config_to_dict, default_config, load_table, shape_key, table_path, tuned_configs)

# (rt, wn, wk, pipe) of the fragment kernel, (block_n, num_warps, num_stages, swap) of the tile kernel,
# (block_n, pipe) of the one-row loop: the neighbourhoods of the defaults the H200 sweeps explored
# (bench/bench_moe.py, bench/one_token.py); first, one and two row tiles per warp with K split over
# four warps: more programs where few experts x small I leave SMs idle (decode on TP shards).
# Invalid ones (too much shared memory) fail and are dropped.
FRAG_SPACE = [(1, 1, 4, 4), (2, 1, 4, 3), (1, 2, 2, 4), (4, 1, 2, 4), (4, 1, 1, 3), (4, 2, 1, 3), (4, 1, 2, 3), (4, 1, 1, 4), (2, 2, 1, 3), (2, 1, 2, 4),
              (2, 2, 2, 4), (4, 1, 4, 3), (4, 2, 2, 3)]
TILE_SPACE = [(128, 8, 2, False), (128, 8, 3, False), (128, 8, 2, True), (64, 4, 2, False), (64, 4, 3, True),
              (256, 8, 2, True)]
ONE_ROW_SPACE = [(32, 4), (32, 3), (16, 4), (64, 4), (64, 2)]
# the prefill kernel: fields changed from the default (first sweep, 2026-12-02: the old default 128 rows,
# 64-byte steps, 3 stages, and 4 warps, 128-byte steps, no swap lost on the DeepSeek-V3 shapes); the
# tile kernel's TILE128 (the FP4 path before it) is tried too, so every sweep compares them in one run.
PREFILL_SPACE = [dict(bkh=64, num_stages=3), dict(num_stages=3), dict(num_stages=5),
                 dict(progs_per_sm=1, flatten=True), dict(progs_per_sm=1), dict(block_n=128), dict(swap=False),
                 dict(group_m=1), dict(ws=True)]
# 16-row fragment blocks (12-80 rows per expert): the prefill kernel with these token block sizes
# (fragment tail blocks of up to half a block where the copy exists) is tried right after the default
PREFILL_BLOCKS = (32, 64, 128)


def _variants(g, kind: str):
    if kind == "frag":
        return [dataclasses.replace(g, rt=rt, wn=wn, wk=wk, pipe=p) for rt, wn, wk, p in FRAG_SPACE]
    if kind == "one_row":
        return [dataclasses.replace(g, block_n=bn, pipe=p) for bn, p in ONE_ROW_SPACE]
    if kind == "prefill":
        return [dataclasses.replace(g, **d) for d in PREFILL_SPACE] + [TILE128]
    return [dataclasses.replace(g, block_n=bn, num_warps=w, num_stages=s, swap=sw) for bn, w, s, sw in TILE_SPACE]


def candidate_configs(fmt: str, num_pairs: int, num_experts: int, frag: bool, limit: int | None = None,
                      inter: int | None = None) -> list[MoEConfig]:
    """The default config first (for 16-row fragment blocks, then the prefill kernel at PREFILL_BLOCKS
    rows per block), then one GEMM varied at a time (gate/up, then down), alternating, no duplicates;
    the first `limit`. Pure: no GPU."""
    base = default_config(fmt, num_pairs, num_experts, frag, inter)
    kind = ("frag" if base.frag else "prefill" if isinstance(base.gemm1, PrefillConfig)
            else "one_row" if base.gemm1.one_row else "tile")
    v1 = [dataclasses.replace(base, gemm1=g) for g in _variants(base.gemm1, kind)]
    v2 = [dataclasses.replace(base, gemm2=g) for g in _variants(base.gemm2, kind)]
    out = [base]
    if base.frag and base.block_m == 16 and base.small is None and fmt in PREFILL:
        nt2 = base.gemm1
        out += [MoEConfig(bm, *PREFILL[fmt], tail=(nt2, nt2) if frag else None, tail_rows=bm // 2 if frag else 0)
                for bm in PREFILL_BLOCKS]
    for pair in zip(v1, v2):
        for c in pair:
            if c not in out:
                out.append(c)
    for c in v1[len(v2):] + v2[len(v1):]:
        if c not in out:
            out.append(c)
    return out[:limit] if limit else out


def random_weights(fmt: str, e: int, h: int, i: int, device="cuda", seed: int = 0):
    """Random expert weights of one shape: FP4 as random codes with plausible scales (like
    bench/bench_moe.py), bf16 / fp8 from N(0, 0.02) values."""
    import torch

    from . import formats as F
    from .experts import ExpertWeights
    g = torch.Generator(device=device).manual_seed(seed)

    def packed(n, k):
        return torch.randint(0, 256, (e, n, k // 2), device=device, dtype=torch.uint8, generator=g)
    if fmt == "nvfp4":
        def bs(n, k):   # e4m3 codes for values 1..8
            return torch.randint(0x38, 0x50, (e, n, k // 16), device=device, dtype=torch.uint8,
                                 generator=g).view(torch.float8_e4m3fn)
        gs = torch.full((e,), 2e-3, device=device)
        return ExpertWeights("nvfp4", F.NvFp4Tensor(packed(2 * i, h), bs(2 * i, h), gs),
                             F.NvFp4Tensor(packed(h, i), bs(h, i), gs.clone()))
    if fmt == "mxfp4":
        def sc(n, k):   # 2^-8 .. 2^-5
            return torch.randint(119, 123, (e, n, k // 32), device=device, dtype=torch.uint8, generator=g)
        return ExpertWeights("mxfp4", F.MxFp4Tensor(packed(2 * i, h), sc(2 * i, h)),
                             F.MxFp4Tensor(packed(h, i), sc(h, i)))
    w13 = torch.randn(e, 2 * i, h, device=device, generator=g) * 0.02
    w2 = torch.randn(e, h, i, device=device, generator=g) * 0.02
    return ExpertWeights.from_dense(w13, w2, fmt)


def _rel(a, b) -> float:
    import torch
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _time_us(fn, rep: float) -> float:
    import triton.testing
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
    except Exception as exc:  # noqa: BLE001 - not capturable: eager timing, say so
        print(f"    (graph capture failed: {type(exc).__name__}; eager timing)", flush=True)
        return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def _inputs(t: int, e: int, h: int, k: int, seed: int, device="cuda"):
    import torch

    from .routing import softmax_topk
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, h, device=device, generator=g).to(torch.bfloat16)
    w, ids = softmax_topk(torch.randn(t, e, device=device, generator=g), k, True)
    return x, w, ids


def _measure(ex, cfg: MoEConfig, x, w, ids, want, tol: float, rep: float, label: str):
    """(us, rel err) of cfg, or None when it fails or is wrong; printed either way."""
    ex.config = cfg
    try:
        err = _rel(ex.forward(x, w, ids), want)
        if not err <= tol:
            print(f"    {label}: rejected, rel err {err:.2e} > {tol:.0e}  {cfg}", flush=True)
            return None
        us = _time_us(lambda: ex.forward(x, w, ids), rep)
    except Exception as exc:  # noqa: BLE001 - a candidate that does not compile or launch is dropped
        print(f"    {label}: failed {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
              flush=True)
        return None
    finally:
        ex.config = None
    print(f"    {label}: {us:.1f} us, rel err {err:.1e}  {cfg}", flush=True)
    return us, err


def tune(shape: tuple[int, int, int, int], fmt: str, tokens: list[int], *, max_candidates: int | None = None,
         rep: float = 25.0, tol: float = 2e-2, seed: int = 0, weights=None) -> dict:
    """Sweep; returns {tokens: {"config": dict, "us", "default_us", "rel_err", "checked"}} (winners)."""
    import torch

    from .reference import TorchExperts
    from .triton_moe import TritonExperts
    e, h, i, k = shape
    weights = weights if weights is not None else random_weights(fmt, e, h, i, seed=seed)
    dev = weights.device
    ex = TritonExperts(weights, tuned_table={})
    ref = TorchExperts(weights)
    winners = {}
    for t in tokens:
        x, w, ids = _inputs(t, e, h, k, seed + t, dev)
        want = ref.forward(x, w, ids)
        cands = candidate_configs(fmt, t * k, e, ex.frag, max_candidates, inter=i)
        print(f"  T={t}: {len(cands)} candidates", flush=True)
        results = []   # (us, err, cfg)
        default_us = None
        for j, cfg in enumerate(cands):
            r = _measure(ex, cfg, x, w, ids, want, tol, rep, f"#{j}" + (" default" if j == 0 else ""))
            if r is not None:
                results.append((r[0], r[1], cfg))
                if j == 0:
                    default_us = r[0]
        if not results:
            print(f"  T={t}: no candidate passed; nothing written for this size", flush=True)
            continue
        base = cands[0]
        best1 = min((r for r in results if r[2].gemm2 == base.gemm2), key=lambda r: r[0], default=None)
        best2 = min((r for r in results if r[2].gemm1 == base.gemm1), key=lambda r: r[0], default=None)
        if best1 and best2 and best1[2].gemm1 != base.gemm1 and best2[2].gemm2 != base.gemm2:
            combo = dataclasses.replace(base, gemm1=best1[2].gemm1, gemm2=best2[2].gemm2)
            r = _measure(ex, combo, x, w, ids, want, tol, rep, "combined")
            if r is not None:
                results.append((r[0], r[1], combo))
        us, err, cfg = min(results, key=lambda r: r[0])
        winners[t] = {"config": config_to_dict(cfg), "us": round(us, 2),
                      "default_us": None if default_us is None else round(default_us, 2),
                      "rel_err": float(f"{err:.3e}"), "checked": len(results)}
        print(f"  T={t}: winner {us:.1f} us" + ("" if default_us is None else f" (default {default_us:.1f} us)")
              + f"  {cfg}", flush=True)
        del x, w, ids, want
    del ex
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return winners


def write_table(path: str, device: str, key: str, winners: dict, meta: dict) -> dict:
    """Merge the winners into the table at path (created when absent): the swept buckets of this
    shape replaced, everything else kept."""
    table = load_table(path) or {"format_version": TABLE_VERSION, "device": device, "entries": {}, "meta": {}}
    if table.get("device") not in (None, device):
        raise ValueError(f"{path} is the table of {table['device']!r}, not of {device!r}")
    entry = table["entries"].setdefault(key, {})
    entry.update({str(t): v for t, v in sorted(winners.items())})
    table["entries"][key] = dict(sorted(entry.items(), key=lambda kv: int(kv[0])))
    table.setdefault("meta", {})[key] = meta
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return table


def verify_table(path: str, shape, fmt: str, tokens: list[int], tol: float, seed: int = 0, weights=None) -> bool:
    """Read the file back through the kernels' lookup; the config each size then runs must be the
    table's, and its output must match the reference."""
    from .reference import TorchExperts
    from .triton_moe import TritonExperts
    e, h, i, k = shape
    table = load_table(path)
    want_cfgs = tuned_configs(table, fmt, e, h, i, k)
    weights = weights if weights is not None else random_weights(fmt, e, h, i, seed=seed + 1)
    ex = TritonExperts(weights, tuned_table=table)
    ref = TorchExperts(weights)
    ok = True
    for t in tokens:
        if t not in want_cfgs:
            continue
        x, w, ids = _inputs(t, e, h, k, seed + 1000 + t, weights.device)
        cfg = ex.config_for(t * k, k)
        err = _rel(ex.forward(x, w, ids), ref.forward(x, w, ids))
        good = cfg == want_cfgs[t] and err <= tol
        ok &= good
        print(f"  verify T={t}: {'ok' if good else 'FAILED'} (table config used: {cfg == want_cfgs[t]}, "
              f"rel err {err:.1e})", flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_kernels.tune", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, help="E,H,I,topk (experts, hidden, intermediate per rank, top-k)")
    ap.add_argument("--format", required=True, choices=["nvfp4", "mxfp4", "bf16", "fp8"])
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096")
    ap.add_argument("-o", "--output", default="", help="table file (default: this GPU's, triton_config.table_path)")
    ap.add_argument("--max-candidates", type=int, default=0, help="per token count, default first (0: all)")
    ap.add_argument("--rep", type=float, default=25.0, help="ms per timing")
    ap.add_argument("--tol", type=float, default=2e-2, help="max relative error against the torch reference")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch
    import triton
    if not torch.cuda.is_available():
        print("moe_kernels.tune: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        shape = tuple(int(v) for v in args.shape.split(","))
        assert len(shape) == 4
    except (ValueError, AssertionError):
        print(f"--shape wants E,H,I,topk, got {args.shape!r}", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    device = torch.cuda.get_device_name()
    path = args.output or table_path(device)
    print(f"tuning {args.format} E,H,I,topk={shape} on {device} (torch {torch.__version__}, triton "
          f"{triton.__version__}) for {tokens} tokens -> {path}", flush=True)
    winners = tune(shape, args.format, tokens, max_candidates=args.max_candidates or None, rep=args.rep,
                   tol=args.tol, seed=args.seed)
    if not winners:
        print("no size produced a checked winner: no table written", file=sys.stderr)
        return 1
    meta = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "rep_ms": args.rep, "tol": args.tol, "max_candidates": args.max_candidates or None}
    write_table(path, device, shape_key(args.format, *shape), winners, meta)
    print(f"wrote {len(winners)} sizes to {path}", flush=True)
    ok = verify_table(path, shape, args.format, tokens, args.tol, args.seed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
