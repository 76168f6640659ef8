"""Triton MoE kernels against the torch reference on a CUDA GPU (run on the H200 machine).

Fresh random inputs per case; outputs are poisoned (the caching allocator hands back memory we
filled with NaN) so an unwritten element shows up as NaN instead of a stale or zero value.
"""

from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from moe_core.formats import EXPERT_FORMATS as FORMATS  # noqa: E402
from moe_kernels.experts import ExpertWeights  # noqa: E402
from moe_kernels.finalize import finalize_reference, moe_finalize_fuse_shared  # noqa: E402
from moe_kernels.reference import TorchExperts  # noqa: E402
from moe_kernels.routing import softmax_topk  # noqa: E402
from moe_kernels.selftest import selftest  # noqa: E402
from moe_kernels.triton_align import align_by_expert  # noqa: E402
from alignment_checks import check_mixed as _check_mixed  # noqa: E402
from alignment_checks import check_split as _check_split  # noqa: E402
from alignment_checks import check_pair_order as _check_pair_order  # noqa: E402
from moe_kernels.triton_config import (FragConfig, GemmConfig, MoEConfig, PrefillConfig, W8A8Config,  # noqa: E402
                                       default_config)
from moe_kernels.triton_moe import TritonExperts  # noqa: E402

DEV = "cuda"


def _poison_allocator(nbytes=1 << 30):
    """Fill free cached blocks with NaN so torch.empty in the kernels returns NaN-filled memory."""
    buf = torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device=DEV)
    del buf


