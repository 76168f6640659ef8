"""The paged prefill/extend kernels (moe_kernels.attention_prefill) and the FP8 KV cache against the torch
reference on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported,
hence a subprocess). Tiny shapes: a right-padded batch whose rows start at different cached prefixes
(0 = plain prefill, a mid-block start = prefix hit / chunked prefill), shuffled block tables, padded
positions past kv_len, GQA with sinks and a sliding window, MLA with head blocks; an fp8 cache read by
the decode and prefill kernels against the reference on the same fp8 cache (and the error vs bf16)."""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import torch
from moe_kernels import paged_attention as pa
from moe_kernels.attention_prefill import prefill_gqa, prefill_mla
g = torch.Generator().manual_seed(0)
bs = 4
starts = torch.tensor([0, 3, 8, 13])   # cached prefix per row
chunk = torch.tensor([9, 5, 1, 7])    # this call's tokens per row (right-padded to S)
B, S = len(starts), int(chunk.max())
kv_len = int((starts + chunk).max())
nb = -(-(kv_len + S) // bs)
NB = B * nb + 3
bt = torch.stack([torch.randperm(NB, generator=g)[:nb] for _ in range(B)])
pos = starts[:, None] + torch.arange(S)[None, :]   # padded rows continue past their chunk
def rel(a, b, rows=None):
    a, b = a.float(), b.float()
    if rows is not None:  # the real (unpadded) tokens only
        a, b = a[rows], b[rows]
    return float((a - b).abs().max() / b.abs().max())
real = torch.arange(S)[None, :] < chunk[:, None]
out = []
# GQA: 6 q heads over 2 kv heads (G = 3), head dim 24 (padded to 32)
H, kvh, d = 6, 2, 24
k = torch.randn(NB, bs, kvh, d, generator=g)
v = torch.randn(NB, bs, kvh, d, generator=g)
q = torch.randn(B, S, H, d, generator=g)
sinks = torch.randn(H, generator=g)
for sk, win in ((None, None), (sinks, None), (sinks, 5), (None, 3)):
    ref = pa.paged_attention_gqa_ref(q, k, v, bt, pos, kv_len, d ** -0.5, sk, win)
    for cfg in ((4, 4, 16, 4, 1), (8, 2, 16, 4, 1)):
        got = prefill_gqa(q, k, v, bt, pos, kv_len, d ** -0.5, sk, win, config=cfg)
        out.append((f"gqa_sink={sk is not None}_win={win}_cfg={cfg[0]}x{cfg[1]}", rel(got, ref, real)))
        assert torch.isfinite(got).all(), "padded rows must be finite"
# MLA: 20 heads (two head blocks of 16), latent 32, rope 8
H, C, R = 20, 32, 8
ckv = torch.randn(NB, bs, C, generator=g)
kr = torch.randn(NB, bs, R, generator=g)
qa = torch.randn(B, S, H, C, generator=g) / C ** 0.5
qr = torch.randn(B, S, H, R, generator=g)
ref = pa.paged_attention_mla_ref(qa, qr, ckv, kr, bt, pos, kv_len, 0.3)
for cfg in ((1, 16, 16, 4, 1), (2, 8, 16, 4, 1)):
    out.append((f"mla_cfg={cfg[0]}x{cfg[1]}", rel(prefill_mla(qa, qr, ckv, kr, bt, pos, kv_len, 0.3, config=cfg), ref, real)))
# MLA non-absorbed: decompress through W_uk / W_uv, 3 heads, nope 16, v 16 -> the absorbed reference then W_uv
from moe_kernels.attention_prefill import prefill_mla_mha
Hm = 3
w_uk = torch.randn(Hm, 16, C, generator=g) / C ** 0.5
w_uv = torch.randn(Hm, 16, C, generator=g) / C ** 0.5
qn = torch.randn(B, S, Hm, 16, generator=g)
qrm = torch.randn(B, S, Hm, R, generator=g)
ref_lat = pa.paged_attention_mla_ref(torch.einsum("bshd,hdc->bshc", qn, w_uk), qrm, ckv, kr, bt, pos, kv_len, 0.3)
ref = torch.einsum("bshc,hvc->bshv", ref_lat, w_uv)
out.append(("mla_mha", rel(prefill_mla_mha(qn, qrm, ckv, kr, w_uk, w_uv, bt, pos, kv_len, 0.3, config=(16, 16, 4, 1)), ref, real)))
# FP8 caches (scale 0.5: values / 0.5 stored): kernels vs the reference on the same fp8 cache, and vs fp32
ks, vs = 0.5, 0.25
k8, v8 = pa.quantize_fp8(k[..., :2, :16], ks), pa.quantize_fp8(v[..., :2, :16], vs)
kf, vf = k[..., :2, :16].contiguous(), v[..., :2, :16].contiguous()
q8 = q[..., :16].contiguous()
ref8 = pa.paged_attention_gqa_ref(q8, k8, v8, bt, pos, kv_len, 0.25, sinks, None, ks, vs)
ref32 = pa.paged_attention_gqa_ref(q8, kf, vf, bt, pos, kv_len, 0.25, sinks)
out.append(("fp8_gqa_prefill", rel(prefill_gqa(q8, k8, v8, bt, pos, kv_len, 0.25, sinks, None, ks, vs,
                                               config=(4, 4, 16, 4, 1)), ref8, real)))
out.append(("fp8_gqa_prefill_vs_fp32", rel(ref8, ref32, real)))
lens = starts + chunk
dec8 = pa.paged_attention_gqa_ref(q8[:, :1], k8, v8, bt, (lens - 1)[:, None], int(lens.max()), 0.25, sinks, None, ks, vs)[:, 0]
for sp in (1, 3):
    out.append((f"fp8_gqa_decode_splits={sp}", rel(pa.paged_decode_gqa(q8[:, 0], k8, v8, bt, lens, 0.25, sinks, None, sp,
                                                                         k_scale=ks, v_scale=vs), dec8)))
c8, r8 = pa.quantize_fp8(ckv, ks), pa.quantize_fp8(kr, ks)
m8 = pa.paged_attention_mla_ref(qa[:, :1], qr[:, :1], c8, r8, bt, (lens - 1)[:, None], int(lens.max()), 0.3, ks)[:, 0]
for sp in (1, 3):
    out.append((f"fp8_mla_decode_splits={sp}", rel(pa.paged_decode_mla(qa[:, 0].contiguous(), qr[:, 0].contiguous(), c8, r8,
                                                                         bt, lens, 0.3, sp, kv_scale=ks), m8)))
mp8 = pa.paged_attention_mla_ref(qa, qr, c8, r8, bt, pos, kv_len, 0.3, ks)
out.append(("fp8_mla_prefill", rel(prefill_mla(qa, qr, c8, r8, bt, pos, kv_len, 0.3, ks, config=(1, 16, 16, 4, 1)), mp8, real)))
for name, e in out:
    print("RESULT", name, e)
"""


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return {ln.split()[1]: float(ln.split()[2]) for ln in res.stdout.splitlines() if ln.startswith("RESULT")}


def test_prefill_kernels_match_reference_in_interpreter(results):
    names = [n for n in results if not n.startswith("fp8")]
    assert len(names) == 11, names
    for n in names:
        assert results[n] < 1e-4, (n, results[n])  # fp32: fp32 dots


def test_fp8_cache_kernels_match_the_fp8_reference(results):
    names = [n for n in results if n.startswith("fp8") and not n.endswith("vs_fp32")]
    assert len(names) == 6, names
    for n in names:
        assert results[n] < 2e-3, (n, results[n])  # the same dequantized values; fp16 dots (q, p rounded to fp16)


def test_fp8_cache_error_vs_full_precision_is_small_but_real(results):
    e = results["fp8_gqa_prefill_vs_fp32"]
    assert 1e-4 < e < 0.08, e  # e4m3 keeps 3 mantissa bits: a few percent, never zero


def test_write_kv_quantizes_and_saturates():
    from moe_kernels import paged_attention as pa

    cache = torch.zeros(2, 4, 3, dtype=pa.FP8)
    vals = torch.tensor([[[1.0, -2.0, 1000.0], [0.3, 0.0, -1e6]]])
    pa.write_kv(cache, torch.tensor([[1, 6]]), vals, scale=2.0)
    flat = cache.view(-1, 3).float()
    assert flat[1].tolist() == [0.5, -1.0, 448.0]  # 1000 / 2 saturates at e4m3's 448, not NaN
    assert flat[6, 2].item() == -448.0 and abs(flat[6, 0].item() - 0.15) < 0.01
    assert flat[0].abs().sum() == 0
    with pytest.raises(ValueError, match="fp8 cache only"):
        pa.write_kv(torch.zeros(2, 4, 3), torch.tensor([[1]]), vals[:, :1], scale=2.0)


def test_mla_form_is_chosen_by_flops():
    from moe_kernels.attention_prefill import mla_mha_flops_cheaper

    # DeepSeek-V3: absorbed per key S*h*2*1088, non-absorbed S*h*2*320 + h*2*512*256: crossover at ~171 tokens
    assert not mla_mha_flops_cheaper(170, 128, 512, 128, 64, 128)
    assert mla_mha_flops_cheaper(171, 128, 512, 128, 64, 128)
    assert mla_mha_flops_cheaper(8192, 16, 512, 128, 64, 128)


def test_mla_prefill_form_needs_a_big_enough_call():
    from moe_kernels.attention_prefill import mla_prefill_form

    dims = (512, 128, 64, 128)
    assert mla_prefill_form(1, 1024, 1024, 16, *dims) == "absorbed"  # 37 GFLOP: the decompression's fixed cost loses
    assert mla_prefill_form(8, 1024, 1024, 16, *dims) == "mha"
    assert mla_prefill_form(1, 2048, 8192, 16, *dims) == "mha"
    assert mla_prefill_form(64, 100, 8192, 128, *dims) == "absorbed"  # short chunks over a long prefix


def test_mla_heads_on_cpu_is_the_absorbed_reference():
    from moe_kernels import paged_attention as pa

    g = torch.Generator().manual_seed(3)
    ckv, kr = torch.randn(6, 4, 16, generator=g), torch.randn(6, 4, 8, generator=g)
    w_uk, w_uv = torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 16, generator=g)
    qn, qr = torch.randn(1, 5, 2, 8, generator=g), torch.randn(1, 5, 2, 8, generator=g)
    bt, pos = torch.tensor([[4, 0, 2]]), torch.arange(3, 8)[None]
    got = pa.paged_attention_mla_heads(qn, qr, ckv, kr, w_uk, w_uv, bt, pos, 8, 0.2)
    lat = pa.paged_attention_mla_ref(torch.einsum("bshd,hdc->bshc", qn, w_uk), qr, ckv, kr, bt, pos, 8, 0.2)
    torch.testing.assert_close(got, torch.einsum("bshc,hvc->bshv", lat, w_uv))


def test_prefill_rejects_bad_shapes():
    from moe_kernels.attention_prefill import prefill_gqa

    q = torch.zeros(2, 3, 4, 16)
    k = torch.zeros(5, 4, 2, 16)
    bt = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="positions"):
        prefill_gqa(q, k, k, bt, torch.zeros(2, 4, dtype=torch.long), 3, 1.0)
    with pytest.raises(ValueError, match="exceeds the block tables"):
        prefill_gqa(q, k, k, bt, torch.zeros(2, 3, dtype=torch.long), 9, 1.0)
    with pytest.raises(ValueError, match="heads must divide"):
        prefill_gqa(torch.zeros(2, 3, 3, 16), k, k, bt, torch.zeros(2, 3, dtype=torch.long), 3, 1.0)
