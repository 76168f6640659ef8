"""The MoE combine under expert/tensor parallelism (moe_runtime.dist.combine, issue 19 item 1): the pure choice
between the all-reduce ("allgather": replicated tokens, one fp32 all-reduce) and the all-to-all
(all_to_all_single of the partial rows to the tokens' owners, fp32 sum there, all_gather_into_tensor),
and both paths over gloo giving the single-process logits and greedy tokens.

Measured (fp32 exact mode, tiny checkpoints, seed 1, max |logit diff| vs one process over prefill + 4
decode steps; all-reduce / all-to-all): DeepSeek ep2 1.5e-6 / 1.5e-6, Qwen3 ep2 0 / 0, Qwen3 tp2 (TP inside
the experts) 1.0e-6 / 1.0e-6, DeepSeek tp2xep4 1.9e-6 / 1.7e-6; within ATOL_FP32 = 1e-4 (only the order of
the fp32 sums differs: per-rank partials, then the all-reduce's order or the owner's rank order)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_runtime.checkpoint_writer import make_checkpoint
from moe_runtime.dist.combine import bytes_per_token, choose
from test_runtime_parallel import ATOL_FP32, _run_group, _single

pytestmark = pytest.mark.timeout(400)


def test_choice_is_all_reduce_for_small_batches_and_all_to_all_for_large_ones():
    # DeepSeek-V3: hidden 7168, top-8, shared expert; 8 ranks (tp8/ep8), bf16 activations
    c = choose(64, 7168, 8, 8, 8, shared=True)
    assert c.mode == "allgather" and 200 < c.threshold < 300, c
    assert choose(2048, 7168, 8, 8, 8, shared=True).mode == "alltoall"
    assert choose(math.ceil(c.threshold), 7168, 8, 8, 8, shared=True).mode == "alltoall"
    # Qwen3-235B-A22B: hidden 4096, top-8 of 128, no shared expert: only rows with a local expert travel
    q = choose(64, 4096, 8, 8, 8, shared=False)
    assert q.mode == "allgather" and 300 < q.threshold < 400, q
    ar, a2a = bytes_per_token(4096, 8, 8, 8, shared=False, act_bytes=2)
    assert a2a < bytes_per_token(4096, 8, 8, 8, shared=True, act_bytes=2)[1] < ar
    # fp32 activations: the same bytes as the fp32 all-reduce, one collective more: never
    assert choose(10**6, 7168, 8, 8, 8, shared=True, act_bytes=4).mode == "allgather"
    assert choose(10**6, 7168, 8, 1, 1, shared=True).mode == "none"
    # the threshold scales with alpha x beta (latency-bound small batches)
    assert choose(64, 7168, 8, 8, 8, True, alpha=2e-6).threshold < c.threshold / 5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for arch in ("deepseek_v3", "qwen3_moe"):
        d = tmp_path_factory.mktemp(arch)
        make_checkpoint(d, arch, "bf16", "tiny", seed=1, log=lambda s: None)
        out[arch] = d
    return out


@pytest.mark.parametrize("arch,tp,ep", [
    ("deepseek_v3", 1, 2),  # shared expert: the all-to-all carries every row (a reduce-scatter)
    ("qwen3_moe", 1, 2),    # no shared expert: only the rows with an expert on the sending rank
    ("qwen3_moe", 2, 1),    # TP inside the experts: partials of one expert on both ranks
])
def test_both_combines_equal_the_single_process_run(ckpts, tmp_path, monkeypatch, arch, tp, ep):
    path = ckpts[arch]
    ref, ref_toks = _single(path, "float32")
    diffs = {}
    for mode in ("allgather", "alltoall"):
        monkeypatch.setenv("MOE_EP_DISPATCH", mode)  # the spawned ranks inherit it
        out = tmp_path / mode
        out.mkdir()
        outs = _run_group(path, tp, ep, "float32", out)
        diffs[mode] = max((o["logits"] - ref).abs().max().item() for o in outs)
        for r, o in enumerate(outs):
            assert torch.equal(o["tokens"], ref_toks), f"{mode} rank {r}: greedy tokens differ"
        assert torch.equal(outs[0]["logits"], outs[1]["logits"]), f"{mode}: the ranks disagree"
    assert all(d <= ATOL_FP32 for d in diffs.values()), f"max |logit diff| vs one process: {diffs}"


def test_all_to_all_over_4_ranks_with_idle_owners(ckpts, tmp_path, monkeypatch):
    """4 ranks, decode steps of 2 tokens: two ranks own only padding rows."""
    monkeypatch.setenv("MOE_EP_DISPATCH", "alltoall")
    ref, ref_toks = _single(ckpts["deepseek_v3"], "float32")
    outs = _run_group(ckpts["deepseek_v3"], 2, 4, "float32", tmp_path)
    for r, o in enumerate(outs):
        d = (o["logits"] - ref).abs().max().item()
        assert d <= ATOL_FP32, f"rank {r}: max |logit diff| {d}"
        assert torch.equal(o["tokens"], ref_toks)


def test_bf16_all_to_all_matches_the_all_reduce(ckpts, tmp_path, monkeypatch):
    """bf16, the dtype the all-to-all is chosen for: both combines sum the same bf16 partials once in fp32
    and round once; on 2 ranks the sum of two fp32 values does not depend on the order, so with the same
    inputs every step (teacher forcing with the fp32 greedy tokens) the logits are bit-identical (measured:
    max difference 0.0)."""
    path = ckpts["deepseek_v3"]
    _, forced = _single(path, "float32")
    got = {}
    for mode in ("allgather", "alltoall"):
        monkeypatch.setenv("MOE_EP_DISPATCH", mode)
        out = tmp_path / mode
        out.mkdir()
        got[mode] = _run_group(path, 1, 2, "bfloat16", out, forced)[0]["logits"]
    assert torch.equal(got["alltoall"], got["allgather"]), (got["alltoall"] - got["allgather"]).abs().max().item()
