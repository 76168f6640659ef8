"""The split-KV paged decode kernels (moe_kernels.attention_decode) against the torch reference on the
CPU through Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported, hence a
subprocess): tiny shapes, ragged lengths, shuffled (non-contiguous) block tables, 1 and several
context slices, MLA at 2 head blocks, GQA with sinks and a sliding window. Plus the split policy."""

import os
import subprocess
import sys

import pytest

from moe_kernels.attention_decode import num_splits

SCRIPT = r"""
import torch
from moe_kernels.paged_attention import (paged_attention_gqa_ref, paged_attention_mla_ref, paged_decode_gqa,
                                         paged_decode_mla)
from moe_kernels.attention_decode import decode_mla
g = torch.Generator().manual_seed(0)
bs = 4
lens = torch.tensor([1, 4, 5, 23, 40])
B, nb = len(lens), 10
NB = B * nb + 3
def tables():
    return torch.stack([torch.randperm(NB, generator=g)[:nb] for _ in range(B)])
errs = []
def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())
# MLA: 20 heads -> two head blocks of 16 (the second padded), latent 32, rope 8
H, C, R = 20, 32, 8
ckv = torch.randn(NB, bs, C, generator=g)
kr = torch.randn(NB, bs, R, generator=g)
qa = torch.randn(B, H, C, generator=g) / C ** 0.5
qr = torch.randn(B, H, R, generator=g)
bt = tables()
ref = paged_attention_mla_ref(qa[:, None], qr[:, None], ckv, kr, bt, (lens - 1)[:, None], int(lens.max()), 0.3)[:, 0]
for sp in (1, 3, 16):
    errs.append(("mla", sp, rel(decode_mla(qa, qr, ckv, kr, bt, lens, 0.3, sp, (16, 16, 4, 1)), ref)))
errs.append(("mla-default", 0, rel(paged_decode_mla(qa, qr, ckv, kr, bt, lens, 0.3), ref)))
# GQA: 6 q heads over 2 kv heads (G=3 padded to 16), head dim 24 (padded to 32)
H, kvh, d = 6, 2, 24
k = torch.randn(NB, bs, kvh, d, generator=g)
v = torch.randn(NB, bs, kvh, d, generator=g)
q = torch.randn(B, H, d, generator=g)
sinks = torch.randn(H, generator=g)
bt = tables()
for sk, win in ((None, None), (sinks, None), (sinks, 7), (None, 12)):
    ref = paged_attention_gqa_ref(q[:, None], k, v, bt, (lens - 1)[:, None], int(lens.max()), d ** -0.5, sk, win)[:, 0]
    for sp in (1, 2, 5):
        errs.append((f"gqa sink={sk is not None} win={win}", sp, rel(paged_decode_gqa(q, k, v, bt, lens, d ** -0.5, sk, win, sp), ref)))
for e in errs:
    print("RESULT", e[0].replace(" ", "_"), e[1], e[2])
"""


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return [ln.split()[1:] for ln in res.stdout.splitlines() if ln.startswith("RESULT")]


def test_decode_kernels_match_reference_in_interpreter(results):
    assert len(results) == 16
    for name, splits, err in results:
        assert float(err) < 1e-4, (name, splits, err)  # fp32 caches: fp32 dots (bf16 is tested in tests/gpu)


def test_num_splits_fills_the_gpu_and_keeps_slices_long():
    assert num_splits(1, 32768, 8, 132, 64) == 33  # 8 programs per slice -> ~2 waves of 132 SMs
    assert num_splits(64, 8192, 8, 132, 64) == 1  # 512 programs already
    assert num_splits(1, 100, 2, 132, 32) == 2  # 4 tiles, at least 2 per slice
    assert num_splits(1, 10**6, 1, 132, 16) == 64  # capped
    with pytest.raises(ValueError, match="batch=0"):
        num_splits(0, 10, 1, 132, 16)


def test_mla_config_keeps_shared_memory_bytes_for_fp32_caches():
    """A 4-byte cache gets half the tokens per tile of the bf16 default: the same shared-memory bytes
    (64 heads x 64 tokens of an fp32 cache needed 304 KiB of the H200's 227 KiB: OutOfResources)."""
    from moe_kernels.attention_decode import mla_config

    for heads in (128, 64, 16, 4):
        bh2, bn2, *_ = mla_config(heads, 2)
        bh4, bn4, *_ = mla_config(heads, 4)
        assert bh2 == bh4 and bn4 * 4 == bn2 * 2
    assert mla_config(128)[:2] == (64, 64) and mla_config(16)[:2] == (16, 128)
