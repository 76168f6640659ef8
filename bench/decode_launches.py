"""Per-launch decode timings (align, gate/up GEMM, down GEMM, finalize) of the Triton FP4 experts,
old hand-prefetch loop vs the cp.async-pipelined loop (GemmConfig.pipe), plus correctness."""
import os, sys, time, json
import torch, triton, triton.testing
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
sys.path.insert(0, os.path.dirname(__file__))
from bench_moe import random_weights, rel, E, H, I, K  # noqa: E402
from moe_kernels.reference import TorchExperts  # noqa: E402
from moe_kernels.routing import softmax_topk  # noqa: E402
from moe_kernels.triton_align import align_by_expert  # noqa: E402
from moe_kernels.finalize import moe_finalize_fuse_shared  # noqa: E402
from moe_kernels.triton_moe import TritonExperts, MoEConfig, GemmConfig, default_config  # noqa: E402

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
OLD = MoEConfig(1, GemmConfig(32, 64, 4, 1, fma=True), GemmConfig(64, 64, 4, 1, fma=True))
FFMA = MoEConfig(1, GemmConfig(32, 64, 4, 1, fma=True, pipe=4), GemmConfig(64, 64, 4, 1, fma=True, pipe=4))
MMA = MoEConfig(1, GemmConfig(32, 64, 4, 1, fma=True, pipe=4, mma=True), GemmConfig(32, 64, 4, 1, fma=True, pipe=4, mma=True))
FULL = {"old": OLD, "ffma-pipe": FFMA, "mma-pipe": MMA}
G1 = {"old": OLD.gemm1, "ffma32": FFMA.gemm1, "mma32s4": MMA.gemm1,
      "mma32s6": GemmConfig(32, 64, 4, 1, fma=True, pipe=6, mma=True),
      "mma16w2": GemmConfig(16, 64, 2, 1, fma=True, pipe=4, mma=True)}
G2 = {"old": OLD.gemm2, "ffma64": FFMA.gemm2, "mma32s4": MMA.gemm2,
      "mma32s6": GemmConfig(32, 64, 4, 1, fma=True, pipe=6, mma=True),
      "mma64w8": GemmConfig(64, 64, 8, 1, fma=True, pipe=4, mma=True)}
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
        inter32 = torch.empty(al.p_max, I, dtype=torch.float32, device="cuda")
        inter16 = torch.empty(al.p_max, I, dtype=torch.bfloat16, device="cuda")
        g2o = torch.empty(al.p_max, H, dtype=torch.bfloat16, device="cuda")
        t_fin = us(lambda: moe_finalize_fuse_shared(g2o, w, al.perm, None, 1.0))
        t1, t2, tf, ef = {}, {}, {}, {}
        for k, c in G1.items():
            buf = inter16 if c.mma else inter32
            t1[k] = tm(lambda: ex._launch(ex.w13, x, buf, al, I, H, c, True, True, K, T * K), "g1 " + k)
        for k, c in G2.items():
            buf = inter16 if c.mma else inter32
            t2[k] = tm(lambda: ex._launch(ex.w2, buf, g2o, al, H, I, c, False, False, K, T * K), "g2 " + k)
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
    for T in (1, 8, 64):  # correctness of the default config + the old path (old configs), timing at 64
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        w, ids = softmax_topk(torch.randn(T, E, device="cuda", generator=g), K, True)
        r = ref.forward(x, w, ids)
        e_def = er(lambda: ex.forward(x, w, ids), r, "default")
        ex.config = FFMA if T < 64 else None
        e_old = er(lambda: ex.forward(x, w, ids), r, "ffma")
        t_def = tm(lambda: ex.forward(x, w, ids), "t64") if T == 64 else 0.0
        ex.config = None
        log(f"   check {fmt} T={T}: default rel err {e_def:.2e}, ffma-pipe rel err {e_old:.2e} {'t=%.1f' % t_def if T == 64 else ''}")
        res["rows"].append(dict(fmt=fmt, T=T, check=e_def, check_old=e_old, t=t_def))
    del ex, ref, weights
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(OUT, "decode.json"), "w"), indent=1)
