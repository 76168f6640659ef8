"""The Triton MoE kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1): catches
indexing, packing and masking bugs in CI without a GPU. Runs in a subprocess because the
interpreter flag must be set before Triton is imported. GPU numerics are tested in tests/gpu."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import os, sys, torch
from moe_kernels.experts import ExpertWeights
from moe_kernels.reference import TorchExperts
from moe_kernels.triton_config import GemmConfig, MoEConfig
from moe_kernels.triton_moe import TritonExperts
from moe_kernels.routing import softmax_topk
from moe_kernels.triton_align import align_by_expert
torch.manual_seed(0)
E, H, I = 8, 256, 128
fmt, t, k, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
swap = mode == "swap"
w13 = torch.randn(E, 2 * I, H) / 16
w2 = torch.randn(E, H, I) / 11
ew = ExpertWeights.from_dense(w13, w2, fmt)
x = torch.randn(t, H).bfloat16()
w, ids = softmax_topk(torch.randn(t, E), k, True)
ids[0, -1] = -1   # an expert of another rank
shared = torch.randn(t, H).bfloat16()
ref = TorchExperts(ew).forward(x, w, ids, shared_output=shared, routed_scale=1.5)
cfg = MoEConfig(16, GemmConfig(32, 128, 4, 1, swap=swap), GemmConfig(64, 64, 4, 1, swap=swap))
if mode == "row":  # one row per block: the one-row FP4 decode loop (its portable decode here)
    cfg = MoEConfig(1, GemmConfig(32, 64, 4, 1, one_row=True, pipe=3), GemmConfig(64, 64, 4, 1, one_row=True, pipe=3))
out = TritonExperts(ew, cfg).forward(x, w, ids, shared_output=shared, routed_scale=1.5)
err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
al = align_by_expert(ids, E, 16)
perm = al.perm.long()
n = int(al.num_post_pad)
valid = torch.ones(t * k, dtype=torch.bool)
valid[k - 1] = False
ok_perm = bool(((perm >= 0) == valid).all() and len(set(perm[perm >= 0].tolist())) == int((perm >= 0).sum())
               and (al.sorted_ids[perm[perm >= 0]] == torch.arange(t * k)[perm >= 0]).all() and n % 16 == 0)
print("RESULT", err, ok_perm)
"""


@pytest.mark.parametrize("fmt,mode", [(f, m) for f in ("bf16", "fp8", "nvfp4", "mxfp4") for m in ("mma", "swap")]
                         + [(f, "row") for f in ("nvfp4", "mxfp4")])
def test_triton_moe_in_interpreter(fmt, mode):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", SCRIPT, fmt, "5", "3", mode], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")][-1]
    _, err, ok_perm = line.split()
    # the interpreter rounds fp32 -> bf16 by truncation, hence a looser bound than on the GPU
    assert float(err) < 3e-2 and ok_perm == "True"


