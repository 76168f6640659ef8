"""Finalize reference: -1 skip, shared add, routed_scale in fp32, bf16 or fp32 weights, padded H."""

import pytest
import torch

from moe_kernels.finalize import DeferredMoEOutput, finalize_reference, moe_finalize_fuse_shared


def _case(t=5, k=4, h=48, p=32, seed=0, wdtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    gemm2_out = torch.randn(p, h, generator=g).to(torch.bfloat16)
    gemm2_out[p - 1] = float("nan")  # a padding row nobody points at
    weights = torch.rand(t, k, generator=g).to(wdtype)
    perm = torch.randperm(p - 1, generator=g)[: t * k].to(torch.int32)
    perm[1] = -1
    perm[t * k - 1] = -1
    shared = torch.randn(t, h, generator=g).to(torch.bfloat16)
    return gemm2_out, weights, perm, shared


def _loop(gemm2_out, weights, perm, shared, rs):
    t, k = weights.shape
    out = torch.zeros(t, gemm2_out.shape[1] if shared is None else shared.shape[1], dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            p = int(perm[i * k + j])
            if p >= 0:
                out[i] += float(weights[i, j]) * rs * gemm2_out[p, : out.shape[1]].double()
        if shared is not None:
            out[i] += shared[i].double()
    return out


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_shared", [True, False])
@pytest.mark.parametrize("rs", [None, 2.5])
def test_finalize_reference(wdtype, with_shared, rs):
    g2, w, perm, shared = _case(wdtype=wdtype)
    shared = shared if with_shared else None
    out = finalize_reference(g2, w, perm, shared, rs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    want = _loop(g2, w, perm, shared, 1.0 if rs is None else rs)
    # one bf16 rounding of an fp32 sum
    assert torch.allclose(out.double(), want, rtol=2 ** -8, atol=1e-6)


def test_cpu_dispatch_is_reference_and_deferred_finalize():
    g2, w, perm, shared = _case()
    a = moe_finalize_fuse_shared(g2, w, perm, shared, 1.5)
    assert torch.equal(a, finalize_reference(g2, w, perm, shared, 1.5))
    assert torch.equal(DeferredMoEOutput(g2, w, perm, 1.5).finalize(shared), a)


def test_padded_hidden_is_trimmed_to_shared_width():
    g2, w, perm, shared = _case(h=48)
    out = finalize_reference(g2, w, perm, shared[:, :40].contiguous())
    assert out.shape == (5, 40)


def test_dtype_contract_is_enforced():
    g2, w, perm, shared = _case()
    with pytest.raises(TypeError):
        finalize_reference(g2.float(), w, perm)
    with pytest.raises(TypeError):
        finalize_reference(g2, w.half(), perm)
    with pytest.raises(TypeError):
        finalize_reference(g2, w, perm.long())
