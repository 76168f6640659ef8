"""Peer benchmark (issue 20, item 1): sglang's Triton fused MoE against our whole experts forward.

GPU RUN (for the lead; one H200, torch 2.11, Triton 3.6, no sglang installed, no internet):
  here, once:    mkdir -p .whl && cp /tmp/sgl/sglang-0.5.14-cp311-cp311-manylinux_2_34_x86_64.whl .whl/
  on the device (run tool, carry [".whl"]; .whl/ is gitignored, 12 MB):
      PYTHONPATH=kernels:operator python bench/bench_peer_sglang.py --quick \
          --sglang-wheel .whl/sglang-0.5.14-cp311-cp311-manylinux_2_34_x86_64.whl --json $OUT/peer_sglang.json
  Expected: about 2-3 minutes on a fresh H200 (most of it Triton compiles: the peer's candidate configs
  and our kernels; then ~1 s of timing per candidate). --quick = 3 shapes (DeepSeek-V3 TP8, whole
  DeepSeek-V3 layer, gpt-oss-120b) x 1 / 64 / 4096 tokens, 2 peer configs per dtype per cell.
  A time guard (--budget-s, 150 s with --quick) starts no new cell past it: the cells already run are
  printed and in the JSON (written after every cell). Each cell and each candidate fails on its own:
  an error is printed and the run goes on. Give the run tool timeout_s=420 (the guard plus the
  cell in flight, the DeepSeek-V3-layer setup and compiles). Not yet run on a GPU: check the first
  lines (peer loaded, copy bandwidth) and the rel err columns (ours ~5e-3, sglang bf16 ~5e-3, sglang
  FP8 W8A8 a few 1e-2) before reading the ratios. Full run (no --quick): 6 shapes x 6 token counts,
  ~220 peer candidates, well over 10 minutes: split it with --shapes (and raise --budget-s).

What is timed (CUDA-graph replays, triton.testing.do_bench_cudagraph: warm-up, CUDA events, median
of 10 replays of a ~rep-ms graph; bench_moe.bench):
- ours: TritonExperts.forward (moe_kernels.triton_moe), default config, FP4 weights (NVFP4; gpt-oss
  MXFP4, its native format): everything from routed tokens to the finalized [T, H] output.
- peer: sglang's `invoke_fused_moe_kernel` (the launcher of `fused_moe_kernel`, loaded from the wheel
  by bench/peer_sglang.py, unchanged), GEMM1 + GEMM2 only, as issue 20 measured it: its alignment,
  the activation quantization (FP8), SiLU*up between the GEMMs and the top-k sum are not timed.
  bf16 weights (the dequantized FP4 weights) and FP8 W8A8 with 128x128 weight blocks (the same weights
  quantized, per-token-group-128 FP8 activations); best of its candidates per cell: sglang's tuned
  H200 table for (E, N=I, dtype) when the wheel has one (nearest token count, as sglang picks),
  sglang's default config, and a few standard configs (see CANDIDATES). FP8 needs H and I
  multiples of 128 (not gpt-oss: n/a there).
- At small sizes the touched weights would stay in L2 (50 MB) from one graph replay to the next:
  each timed call then cycles through several routings (`rotations`: ~3x L2 of weights, at most 16)
  and the time is per forward. Printed as "xN routings".
- ratio = peer time / our time (> 1: ours faster). limit = weight bytes of the touched experts / copy
  bandwidth measured in this run (read + write of a 2 GiB bf16 copy): FP4 for ours, also FP8's.
- rel err = ||out - torch reference|| / ||reference|| (reference: moe_kernels.reference on the same
  bf16 weights); the peer's output is its GEMM2 rows summed over top-k in torch.

  python bench/bench_peer_sglang.py [--quick] [--shapes dsv3-tp8,gpt-oss-120b] [--tokens 1,8,64]
      [--sglang-wheel PATH] [--ours-format auto|nvfp4|mxfp4] [--rep 20] [--budget-s 150] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "kernels"))
sys.path.append(os.path.join(HERE, "..", "operator"))   # moe_core, where the package is not installed

import triton  # noqa: E402

from bench_moe import bench, copy_bandwidth, dequantized_bf16, random_weights, rel  # noqa: E402
from moe_kernels import formats as F  # noqa: E402
from moe_kernels.experts import ExpertWeights  # noqa: E402
from moe_kernels.reference import TorchExperts  # noqa: E402
from moe_kernels.routing import softmax_topk  # noqa: E402
from moe_kernels.triton_moe import TritonExperts  # noqa: E402
from peer_sglang import PeerMoE, SglangPeer, clear_fp8, nearest  # noqa: E402

DEV = "cuda"

# (experts, hidden, intermediate per rank, top-k)
SHAPES = {
    "dsv3-tp8": (256, 7168, 256, 8),        # DeepSeek-V3 / R1 at TP8
    "kimi-k2-tp8": (384, 7168, 256, 8),     # Kimi-K2 at TP8
    "qwen3-30b-a3b": (128, 2048, 768, 8),   # Qwen3-30B-A3B
    "qwen3-235b-tp4": (128, 4096, 384, 8),  # Qwen3-235B at TP4
    "dsv3-layer": (256, 7168, 2048, 8),     # a whole DeepSeek-V3 layer on one GPU
    "gpt-oss-120b": (128, 2880, 2880, 4),   # gpt-oss-120b (native MXFP4)
}
TOKENS = (1, 8, 64, 256, 1024, 4096)
QUICK_SHAPES = ("dsv3-tp8", "dsv3-layer", "gpt-oss-120b")
QUICK_TOKENS = (1, 64, 4096)


def _cfg(m, n, k, g, w=4, s=3):
    return {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": g, "num_warps": w,
            "num_stages": s}


# Standard candidates besides sglang's own table/default, by rows per touched expert (<= 4, <= 32,
# more); FP8 block-scale needs BLOCK_SIZE_K = 128 (one scale group per K step). --quick: sglang's
# tuned entry and its default, the first standard one only where the wheel has no tuned table.
CANDIDATES = {
    ("bf16", 0): [_cfg(16, 64, 128, 1, 4, 4), _cfg(16, 128, 64, 1, 4, 4)],
    ("bf16", 1): [_cfg(32, 128, 64, 8, 4, 4), _cfg(16, 128, 64, 1, 4, 4)],
    ("bf16", 2): [_cfg(128, 128, 64, 8, 8, 4), _cfg(64, 128, 64, 8, 4, 4)],
    ("fp8", 0): [_cfg(16, 128, 128, 1, 4, 4), _cfg(16, 64, 128, 1, 4, 5)],
    ("fp8", 1): [_cfg(32, 128, 128, 8, 4, 3), _cfg(64, 128, 128, 1, 4, 3)],
    ("fp8", 2): [_cfg(128, 128, 128, 32, 8, 3), _cfg(128, 256, 128, 32, 8, 3)],
}


def sglang_default(m: int, e: int, fp8: bool) -> dict:
    """sglang's get_default_config (fused_moe_triton_config.py) for bf16 and FP8 block 128x128."""
    if fp8:
        return _cfg(64, 128, 128, 32, 4, 3)
    if m <= e:
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}


