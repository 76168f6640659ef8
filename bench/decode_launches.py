"""Per-launch decode timings (align, gate/up GEMM, down GEMM, finalize) of the one-row FP4 loop
(GemmConfig.one_row: the decode path without the fragment copy) at a few block / stage / warp
variants, plus correctness. The loops it was first compared with are retired (bench/README.md)."""
import os, sys, time, json
import torch, triton, triton.testing
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
sys.path.insert(0, os.path.dirname(__file__))
from bench_moe import random_weights, rel, E, H, I, K  # noqa: E402
from moe_kernels.reference import TorchExperts  # noqa: E402
from moe_kernels.routing import softmax_topk  # noqa: E402
from moe_kernels.triton_align import align_by_expert  # noqa: E402
from moe_kernels.finalize import moe_finalize_fuse_shared  # noqa: E402
from moe_kernels.triton_config import GemmConfig, MoEConfig  # noqa: E402
from moe_kernels.triton_moe import TritonExperts  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
def us(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
def log(*a):
    print(*a, flush=True)
def tm(fn, what=""):
    try:
        return us(fn)
    except Exception as exc:  # noqa: BLE001
        log(f"  FAILED {what}: {type(exc).__name__}: {str(exc)[:300]}")
        return float("nan")
def er(fn, r, what=""):
    try:
        return rel(fn(), r)
    except Exception as exc:  # noqa: BLE001
        log(f"  FAILED {what}: {type(exc).__name__}: {str(exc)[:300]}")
        return float("nan")

g = torch.Generator(device="cuda").manual_seed(0)
n = 1 << 29
a = torch.empty(n, device="cuda", dtype=torch.bfloat16); b = torch.empty_like(a)
bw = 4 * n / (triton.testing.do_bench(lambda: b.copy_(a), rep=50, return_mode="median") * 1e-3)
del a, b
log(f"copy bw {bw/1e12:.2f} TB/s")
MMA = MoEConfig(1, GemmConfig(32, 64, 4, 1, one_row=True, pipe=4), GemmConfig(32, 64, 4, 1, one_row=True, pipe=4))
FULL = {"mma-pipe": MMA}
# (num_warps follows from block_n in the one-row loop: 8 weight bytes per thread)
G1 = {"mma32s4": MMA.gemm1, "mma32s6": GemmConfig(32, 64, 4, 1, one_row=True, pipe=6),
      "mma16w2": GemmConfig(16, 64, 2, 1, one_row=True, pipe=4)}
G2 = {"mma32s4": MMA.gemm2, "mma32s6": GemmConfig(32, 64, 4, 1, one_row=True, pipe=6),
      "mma64w8": GemmConfig(64, 64, 8, 1, one_row=True, pipe=4)}
res = {"bw": bw, "rows": []}
for fmt in ("nvfp4", "mxfp4"):
    t0 = time.time()
    weights = random_weights(fmt, g)
    ex = TritonExperts(weights)
    ref = TorchExperts(weights)
    pe = weights.nbytes_per_expert()
    log(f"[{fmt}] setup {time.time()-t0:.1f}s")
    for T in (1, 8):
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        w, ids = softmax_topk(torch.randn(T, E, device="cuda", generator=g), K, True)
        touched = int(torch.unique(ids).numel())
        lim = touched * pe / bw * 1e6
        al = align_by_expert(ids, E, 1)
        t_al = us(lambda: align_by_expert(ids, E, 1))
        inter = torch.empty(al.p_max, I, dtype=torch.bfloat16, device="cuda")
        g2o = torch.empty(al.p_max, H, dtype=torch.bfloat16, device="cuda")
        t_fin = us(lambda: moe_finalize_fuse_shared(g2o, w, al.perm, None, 1.0))
        t1, t2, tf, ef = {}, {}, {}, {}
        for k, c in G1.items():
            t1[k] = tm(lambda: ex._launch(ex.w13, x, inter, al, I, H, c, True, K, T * K, True), "g1 " + k)
        for k, c in G2.items():
            t2[k] = tm(lambda: ex._launch(ex.w2, inter, g2o, al, H, I, c, False, K, T * K, True), "g2 " + k)
        r = ref.forward(x, w, ids)
        for k, c in FULL.items():
            ex.config = c
            ef[k] = er(lambda: ex.forward(x, w, ids), r, "fwd " + k)
            tf[k] = tm(lambda: ex.forward(x, w, ids), "fwd " + k)
        ex.config = None
        log(f"{fmt} T={T} experts={touched} limit {lim:.1f} | align {t_al:.1f} finalize {t_fin:.1f}")
        log("   gemm1: " + " ".join(f"{k}={v:.1f}" for k, v in t1.items()))
        log("   gemm2: " + " ".join(f"{k}={v:.1f}" for k, v in t2.items()))
        log("   forward: " + " ".join(f"{k}={v:.1f}us ({100*lim/v:.0f}%, err {ef[k]:.1e})" for k, v in tf.items()))
        res["rows"].append(dict(fmt=fmt, T=T, experts=touched, limit=lim, align=t_al, fin=t_fin, g1=t1, g2=t2,
                                full=tf, err=ef))
    for T in (1, 8, 64):  # correctness of the default config and of the one-row loop, timing at 64
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        w, ids = softmax_topk(torch.randn(T, E, device="cuda", generator=g), K, True)
        r = ref.forward(x, w, ids)
        e_def = er(lambda: ex.forward(x, w, ids), r, "default")
        ex.config = MMA if T < 64 else None
        e_row = er(lambda: ex.forward(x, w, ids), r, "one-row")
        t_def = tm(lambda: ex.forward(x, w, ids), "t64") if T == 64 else 0.0
        ex.config = None
        log(f"   check {fmt} T={T}: default rel err {e_def:.2e}, one-row rel err {e_row:.2e} {'t=%.1f' % t_def if T == 64 else ''}")
        res["rows"].append(dict(fmt=fmt, T=T, check=e_def, check_one_row=e_row, t=t_def))
    del ex, ref, weights
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(OUT, "decode.json"), "w"), indent=1)
