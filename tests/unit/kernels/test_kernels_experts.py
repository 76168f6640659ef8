"""Torch reference experts against a per-token loop, container round trips, deferred == direct."""

import pytest
import torch

from moe_kernels import formats as F
from moe_core.formats import EXPERT_FORMATS as FORMATS
from moe_kernels.experts import ExpertWeights
from moe_kernels.finalize import DeferredMoEOutput
from moe_kernels.reference import TorchExperts
from moe_kernels.routing import softmax_topk

E, H, I = 6, 64, 32


def _weights(fmt, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    return ExpertWeights.from_dense(w13, w2, fmt)


def _inputs(t=7, k=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    w, ids = softmax_topk(torch.randn(t, E, generator=g), k, renormalize=True)
    shared = torch.randn(t, H, generator=g).to(torch.bfloat16)
    return x, w, ids, shared


def _per_token_loop(weights, x, w, ids, shared=None, routed_scale=1.0):
    """float64 oracle: for each token and slot run the expert MLP on the dequantized weights."""
    w13, w2 = (t.double() for t in weights.dequantize())
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            h = w13[e] @ x[t].double()
            a = torch.nn.functional.silu(h[:I]) * h[I:]
            out[t] += routed_scale * float(w[t, j]) * (w2[e] @ a)
    if shared is not None:
        out += shared.double()
    return out


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_matches_per_token_loop(fmt):
    weights = _weights(fmt)
    x, w, ids, shared = _inputs()
    out = TorchExperts(weights).forward(x, w, ids, shared_output=shared, routed_scale=2.5)
    assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], H)
    assert _rel(out, _per_token_loop(weights, x, w, ids, shared, 2.5)) < 1e-2


@pytest.mark.parametrize("fmt", FORMATS)
def test_deferred_equals_direct(fmt):
    weights = _weights(fmt)
    x, w, ids, shared = _inputs(t=9, k=3)
    ex = TorchExperts(weights)
    direct = ex.forward(x, w, ids, shared_output=shared, routed_scale=1.5)
    d = ex.forward(x, w, ids, routed_scale=1.5, defer_finalize=True)
    assert isinstance(d, DeferredMoEOutput)
    assert d.gemm2_out.dtype == torch.bfloat16 and d.expanded_idx_to_permuted_idx.dtype == torch.int32
    assert d.expanded_idx_to_permuted_idx.shape == (9 * 3,)
    assert torch.equal(d.finalize(shared), direct)


def test_ids_outside_the_rank_are_skipped():
    weights = _weights("bf16")
    x, w, ids, _ = _inputs()
    ids = ids.clone()
    ids[0, 1] = -1
    ids[2, 0] = E + 3
    d = TorchExperts(weights).forward(x, w, ids, defer_finalize=True)
    perm = d.expanded_idx_to_permuted_idx.view(ids.shape)
    assert perm[0, 1] == -1 and perm[2, 0] == -1
    assert _rel(d.finalize(), _per_token_loop(weights, x, w, ids)) < 1e-2


def test_bf16_topk_weights_accepted():
    weights = _weights("nvfp4")
    x, w, ids, _ = _inputs()
    a = TorchExperts(weights).forward(x, w.to(torch.bfloat16), ids)
    assert _rel(a, _per_token_loop(weights, x, w.to(torch.bfloat16).float(), ids)) < 1e-2


def test_from_quantized_matches_from_dense():
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, H, I, generator=g)
    for fmt in FORMATS:
        dense = ExpertWeights.from_dense(w13, w2, fmt)
        if fmt == "bf16":
            kw = dict(w13_weight=dense.w13, w2_weight=dense.w2)
        elif fmt == "fp8":
            kw = dict(w13_weight=dense.w13.weight, w13_weight_scale_inv=dense.w13.scale_inv,
                      w2_weight=dense.w2.weight, w2_weight_scale_inv=dense.w2.scale_inv)
        elif fmt == "nvfp4":
            kw = dict(w13_weight=dense.w13.packed, w13_weight_scale=dense.w13.block_scale,
                      w13_weight_scale_2=dense.w13.global_scale, w2_weight=dense.w2.packed,
                      w2_weight_scale=dense.w2.block_scale, w2_weight_scale_2=dense.w2.global_scale,
                      w13_input_scale=torch.tensor(0.5))
        else:  # gpt-oss style blocks [E, N, K/32, 16]
            kw = dict(w13_weight=dense.w13.packed.view(E, 2 * I, H // 32, 16), w13_weight_scale=dense.w13.scale,
                      w2_weight=dense.w2.packed, w2_weight_scale=dense.w2.scale)
        q = ExpertWeights.from_quantized(fmt, **kw)
        for a, b in zip(q.dequantize(), dense.dequantize()):
            assert torch.equal(a, b)
        if fmt == "nvfp4":
            assert "w13_input_scale" in q.extras


def test_nvfp4_separate_gate_up_global_scales():
    dense = _weights("nvfp4")
    gs = torch.stack([dense.w13.global_scale, dense.w13.global_scale * 2], dim=1)  # [E, 2]
    q = ExpertWeights.from_quantized("nvfp4", w13_weight=dense.w13.packed, w13_weight_scale=dense.w13.block_scale,
                                     w13_weight_scale_2=gs, w2_weight=dense.w2.packed,
                                     w2_weight_scale=dense.w2.block_scale, w2_weight_scale_2=dense.w2.global_scale)
    a, _ = q.dequantize()
    b, _ = dense.dequantize()
    assert torch.equal(a[:, :I], b[:, :I])
    assert torch.equal(a[:, I:].float(), b[:, I:].float() * 2)
    w13_e, _ = q.dequantize_expert(2)
    assert torch.equal(w13_e, a[2])


def test_shape_validation():
    with pytest.raises(ValueError):
        ExpertWeights("bf16", torch.zeros(2, 8, 4, dtype=torch.bfloat16), torch.zeros(2, 4, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        ExpertWeights.from_dense(torch.zeros(2, 8, 32), torch.zeros(2, 32, 4), "int4")


def test_nbytes_per_expert():
    w = _weights("nvfp4")
    assert w.nbytes_per_expert() == 3 * H * I // 2 + 3 * H * I // 16  # packed e2m1 + e4m3 per 16