def candidates(peer: SglangPeer, dtype: str, shape, t: int, quick: bool):
    """[(label, up config, down config or None)] for one cell, without duplicates."""
    e, h, i, k = shape
    fp8 = dtype == "fp8"
    dt, bs = ("fp8_w8a8", [128, 128]) if fp8 else (None, None)
    out = []
    table, path = peer.tuned(e, i, dt, bs)
    if table:
        down_table, _ = peer.tuned(e, i, dt, bs, down=True)
        out.append(("tuned " + os.path.basename(os.path.dirname(path)), nearest(table, t),
                    nearest(down_table, t) if down_table else None))
    out.append(("sglang default", sglang_default(t, e, fp8), None))
    rows = t * k / max(1, min(e, t * k))
    regime = 0 if rows <= 4 else (1 if rows <= 32 else 2)
    std = CANDIDATES[(dtype, regime)]
    std = ([] if table else std[:1]) if quick else std
    out += [(f"std{j}", c, None) for j, c in enumerate(std)]
    seen, uniq = set(), []
    for label, up, down in out:
        key = (tuple(sorted(up.items())), tuple(sorted(down.items())) if down else None)
        if key not in seen:
            seen.add(key)
            uniq.append((label, up, down))
    return uniq


def cfg_str(c: dict) -> str:
    return "{}x{}x{} g{} w{} s{}".format(c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K"],
                                         c.get("GROUP_SIZE_M", 1), c.get("num_warps", "-"), c.get("num_stages", "-"))


