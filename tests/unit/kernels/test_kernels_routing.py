"""Routing against straightforward numpy transliterations (softmax top-k; DeepSeek-V3 Gate)."""

import numpy as np
import pytest
import torch

from moe_kernels.routing import grouped_topk, softmax_topk


def _np_softmax_topk(logits, k, renorm):
    out_w, out_i = [], []
    for row in logits.astype(np.float64):
        p = np.exp(row - row.max())
        p /= p.sum()
        idx = sorted(range(len(p)), key=lambda j: -p[j])[:k]
        w = p[idx]
        if renorm:
            w = w / w.sum()
        out_w.append(w)
        out_i.append(idx)
    return np.array(out_w), np.array(out_i)


def _np_deepseek_gate(logits, bias, k, n_group, topk_group, rsf, renorm=True):
    """deepseek-ai/DeepSeek-V3 inference/model.py::Gate.forward, one token at a time."""
    out_w, out_i = [], []
    e = logits.shape[1]
    for row in logits.astype(np.float64):
        scores = 1.0 / (1.0 + np.exp(-row))
        s = scores + (bias if bias is not None else 0.0)
        groups = s.reshape(n_group, e // n_group)
        if bias is None:
            gscore = groups.max(axis=1)
        else:
            gscore = np.array([sum(sorted(g)[-2:]) for g in groups])
        keep = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
        masked = np.full(e, -np.inf)
        for g in keep:
            sl = slice(g * (e // n_group), (g + 1) * (e // n_group))
            masked[sl] = s[sl]
        idx = sorted(range(e), key=lambda j: -masked[j])[:k]
        w = scores[idx]
        if renorm:
            w = w / w.sum()
        out_w.append(w * rsf)
        out_i.append(idx)
    return np.array(out_w), np.array(out_i)


def _same_sets(ids_a, ids_b):
    return all(set(a) == set(b) for a, b in zip(ids_a.tolist(), ids_b.tolist()))


@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk(renorm):
    torch.manual_seed(0)
    logits = torch.randn(33, 64) * 3
    w, ids = softmax_topk(logits, 6, renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (33, 6)
    rw, ri = _np_softmax_topk(logits.numpy(), 6, renorm)
    assert np.array_equal(ids.numpy(), ri)
    np.testing.assert_allclose(w.numpy(), rw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("renorm", [True, False])
def test_grouped_topk_deepseek_v3(with_bias, renorm):
    torch.manual_seed(1)
    t, e = 40, 256
    logits = torch.randn(t, e) * 2
    bias = torch.randn(e) * 0.5 if with_bias else None
    w, ids = grouped_topk(logits, bias, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                          renormalize=renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (t, 8)
    rw, ri = _np_deepseek_gate(logits.numpy(), None if bias is None else bias.numpy().astype(np.float64),
                               8, 8, 4, 2.5, renorm)
    assert _same_sets(ids.numpy(), ri)
    # compare weights per expert id (slot order may differ on exact score ties)
    for row in range(t):
        got = dict(zip(ids[row].tolist(), w[row].tolist()))
        want = dict(zip(ri[row].tolist(), rw[row].tolist()))
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5)


def test_grouped_topk_bias_only_for_selection():
    """A large bias on one expert makes it chosen, but its weight is its unbiased sigmoid score."""
    logits = torch.zeros(1, 16)
    logits[0, 3] = -4.0
    bias = torch.zeros(16)
    bias[3] = 10.0
    w, ids = grouped_topk(logits, bias, top_k=2, n_group=4, topk_group=2, routed_scaling_factor=1.0,
                          renormalize=False)
    assert 3 in ids[0].tolist()
    slot = ids[0].tolist().index(3)
    assert w[0, slot].item() == pytest.approx(torch.sigmoid(torch.tensor(-4.0)).item())


def test_grouped_topk_picks_only_from_kept_groups():
    torch.manual_seed(2)
    logits = torch.randn(64, 32)
    _, ids = grouped_topk(logits, torch.zeros(32), top_k=4, n_group=4, topk_group=1, routed_scaling_factor=1.0)
    groups = (ids // 8).numpy()
    assert (groups == groups[:, :1]).all()