def _graph_replay(fn):
    """fn captured in a CUDA graph and replayed once: the output tensor of the replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


def _rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite output (unwritten or overflow)"
    return float((a - b).norm() / b.norm())


def _problem(fmt, e, h, i, t, k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, device=DEV, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, device=DEV, generator=g) / i ** 0.5
    weights = ExpertWeights.from_dense(w13, w2, fmt)
    x = torch.randn(t, h, device=DEV, generator=g).to(torch.bfloat16)
    w, ids = softmax_topk(torch.randn(t, e, device=DEV, generator=g), k, renormalize=True)
    shared = torch.randn(t, h, device=DEV, generator=g).to(torch.bfloat16)
    return weights, x, w, ids, shared


SHAPES = [  # E, H, I, T, K: covers the one-row (FP4 decode) and BLOCK_M 16 / 32 / 64 / 128 configs
    (8, 256, 128, 1, 2),
    (64, 512, 256, 5, 8),
    (8, 256, 128, 13, 2),
    (16, 512, 256, 100, 4),
    (32, 1024, 512, 300, 8),
    (16, 512, 384, 700, 4),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}H{}I{}T{}K{}".format(*s))
def test_triton_experts_match_reference(fmt, shape):
    e, h, i, t, k = shape
    weights, x, w, ids, shared = _problem(fmt, e, h, i, t, k, seed=hash((fmt, shape)) % 10000)
    ref = TorchExperts(weights).forward(x, w, ids, shared_output=shared, routed_scale=2.5)
    ex = TritonExperts(weights)
    _poison_allocator()
    out = ex.forward(x, w, ids, shared_output=shared, routed_scale=2.5)
    assert _rel(out, ref) < 1e-2
    _poison_allocator()
    d = ex.forward(x, w, ids, routed_scale=2.5, defer_finalize=True)
    used = d.expanded_idx_to_permuted_idx.long()
    assert torch.isfinite(d.gemm2_out[used[used >= 0]].float()).all()
    assert torch.equal(d.finalize(shared), out)


def test_triton_experts_skip_other_ranks_and_bf16_weights():
    weights, x, w, ids, shared = _problem("nvfp4", 16, 512, 256, 50, 4, seed=7)
    ids = ids.clone()
    ids[::3, 1] = -1
    ids[::5, 2] = 99
    ref = TorchExperts(weights).forward(x, w.bfloat16(), ids, shared_output=shared)
    out = TritonExperts(weights).forward(x, w.bfloat16(), ids, shared_output=shared)
    assert _rel(out, ref) < 1e-2


def test_mixed_align_puts_big_experts_in_16_row_blocks():
    from moe_kernels.triton_align import align_mixed
    for t, k, e in [(256, 8, 256), (40, 4, 16), (1, 8, 256), (3000, 8, 64)]:
        ids = torch.randint(0, e, (t, k), device=DEV, dtype=torch.int32)
        ids[0, -1] = -1
        _check_mixed(align_mixed(ids, e), ids, e)


def test_align_is_a_padded_permutation():
    for t, k, e, bm in [(1, 8, 256, 16), (37, 4, 16, 32), (4096, 8, 256, 64)]:
        ids = torch.randint(0, e, (t, k), device=DEV, dtype=torch.int32)
        al = align_by_expert(ids, e, bm)
        perm = al.perm.long()
        n = t * k
        assert (perm >= 0).all() and perm.unique().numel() == n
        assert torch.equal(al.sorted_ids[perm], torch.arange(n, device=DEV, dtype=torch.int32))
        _check_pair_order(al.perm, ids, e)
        assert torch.equal(align_by_expert(ids, e, bm).perm, al.perm), "deterministic"
        counts = torch.bincount(ids.flatten().long(), minlength=e)
        assert int(al.num_post_pad) == int(((counts + bm - 1) // bm * bm).sum())
        blocks = perm // bm
        assert torch.equal(al.expert_ids[blocks].long(), ids.flatten().long())
        assert int(al.num_post_pad) <= al.p_max


def test_forward_is_cuda_graph_capturable():
    weights, x, w, ids, shared = _problem("mxfp4", 16, 512, 256, 8, 4, seed=3)
    ex = TritonExperts(weights)
    eager = ex.forward(x, w, ids, shared_output=shared)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ex.forward(x, w, ids, shared_output=shared)  # warm-up / compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    out = _graph_replay(lambda: ex.forward(x, w, ids, shared_output=shared))
    assert torch.equal(out, eager)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,h", [(1, 8, 7168), (33, 4, 1000), (1024, 8, 2048)])
def test_finalize_kernel_matches_reference(wdtype, t, k, h):
    p = t * k + 64
    gemm2_out = torch.randn(p, h + 8, device=DEV).to(torch.bfloat16)
    perm = torch.randperm(p, device=DEV)[: t * k].to(torch.int32)
    perm[torch.rand(t * k, device=DEV) < 0.1] = -1
    weights = torch.rand(t, k, device=DEV).to(wdtype)
    shared = torch.randn(t, h, device=DEV).to(torch.bfloat16)
    for sh, rs in [(shared, 2.5), (None, None)]:
        ref = finalize_reference(gemm2_out, weights, perm, sh, rs)
        _poison_allocator()
        out = moe_finalize_fuse_shared(gemm2_out, weights, perm, sh, rs)
        assert out.shape == ref.shape and torch.isfinite(out.float()).all()
        # same fp32 sum in the same order; FMA contraction may move the last fp32 bit
        assert torch.allclose(out.float(), ref.float(), rtol=2 ** -7, atol=1e-5)
        assert (out != ref).float().mean() < 0.01


@pytest.mark.parametrize("fmt", FORMATS)
def test_selftest_triton_passes(fmt):
    res = selftest("triton", fmt, DEV)
    assert res.ok, res.message


# ------------------------------------------------------------------ FP4 fragment-order kernel
FRAG_CONFIGS = [  # nt, rt, wn, wk, pipe: one row tile / two per warp, K split over warps, pipeline depth
    (1, 1, 2, 2, 4), (1, 2, 2, 1, 3), (2, 1, 4, 1, 4), (2, 2, 1, 2, 2), (1, 1, 1, 4, 1), (1, 2, 1, 8, 4), (1, 4, 1, 2, 3), (1, 4, 2, 1, 4),
    (2, 4, 1, 1, 3), (2, 4, 2, 1, 4),
]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("cfg", FRAG_CONFIGS, ids=lambda c: "nt{}rt{}wn{}wk{}p{}".format(*c))
@pytest.mark.parametrize("t,k", [(1, 8), (7, 4), (40, 8)])
def test_fragment_kernel_matches_reference(fmt, cfg, t, k):
    nt, rt, wn, wk, pipe = cfg
    e, h, i = 16, 1024, 512
    weights, x, w, ids, shared = _problem(fmt, e, h, i, t, k, seed=hash((fmt, cfg, t)) % 10000)
    ref = TorchExperts(weights).forward(x, w, ids, shared_output=shared, routed_scale=1.5)
    ex = TritonExperts(weights, MoEConfig(8 * nt, FragConfig(nt, rt, wn, wk, pipe), FragConfig(nt, rt, wn, wk, pipe)),
                       frag=True)
    _poison_allocator()
    out = ex.forward(x, w, ids, shared_output=shared, routed_scale=1.5)
    assert _rel(out, ref) < 1e-2
    d = ex.forward(x, w, ids, routed_scale=1.5, defer_finalize=True)
    assert torch.equal(d.finalize(shared), out)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fragment_kernel_one_token_without_alignment_skips_other_ranks(fmt):
    # one token runs pairwise (no alignment launches); pairs of other ranks' experts must add nothing,
    # and their GEMM2 rows are written (zeros): the poisoned allocator would turn a skipped row into NaN
    weights, x, w, ids, shared = _problem(fmt, 16, 1024, 512, 1, 8, seed=21)
    ids = ids.clone()
    ids[0, 1] = -1
    ids[0, 4] = 99
    ref = TorchExperts(weights).forward(x, w, ids, shared_output=shared)
    ex = TritonExperts(weights, frag=True)
    _poison_allocator()
    out = ex.forward(x, w, ids, shared_output=shared)
    assert _rel(out, ref) < 1e-2
    again = _graph_replay(lambda: ex.forward(x, w, ids, shared_output=shared))
    assert torch.equal(again, out)
    # programmatic dependent launch changes when kernels start, never what they compute
    no_pdl = replace(default_config(fmt, 8, 16, True), pdl=False)
    assert torch.equal(TritonExperts(weights, no_pdl, frag=True).forward(x, w, ids, shared_output=shared), out)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_one_token_fused_finalize_is_the_finalize_kernel(fmt, wdtype):
    # one token: the down GEMM finalizes itself (last program of each column block); bit-equal to the
    # separate finalize launch, with and without the shared expert, other ranks' pairs included, over
    # repeated forwards and graph replays (the arrival counters must reset themselves every time)
    weights, x, w, ids, shared = _problem(fmt, 16, 1024, 512, 1, 8, seed=41)
    ids = ids.clone()
    ids[0, 2] = -1
    w = w.to(wdtype)
    ex = TritonExperts(weights, frag=True)
    unfused = TritonExperts(weights, replace(default_config(fmt, 8, 16, True), fuse_finalize=False), frag=True)
    for sh, rs in ((shared, 1.5), (None, 1.0)):
        _poison_allocator()
        want = unfused.forward(x, w, ids, shared_output=sh, routed_scale=rs)
        assert torch.isfinite(want.float()).all()
        for _ in range(50):
            assert torch.equal(ex.forward(x, w, ids, shared_output=sh, routed_scale=rs), want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ex.forward(x, w, ids, shared_output=sh, routed_scale=rs)
        for _ in range(5):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
        d = ex.forward(x, w, ids, routed_scale=rs, defer_finalize=True)
        assert torch.equal(d.finalize(sh), want)
    assert all(int(c.abs().sum()) == 0 for c in ex._fin_counts.values())
    ref = TorchExperts(weights).forward(x, w, ids, shared_output=shared, routed_scale=1.5)
    assert _rel(ex.forward(x, w, ids, shared_output=shared, routed_scale=1.5), ref) < 1e-2


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fragment_kernel_mixed_blocks(fmt):
    # ~10 rows per expert: the default mixes 16-row blocks (experts with > 8 rows, here also one with
    # > 16) and 8-row blocks; other ranks' pairs are skipped
    e, h, i, t, k = 16, 1024, 512, 40, 4
    weights, x, w, ids, shared = _problem(fmt, e, h, i, t, k, seed=31)
    ids = ids.clone()
    ids[:30, 0] = 3
    ids[5, 2] = -1
    assert default_config(fmt, t * k, e, True).small is not None
    ref = TorchExperts(weights).forward(x, w, ids, shared_output=shared, routed_scale=1.5)
    ex = TritonExperts(weights, frag=True)
    _poison_allocator()
    out = ex.forward(x, w, ids, shared_output=shared, routed_scale=1.5)
    assert _rel(out, ref) < 1e-2
    assert torch.equal(ex.forward(x, w, ids, routed_scale=1.5, defer_finalize=True).finalize(shared), out)
    again = _graph_replay(lambda: ex.forward(x, w, ids, shared_output=shared, routed_scale=1.5))
    assert torch.equal(again, out)


def test_fragment_kernel_is_the_default_for_few_rows_and_graph_capturable():
    weights, x, w, ids, shared = _problem("nvfp4", 64, 512, 256, 3, 8, seed=11)
    ex = TritonExperts(weights)
    assert ex.frag
    ref = TorchExperts(weights).forward(x, w, ids, shared_output=shared)
    out = ex.forward(x, w, ids, shared_output=shared)
    again = _graph_replay(lambda: ex.forward(x, w, ids, shared_output=shared))
    assert _rel(out, ref) < 1e-2 and torch.equal(again, out)


# ------------------------------------------------ large batches: tl.dot tiles + 16-row tail blocks
def test_split_align_puts_remainders_in_tail_blocks():
    from moe_kernels.triton_align import align_split
    for t, k, e, bm, tail in [(4096, 8, 256, 128, 64), (1024, 8, 256, 32, 16), (600, 4, 16, 128, 0), (3, 8, 64, 64, 48)]:
        ids = torch.randint(0, e, (t, k), device=DEV, dtype=torch.int32)
        ids[0, -1] = -1
        _check_split(align_split(ids, e, bm, tail), ids, e, bm, tail)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("bm,tail_rows", [(128, 64), (32, 31), (64, 0)])
def test_tl_dot_tiles_with_fragment_tail_blocks(fmt, bm, tail_rows):
    # ~150 rows per expert, one expert with many more, other ranks' pairs: full bm-row tl.dot tiles,
    # remainders of <= tail_rows rows in 16-row fragment-kernel blocks (the rest: one more tile)
    e, h, i, t, k = 16, 1024, 512, 600, 4
    weights, x, w, ids, shared = _problem(fmt, e, h, i, t, k, seed=41 + bm)
    ids = ids.clone()
    ids[:400, 0] = 5
    ids[7, 1] = -1
    tile = GemmConfig(128, 64, 8, 2, 8, swap=bm == 32)
    cfg = MoEConfig(bm, tile, tile, tail=(FragConfig(2, 4, 1, 1, 3), FragConfig(2, 4, 1, 1, 3)), tail_rows=tail_rows)
    ref = TorchExperts(weights).forward(x, w, ids, shared_output=shared, routed_scale=1.5)
    ex = TritonExperts(weights, cfg, frag=True)
    _poison_allocator()
    out = ex.forward(x, w, ids, shared_output=shared, routed_scale=1.5)
    assert _rel(out, ref) < 1e-2
    # the tiles alone (no tail blocks) compute the same rows: the two kernels agree to bf16 rounding
    plain = TritonExperts(weights, MoEConfig(bm, tile, tile), frag=True).forward(x, w, ids, shared_output=shared,
                                                                                routed_scale=1.5)
    assert _rel(out, plain) < 1e-2
    assert torch.equal(ex.forward(x, w, ids, routed_scale=1.5, defer_finalize=True).finalize(shared), out)
    again = _graph_replay(lambda: ex.forward(x, w, ids, shared_output=shared, routed_scale=1.5))
    assert torch.equal(again, out)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t,k", [(1, 8), (7, 4), (40, 4), (160, 4), (600, 4)])
def test_coalesced_activation_order_changes_no_bit(fmt, t, k):
    # GEMM1 reading a reordered x and writing the intermediate reordered, GEMM2 reading it so: the same
    # K pairs meet in every MMA, so the output is bit-identical to the natural order (8-row, mixed,
    # 16-row and tile + tail paths)
    weights, x, w, ids, shared = _problem(fmt, 16, 1024, 512, t, k, seed=51 + t)
    cfg = default_config(fmt, t * k, 16, True)
    if t == 600:
        tile = GemmConfig(128, 64, 8, 2, 8)
        cfg = MoEConfig(128, tile, tile, tail=(FragConfig(2, 4, 1, 1, 3), FragConfig(2, 4, 1, 1, 3)), tail_rows=64)
    assert cfg.coalesce
    _poison_allocator()
    out = TritonExperts(weights, cfg, frag=True).forward(x, w, ids, shared_output=shared)
    natural = TritonExperts(weights, replace(cfg, coalesce=False), frag=True).forward(x, w, ids, shared_output=shared)
    assert torch.equal(out, natural)
    assert _rel(out, TorchExperts(weights).forward(x, w, ids, shared_output=shared)) < 1e-2


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "bf16"])
@pytest.mark.parametrize("t,k", [(1, 4), (7, 4), (40, 4), (300, 4), (1200, 4)])
def test_gpt_oss_swiglu_and_biases_match_reference(fmt, t, k):
    """activation='swiglu_oai' with expert biases on every path the default configs take (fragment
    kernel incl. the one-token fused finalize, mixed / 16-row blocks, tl.dot tiles with tails)."""
    e, h, i = 16, 512, 256
    g = torch.Generator(device=DEV).manual_seed(t * 7 + k)
    weights = ExpertWeights.from_dense(torch.randn(e, 2 * i, h, device=DEV, generator=g) / 6,
                                       torch.randn(e, h, i, device=DEV, generator=g) / i ** 0.5, fmt)
    weights.extras.update(w13_bias=torch.randn(e, 2 * i, device=DEV, generator=g).bfloat16() * 2,
                          w2_bias=torch.randn(e, h, device=DEV, generator=g).bfloat16())
    x = torch.randn(t, h, device=DEV, generator=g).bfloat16()
    w, ids = softmax_topk(torch.randn(t, e, device=DEV, generator=g), k, renormalize=True)
    shared = torch.randn(t, h, device=DEV, generator=g).bfloat16()
    ref = TorchExperts(weights, activation="swiglu_oai").forward(x, w, ids, shared_output=shared)
    silu = TorchExperts(weights).forward(x, w, ids, shared_output=shared)
    assert _rel(silu, ref) > 0.1   # the clamp and the +1 matter on this data
    _poison_allocator()
    out = TritonExperts(weights, activation="swiglu_oai").forward(x, w, ids, shared_output=shared)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_selftest_triton_gpt_oss_experts(fmt):
    res = selftest("triton", fmt, DEV, activation="swiglu_oai", bias=True)
    assert res.ok, res.message


PREFILL_CONFIGS = [PrefillConfig(128, 64, 8, 3), PrefillConfig(256, 32, 8, 4, swap=True),
                   PrefillConfig(128, 128, 4, 3, progs_per_sm=2), PrefillConfig(64, 64, 4, 3, swap=True, progs_per_sm=1)]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("pc", PREFILL_CONFIGS, ids=lambda c: "n{}k{}w{}s{}{}p{}".format(
    c.block_n, c.bkh, c.num_warps, c.num_stages, "swap" if c.swap else "", c.progs_per_sm))
def test_prefill_kernel_matches_reference(fmt, pc):
    # one expert with many rows, other ranks' pairs; I = 512: 128-row blocks with fragment tail blocks;
    # I = 320 (no fragment copy fits): the last gate/up tile partly past N (masked), 128- and 64-row
    # blocks alone; a graph replay gives the same bits
    nt2 = FragConfig(2, 4, 1, 1, 3)
    if fmt == "mxfp4" and pc.swap and pc.block_n >= 256:   # measured wrong (triton_prefill.check_config)
        weights, x, w, ids, _ = _problem(fmt, 16, 1024, 512, 64, 4, seed=1)
        with pytest.raises(ValueError, match="MXFP4 gate/up with swap"):
            TritonExperts(weights, MoEConfig(64, pc, pc)).forward(x, w, ids)
        pc = replace(pc, block_n=128)
    for i, cfg in ((512, MoEConfig(128, pc, pc, tail=(nt2, nt2), tail_rows=32)), (320, MoEConfig(128, pc, pc)),
                   (320, MoEConfig(64, pc, pc))):
        e, h, t, k = 16, 1024, 600, 4
        weights, x, w, ids, shared = _problem(fmt, e, h, i, t, k, seed=61 + pc.block_n + i)
        ids = ids.clone()
        ids[:400, 0] = 5
        ids[7, 1] = -1
        ref = TorchExperts(weights).forward(x, w, ids, shared_output=shared, routed_scale=1.5)
        ex = TritonExperts(weights, cfg, frag=cfg.tail is not None)
        _poison_allocator()
        out = ex.forward(x, w, ids, shared_output=shared, routed_scale=1.5)
        assert _rel(out, ref) < 1e-2, (i, cfg)
        again = _graph_replay(lambda: ex.forward(x, w, ids, shared_output=shared, routed_scale=1.5))
        assert torch.equal(again, out)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_prefill_default_on_the_deepseek_shard(fmt):
    # DeepSeek-V3 TP8 experts at 4096 tokens: the default (prefill kernel + tails) against the reference
    e, h, i, t, k = 256, 7168, 256, 4096, 8
    weights, x, w, ids, shared = _problem(fmt, e, h, i, t, k, seed=71)
    ex = TritonExperts(weights)
    assert isinstance(ex.config_for(t * k).gemm1, PrefillConfig)
    out = ex.forward(x, w, ids, shared_output=shared)
    assert _rel(out, TorchExperts(weights).forward(x, w, ids, shared_output=shared)) < 1e-2


@pytest.mark.parametrize("t,k", [(1, 8), (40, 4), (600, 4), (4096, 8)])
def test_w8a8_matches_its_reference(t, k):
    # FP8 W8A8 (act_quant="fp8") on every block size of default_w8a8_config, against the torch W8A8
    # reference (same activation quantization) and, looser, the exact W8A16 one; graph replay identical
    e, h, i = 64, 2048, 768
    weights, x, w, ids, shared = _problem("fp8", e, h, i, t, k, seed=81 + t)
    ids = ids.clone()
    ids[0, -1] = -1
    ref = TorchExperts(weights, act_quant="fp8").forward(x, w, ids, shared_output=shared)
    exact = TorchExperts(weights).forward(x, w, ids, shared_output=shared)
    ex = TritonExperts(weights, act_quant="fp8")
    assert isinstance(ex.config_for(t * k).gemm1, W8A8Config)
    _poison_allocator()
    out = ex.forward(x, w, ids, shared_output=shared)
    assert _rel(out, ref) < 2e-2 and _rel(out, exact) < 8e-2
    again = _graph_replay(lambda: ex.forward(x, w, ids, shared_output=shared))
    assert torch.equal(again, out)