def fp8_block_weights(w: torch.Tensor, chunk: int = 8):
    """bf16 [E, N, K] -> (float8_e4m3fn [E, N, K], fp32 scale_inv [E, N/128, K/128]), a few experts at a time."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = None
    for e0 in range(0, w.shape[0], chunk):
        t = F.quantize_fp8_block(w[e0:e0 + chunk])
        if s is None:
            s = torch.empty((w.shape[0], *t.scale_inv.shape[1:]), dtype=torch.float32, device=w.device)
        q[e0:e0 + chunk], s[e0:e0 + chunk] = t.weight, t.scale_inv
    return q, s


def rotations(touched_bytes: float) -> int:
    """Routings to cycle through per timed call so that one forward's weights are not still in L2 from
    the previous replay (at 1 token a TP8 shard's 8 experts are 22-44 MB: L2-resident otherwise)."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) or (50 << 20)
    return int(min(16, max(1, -(-3 * l2 // max(1, int(touched_bytes))))))


def run_peer(peer, label_dtype, pm: PeerMoE, cands, inputs, want, rep):
    """Best (us, label, config, rel err) over the candidates; every candidate printed. inputs: the
    routings [(x, w, ids)] run one after the other per timed call (time per forward = time / len)."""
    best = None
    for label, up, down in cands:
        try:
            preps = [pm.prepare(x, w, ids, up, down) for x, w, ids in inputs]
            run, out = (lambda: [p[0]() for p in preps]), preps[0][1]
            err = rel(out, want)
            us = bench(run, rep=rep) * 1e6 / len(inputs)
        except Exception as exc:  # noqa: BLE001 - one candidate failing does not stop the cell
            print(f"    sglang {label_dtype} {label} {cfg_str(up)}: failed {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:200] if str(exc) else ''}", flush=True)
            continue
        print(f"    sglang {label_dtype} {label} {cfg_str(up)}"
              + (f" down {cfg_str(down)}" if down else "") + f": {us:.1f} us, rel err {err:.1e}", flush=True)
        if best is None or us < best[0]:
            best = (us, label, up, err)
        del run, out, preps
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="", help=f"comma list of {','.join(SHAPES)}")
    ap.add_argument("--tokens", default="")
    ap.add_argument("--sglang-wheel", default=None, help="default: newest sglang-*.whl in .whl/, then /tmp/sgl")
    ap.add_argument("--ours-format", default="auto", help="auto (NVFP4; gpt-oss MXFP4) | nvfp4 | mxfp4")
    ap.add_argument("--rep", type=float, default=None, help="ms per timing (default 20 with --quick, else 50)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no cell after this many seconds (default 150 with --quick, else 540)")
    ap.add_argument("--json", default="")
    ap.add_argument("--tc-peak", type=float, default=790e12,
                    help="bf16 tensor-core FLOP/s for the compute floor (H200 dense bf16 measured here: ~790e12)")
    args = ap.parse_args()
    t_start = time.monotonic()
    shapes = args.shapes.split(",") if args.shapes else list(QUICK_SHAPES if args.quick else SHAPES)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(QUICK_TOKENS if args.quick else TOKENS)
    rep = args.rep or (20 if args.quick else 50)
    budget = args.budget_s if args.budget_s is not None else (150 if args.quick else 540)
    if not torch.cuda.is_available():
        sys.exit("bench_peer_sglang: needs a CUDA GPU")
    for s in shapes:
        if s not in SHAPES:
            sys.exit(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    peer = SglangPeer(args.sglang_wheel)
    print(peer.describe(), flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "sglang": peer.version, "copy_bw": bw, "rep_ms": rep, "rows": [], "skipped": []}

    def dump():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    g = torch.Generator(device=DEV).manual_seed(0)
    for name in shapes:
        e, h, i, k = SHAPES[name]
        if time.monotonic() - t_start > budget:
            results["skipped"] += [f"{name} T={t}" for t in tokens]
            print(f"[{name}] skipped: time budget ({budget:.0f} s) spent", flush=True)
            continue
        fmt = args.ours_format if args.ours_format != "auto" else ("mxfp4" if name == "gpt-oss-120b" else "nvfp4")
        t0 = time.monotonic()
        ex = ref = pm16 = pm8 = None
        try:
            weights = random_weights(fmt, g, e, h, i)
            fp4_bytes = weights.nbytes_per_expert()
            try:
                ex = TritonExperts(weights)
            except Exception as exc:  # noqa: BLE001
                print(f"[{name}] ours: TritonExperts failed: {type(exc).__name__}: {exc}", flush=True)
            w13, w2 = dequantized_bf16(weights)
            del weights
            ref = TorchExperts(ExpertWeights("bf16", w13, w2))
            pm16 = PeerMoE(peer, w13, w2)
            if h % 128 == 0 and i % 128 == 0:
                q13, s13 = fp8_block_weights(w13)
                q2, s2 = fp8_block_weights(w2)
                pm8 = PeerMoE(peer, q13, q2, s13, s2)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            print(f"[{name}] setup failed: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
            results["skipped"] += [f"{name} T={t} (setup failed)" for t in tokens]
            ex = ref = pm16 = pm8 = None
            torch.cuda.empty_cache()
            continue
        fp8_bytes = 3 * i * h + 4 * (-(-2 * i // 128) * -(-h // 128) + -(-h // 128) * -(-i // 128))
        print(f"[{name}] E={e} H={h} I={i} top-{k}, ours {fmt}: setup {time.monotonic() - t0:.1f} s, "
              f"{fp4_bytes / 1e6:.2f} MB per expert ({fmt}), {fp8_bytes / 1e6:.2f} MB (fp8)", flush=True)
        for t in tokens:
            if time.monotonic() - t_start > budget:
                results["skipped"].append(f"{name} T={t}")
                print(f"  T={t}: skipped (time budget {budget:.0f} s spent)", flush=True)
                continue
            try:
                def routing():
                    x = torch.randn(t, h, device=DEV, generator=g).to(torch.bfloat16)
                    return (x, *softmax_topk(torch.randn(t, e, device=DEV, generator=g), k, True))
                inputs = [routing()]
                touched = int(torch.unique(inputs[0][2]).numel())
                inputs += [routing() for _ in range(rotations(touched * fp4_bytes) - 1)]
                mean_touched = sum(int(torch.unique(r[2]).numel()) for r in inputs) / len(inputs)
                x, w, ids = inputs[0]
                want = ref.forward(x, w, ids)
            except Exception as exc:  # noqa: BLE001
                print(f"  T={t}: inputs/reference failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            row = dict(shape=name, E=e, H=h, I=i, top_k=k, tokens=t, experts=touched, ours_format=fmt,
                       rotations=len(inputs), limit_fp4_us=mean_touched * fp4_bytes / bw * 1e6,
                       limit_fp8_us=mean_touched * fp8_bytes / bw * 1e6,
                       limit_bf16_us=mean_touched * 6 * i * h / bw * 1e6,
                       # tensor-core floor: 2 * pairs * H * 3I FLOP at the bf16 rate (ours: W4A16 runs bf16 MMAs)
                       limit_tc_us=2 * t * k * h * 3 * i / args.tc_peak * 1e6)
            if ex is not None:
                try:
                    err = rel(ex.forward(x, w, ids), want)
                    fwd = lambda: [ex.forward(*r) for r in inputs]  # noqa: E731
                    row.update(ours_us=bench(fwd, rep=rep) * 1e6 / len(inputs), ours_rel_err=err)
                except Exception as exc:  # noqa: BLE001
                    print(f"    ours failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            for dtype, pm in (("bf16", pm16), ("fp8", pm8)):
                if pm is None:
                    continue
                best = run_peer(peer, dtype, pm, candidates(peer, dtype, SHAPES[name], t, args.quick),
                                inputs, want, rep)
                if best:
                    row.update({f"{dtype}_us": best[0], f"{dtype}_config": f"{best[1]}: {cfg_str(best[2])}",
                                f"{dtype}_rel_err": best[3]})
                    if "ours_us" in row:
                        row[f"{dtype}_ratio"] = best[0] / row["ours_us"]
            clear_fp8()
            results["rows"].append(row)
            dump()
            ours = (f"ours {row['ours_us']:8.1f} us ({100 * row['limit_fp4_us'] / row['ours_us']:4.0f}% of "
                    f"{row['limit_fp4_us']:.1f}, err {row['ours_rel_err']:.1e})" if "ours_us" in row else "ours -")
            peers = "".join(f" | sglang {d} {row[d + '_us']:8.1f} us" + (f" x{row[d + '_ratio']:.2f}" if d + "_ratio" in row else "")
                            + f" [{row[d + '_config']}]" for d in ("bf16", "fp8") if d + "_us" in row)
            tc = (f" | bf16 MMA floor {row['limit_tc_us']:.1f} us"
                  + (f" ({100 * row['limit_tc_us'] / row['ours_us']:.0f}% of peak)" if "ours_us" in row else ""))
            print(f"  {name} T={t:5d} experts={touched:3d} x{len(inputs)} routings | {ours}{peers}{tc} | limit fp8 {row['limit_fp8_us']:.1f} us "
                  f"[{time.monotonic() - t_start:.0f} s]", flush=True)
        ex = ref = pm16 = pm8 = None
        w13 = w2 = q13 = q2 = None
        torch.cuda.empty_cache()

    def f(r, key, fmt="{:.1f}"):
        return fmt.format(r[key]) if key in r else "-"

    def tc_pct(r):
        return f"{100 * r['limit_tc_us'] / r['ours_us']:.0f}%" if "ours_us" in r else "-"
    print(f"\nsglang {peer.version} vs ours, {results['device']}, copy bandwidth {bw / 1e12:.2f} TB/s; "
          "ratio = sglang time / ours (> 1: ours faster)\n")
    print("| shape (E, H, I, top-k) | tokens | experts | ours (us) | FP4 limit (us) | % of limit | sglang bf16 (us) "
          "| bf16 / ours | sglang FP8 W8A8 (us) | FP8 / ours | FP8 limit (us) | bf16 MMA floor (us) | % of bf16 peak "
          "| ours rel err | FP8 rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        pct = f"{100 * r['limit_fp4_us'] / r['ours_us']:.0f}%" if "ours_us" in r else "-"
        print(f"| {r['shape']} ({r['E']}, {r['H']}, {r['I']}, {r['top_k']}) | {r['tokens']} | {r['experts']} | "
              f"{f(r, 'ours_us')} | {r['limit_fp4_us']:.1f} | {pct} | {f(r, 'bf16_us')} | {f(r, 'bf16_ratio', '{:.2f}x')} | "
              f"{f(r, 'fp8_us')} | {f(r, 'fp8_ratio', '{:.2f}x')} | {r['limit_fp8_us']:.1f} | {r['limit_tc_us']:.1f} | "
              f"{tc_pct(r)} | "
              f"{f(r, 'ours_rel_err', '{:.1e}')} | {f(r, 'fp8_rel_err', '{:.1e}')} |")
    if results["skipped"]:
        print(f"\nskipped (time budget or setup): {', '.join(results['skipped'])}")
    print(f"\ntotal {time.monotonic() - t_start:.0f} s")
    dump()


if __name__ == "__main__":
    main()