def _interpret(code: str, marker: str) -> None:
    """Run a script under TRITON_INTERPRET=1 in a subprocess; it must exit 0 and print `marker`."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert marker in res.stdout


MIXED = r"""
import torch
from alignment_checks import check_mixed
from moe_kernels.triton_align import align_mixed
torch.manual_seed(0)
for t, k, e in [(40, 4, 16), (1, 8, 64), (300, 8, 64), (7, 2, 8)]:
    ids = torch.randint(0, e, (t, k), dtype=torch.int32)
    ids[:t // 2 + 1, 0] = 3    # one expert with many rows (several 16-row blocks)
    ids[0, -1] = -1            # another rank's expert
    check_mixed(align_mixed(ids, e), ids, e)
print("MIXED OK")
"""


def test_mixed_alignment_in_interpreter():
    _interpret(MIXED, "MIXED OK")


SPLIT = r"""
import torch
from alignment_checks import check_split
from moe_kernels.triton_align import align_split
torch.manual_seed(0)
for t, k, e, big_m, tail_max in [(300, 8, 16, 32, 16), (300, 8, 16, 64, 40), (40, 4, 16, 16, 0), (7, 2, 8, 32, 31),
                                  (1, 8, 64, 128, 64)]:
    ids = torch.randint(0, e, (t, k), dtype=torch.int32)
    ids[:t // 2 + 1, 0] = 3    # one expert with many rows (several big blocks)
    ids[0, -1] = -1            # another rank's expert
    check_split(align_split(ids, e, big_m, tail_max), ids, e, big_m, tail_max)
# several scatter chunks (128 pairs each); two calls give the same rows
ids = torch.randint(0, 16, (100, 8), dtype=torch.int32)
a, b = align_split(ids, 16, 32, 16), align_split(ids, 16, 32, 16)
check_split(a, ids, 16, 32, 16)
assert torch.equal(a.perm, b.perm) and torch.equal(a.big.sorted_ids, b.big.sorted_ids)
print("SPLIT OK")
"""


def test_split_alignment_in_interpreter():
    """align_split (tl.dot blocks + 16-row tail blocks) through Triton's interpreter."""
    _interpret(SPLIT, "SPLIT OK")


COALESCE = r"""
import torch
import triton
import triton.language as tl
from moe_kernels.triton_frag import _coalesced_column, coalesce_activations

@triton.jit
def cols(out_ptr, K, SUBS: tl.constexpr, BLOCK: tl.constexpr):
    k = tl.arange(0, BLOCK)
    tl.store(out_ptr + k, _coalesced_column(k, SUBS), mask=k < K)

for fmt, subs in (("nvfp4", 2), ("mxfp4", 4)):
    K = 1024
    x = torch.arange(K, dtype=torch.float32)[None, :]
    co = coalesce_activations(x, fmt)[0].long()          # co[position] = logical k stored there
    col = torch.empty(K, dtype=torch.int32)
    cols[(1,)](col, K, SUBS=subs, BLOCK=K)
    assert sorted(col.tolist()) == list(range(K)), "a permutation"
    assert torch.equal(co[col.long()], torch.arange(K)), "GEMM1's store order is coalesce_activations' order"
    assert not torch.equal(co, torch.arange(K))
    # lane t's chunk for (sub-step s, half h) at word 4t + 32s + 16h of a step (the kernel's XCO offsets)
    # holds the K values of its natural-order chunk at word t * 8 * SUBS + 8s + 4h
    step = 64 * subs
    for t in range(4):
        for s in range(subs):
            for h in range(2):
                new = 2 * (4 * t + 32 * s + 16 * h)
                old = 2 * (t * 8 * subs + 8 * s + 4 * h)
                assert torch.equal(co[new:new + 8], torch.arange(old, old + 8)), (fmt, t, s, h)
print("COALESCE OK")
"""


def test_coalesced_activation_order_in_interpreter():
    """The fragment kernel's coalesced activation order: GEMM1's store permutation (run in Triton's
    interpreter) is the torch reorder of x, and it puts each lane's natural chunks where XCO loads them."""
    _interpret(COALESCE, "COALESCE OK")


TAIL_NEEDS_FRAG = r"""
import torch
from moe_kernels.experts import ExpertWeights
from moe_kernels.triton_config import FragConfig, GemmConfig, MoEConfig
from moe_kernels.triton_moe import TritonExperts
ew = ExpertWeights.from_dense(torch.randn(4, 256, 256), torch.randn(4, 256, 128), "nvfp4")
tile = GemmConfig(32, 128, 4, 1)
cfg = MoEConfig(16, tile, tile, tail=(FragConfig(2, 4, 1, 1, 3), FragConfig(2, 4, 1, 1, 3)), tail_rows=8)
ex = TritonExperts(ew, cfg)   # the interpreter cannot run the fragment kernel: no fragment copy
assert not ex.frag
try:
    ex.forward(torch.randn(3, 256).bfloat16(), torch.rand(3, 2), torch.randint(0, 4, (3, 2)))
except ValueError as exc:
    assert "fragment" in str(exc) and "tail" in str(exc), exc
    print("REFUSED OK")
"""


def test_tail_blocks_without_the_fragment_copy_are_refused():
    """An explicit config with tail blocks is refused, not silently run as tiles only."""
    _interpret(TAIL_NEEDS_FRAG, "REFUSED OK")


FUSED_FINALIZE = r"""
import torch, triton, triton.language as tl
from moe_kernels.finalize import finalize_reference
from moe_kernels.triton_frag import _arrive_and_finalize

@triton.jit
def pairwise_down(rows_ptr, c_ptr, stride_cm, w_ptr, s_ptr, out_ptr, count_ptr, routed_scale, N,
                  TOP_K: tl.constexpr, ROWS: tl.constexpr, HAS_SHARED: tl.constexpr):
    # stands in for the pairwise down GEMM: program (pair k, column block n) writes its rows of c
    # (row 8k, as the fragment kernel does), then arrives
    k = tl.program_id(0) % TOP_K
    n = tl.program_id(0) // TOP_K
    offs = n * ROWS + tl.arange(0, ROWS)
    v = tl.load(rows_ptr + k * N + offs, mask=offs < N)
    tl.store(c_ptr + (8 * k) * stride_cm + offs, v, mask=offs < N)
    _arrive_and_finalize(c_ptr, stride_cm, w_ptr, s_ptr, out_ptr, count_ptr, routed_scale, n, N, TOP_K, ROWS, HAS_SHARED)

torch.manual_seed(0)
for top_k, n, rows, wdt, shared in [(8, 300, 64, torch.float32, True), (4, 128, 32, torch.bfloat16, False)]:
    g2 = torch.randn(top_k, n).bfloat16()
    c = torch.full((8 * top_k, n), float("nan")).bfloat16()
    w = torch.rand(1, top_k).to(wdt)
    s = torch.randn(1, n).bfloat16()
    out = torch.full((1, n), float("nan")).bfloat16()
    counts = torch.zeros(16, dtype=torch.int32)
    blocks = triton.cdiv(n, rows)
    for rep in range(2):   # the counters reset themselves: a second forward finalizes again
        out.fill_(float("nan"))
        pairwise_down[(top_k * blocks,)](g2, c, c.stride(0), w, s if shared else out, out, counts, 1.5, n,
                                         TOP_K=top_k, ROWS=rows, HAS_SHARED=shared)
        # the finalize reference's fp32 sum (slot order), rounded to bf16 the interpreter's way
        # (truncation; the GPU rounds to nearest: bit-equality with the finalize kernel is a GPU test)
        acc = torch.zeros(1, n)
        for j in range(top_k):
            acc += c[8 * j].float() * (w[0, j].float() * 1.5)
        if shared:
            acc += s.float()
        ref = (acc.view(torch.int32) & -65536).view(torch.float32).bfloat16()
        assert torch.equal(out, ref), (top_k, n, rep)
        near = finalize_reference(c, w, torch.arange(0, 8 * top_k, 8, dtype=torch.int32), s if shared else None, 1.5)
        assert ((out.float() - near.float()).abs() <= near.float().abs() / 64).all()
        assert int(counts.abs().sum()) == 0, counts
print("FUSED FINALIZE OK")
"""


def test_fused_one_token_finalize_in_interpreter():
    """The one-token finalize fused into the down GEMM: the last of a column block's top-k programs
    sums their rows exactly like the finalize reference (bit-equal) and resets its counter."""
    _interpret(FUSED_FINALIZE, "FUSED FINALIZE OK")


PREFILL = r"""
import sys, torch
from moe_kernels.experts import ExpertWeights
from moe_kernels.reference import TorchExperts
from moe_kernels.triton_config import MoEConfig, PrefillConfig
from moe_kernels.triton_moe import TritonExperts
from moe_kernels.routing import softmax_topk
torch.manual_seed(0)
E, H, I, t, k = 4, 128, 64, 12, 2
fmt, swap, pps, act = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]
ew = ExpertWeights.from_dense(torch.randn(E, 2 * I, H) / 16, torch.randn(E, H, I) / 11, fmt)
kw = {}
if act == "swiglu_oai":
    ew.extras.update(w13_bias=torch.randn(E, 2 * I) / 4, w2_bias=torch.randn(E, H) / 4)
    kw = dict(activation="swiglu_oai")
x = torch.randn(t, H).bfloat16()
w, ids = softmax_topk(torch.randn(t, E), k, True)
ids[0, -1] = -1   # an expert of another rank
ref = TorchExperts(ew, **kw).forward(x, w, ids)
# gate/up tiles of 16 gate + 16 up rows, 32-byte K steps; progs_per_sm=1: 4 programs loop over the tiles
cfg = MoEConfig(16, PrefillConfig(32, 32, 4, 1, 2, swap=swap, progs_per_sm=pps, flatten=pps > 0),
                PrefillConfig(64, 32, 4, 1, 1, swap=swap, progs_per_sm=pps))
out = TritonExperts(ew, cfg, **kw).forward(x, w, ids)
print("RESULT", ((out.float() - ref.float()).norm() / ref.float().norm()).item())
"""


@pytest.mark.parametrize("fmt,swap,pps,act", [("nvfp4", 0, 0, "silu"), ("mxfp4", 1, 1, "swiglu_oai"),
                                              ("nvfp4", 1, 1, "swiglu_oai"), ("mxfp4", 0, 0, "silu")])
def test_prefill_kernel_in_interpreter(fmt, swap, pps, act):
    """The prefill kernel (triton_prefill.py): gate and up rows in one tile, persistent programs,
    biases and the clamped SwiGLU, against the torch reference."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", PREFILL, fmt, str(swap), str(pps), act], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    err = float([ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")][-1].split()[1])
    assert err < 3e-2


W8A8 = r"""
import sys, torch
from moe_kernels.experts import ExpertWeights
from moe_kernels.reference import TorchExperts
from moe_kernels.triton_config import MoEConfig, W8A8Config
from moe_kernels.triton_moe import TritonExperts
from moe_kernels.routing import softmax_topk
torch.manual_seed(0)
E, H, I, t, k = 4, 256, 128, 12, 2
pps, act = int(sys.argv[1]), sys.argv[2]
ew = ExpertWeights.from_dense(torch.randn(E, 2 * I, H) / 16, torch.randn(E, H, I) / 11, "fp8")
kw = {}
if act == "swiglu_oai":
    ew.extras.update(w13_bias=torch.randn(E, 2 * I) / 4, w2_bias=torch.randn(E, H) / 4)
    kw = dict(activation="swiglu_oai")
x = torch.randn(t, H).bfloat16()
w, ids = softmax_topk(torch.randn(t, E), k, True)
ids[0, -1] = -1   # an expert of another rank
ref = TorchExperts(ew, act_quant="fp8", **kw).forward(x, w, ids)
exact = TorchExperts(ew, **kw).forward(x, w, ids)
cfg = MoEConfig(16, W8A8Config(64, 4, 1, 2, pps), W8A8Config(128, 4, 1, 1, pps))
out = TritonExperts(ew, cfg, act_quant="fp8", **kw).forward(x, w, ids)
def rel(a, b): return ((a.float() - b.float()).norm() / b.float().norm()).item()
print("RESULT", rel(out, ref), rel(out, exact), rel(ref, exact))
"""


@pytest.mark.parametrize("pps,act", [(0, "silu"), (1, "swiglu_oai")])
def test_w8a8_kernel_in_interpreter(pps, act):
    """FP8 W8A8 (triton_w8a8.py) against the torch W8A8 reference (reference.act_fp8_roundtrip); its
    distance to the exact W8A16 reference is the quantization's (a kernel skipping it would be far
    closer to the exact one). The interpreter rounds bf16 by truncation, which moves some activations
    to a neighbouring e4m3 value in GEMM2: hence 3e-2."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", W8A8, str(pps), act], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    to_ref, to_exact, ref_to_exact = map(float, [ln for ln in res.stdout.splitlines()
                                                 if ln.startswith("RESULT")][-1].split()[1:])
    assert to_ref < 3e-2 and ref_to_exact > 2e-2 and abs(to_exact - ref_to_exact) < 1e-2
