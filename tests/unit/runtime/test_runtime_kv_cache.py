"""Paged KV cache, prefix reuse, chunked prefill and preemption (issue 18 items 2-4), on CPU.

BlockManager bookkeeping on its own, then the engine stepped synchronously (Engine.step) over a tiny
checkpoint of each architecture (GQA Qwen3-MoE, MLA DeepSeek-V3) in fp32 with greedy decoding:
- a second prompt sharing a system prompt computes only its suffix (prefill tokens counted), gives
  the same tokens as an engine without prefix caching, and the hit shows in /metrics;
- a long prompt prefilled in chunks while another request decodes: the decode gains a token in every
  step of the prefill, and both outputs equal those of an unchunked engine;
- too few blocks for every running sequence: preemption (recompute), no failure, same outputs;
- every block is free again once all requests finish.
"""

import pytest
import torch

from moe_kernels.reference import TorchExperts
from moe_runtime.checkpoint_writer import make_checkpoint
from moe_runtime.engine import Engine, Finished, Request, SamplingParams
from moe_runtime.kv_cache import BlockManager, OutOfBlocks
from moe_runtime.loader import build_model, load_checkpoint
from moe_runtime.metrics import Metrics


# ------------------------------------------------------------------------------------------------
# BlockManager

def test_blocks_tables_refcounts_and_free():
    bm = BlockManager(8, 4)
    a, hit = bm.allocate(list(range(10)))  # 3 blocks
    assert hit == 0 and len(a.table) == 3 and bm.num_free == 5
    bm.ensure(a, 12)
    assert len(a.table) == 3
    bm.ensure(a, 13)
    assert len(a.table) == 4 and bm.num_free == 4
    bm.free_seq(a)
    assert bm.num_free == 8 and bm.usage == 0
    with pytest.raises(OutOfBlocks):
        bm.allocate(list(range(33)))


def test_prefix_blocks_are_shared_after_they_are_computed():
    bm = BlockManager(16, 4)
    sys_prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a, hit = bm.allocate(sys_prompt + [1, 2, 3])
    assert hit == 0
    b0, hit = bm.allocate(sys_prompt + [7, 8])  # nothing registered yet: not computed
    assert hit == 0
    bm.free_seq(b0)
    bm.register(a, sys_prompt + [1, 2, 3], 13)  # a's KV now computed: 3 full blocks registered
    b, hit = bm.allocate(sys_prompt + [7, 8])
    assert hit == 8 and b.table[:2] == a.table[:2] and b.table[2] != a.table[2]
    assert bm.blocks[a.table[0]].ref == 2
    # same tokens under another prefix: a different hash, no hit
    c, hit = bm.allocate(list(range(104, 112)) + [0])
    assert hit == 0
    # a whole cached prompt still computes its last token
    d, hit = bm.allocate(sys_prompt[:8])
    assert hit == 4
    assert bm.hit_tokens == 12 and bm.queried_tokens == 13 + 12 + 12 + 9 + 8


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(4, 2)
    p1, p2 = [1, 2, 3], [5, 6, 7]
    a, _ = bm.allocate(p1)
    bm.register(a, p1, 3)
    bm.free_seq(a)
    b, _ = bm.allocate(p2)
    bm.register(b, p2, 3)
    bm.free_seq(b)
    assert bm.num_free == 4 and len(bm.cached) == 2  # both prefixes stay cached while nobody needs the memory
    _, hit = bm.allocate(p1)  # touch p1: p2's block is now the least recently used
    assert hit == 2
    c, hit = bm.allocate([9, 9, 9, 9])  # needs 2 fresh blocks: the unhashed one, then p2's
    assert hit == 0
    assert bm.match_prefix(p2) == [] and len(bm.match_prefix(p1)) == 1


def test_can_allocate_counts_hits_that_leave_the_free_list():
    bm = BlockManager(3, 2)
    p = [1, 2, 3, 4, 5]
    a, _ = bm.allocate(p)
    bm.register(a, p, 5)
    bm.free_seq(a)
    assert bm.can_allocate(p)  # 2 hits (from the free list) + 1 fresh = 3 blocks
    assert not bm.can_allocate(p + [6, 7])


# ------------------------------------------------------------------------------------------------
# the engine

class _Loop:
    def call_soon_threadsafe(self, fn, *a):
        fn(*a)


class _Sink(list):
    def put_nowait(self, item):
        self.append(item)


def req(prompt, n):
    return Request(list(prompt), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), _Loop(), _Sink())


def tokens(r):
    assert isinstance(r.out[-1], Finished) and r.out[-1].reason == "length", r.out[-1:]
    return list(r.out[:-1])


def run(eng, reqs, limit=5000):
    for r in reqs:
        eng.submit(r)
    for _ in range(limit):
        if not (eng.waiting or eng.running):
            return [tokens(r) for r in reqs]
        eng.step()
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def model(request, tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp(request.param)
    make_checkpoint(d, request.param, "bf16", size="tiny", seed=3)
    ck = load_checkpoint(d, "cpu", torch.float32, log=lambda *a, **k: None)
    yield build_model(ck, lambda w: TorchExperts(w, torch.float32), False)
    torch.set_num_threads(n)


def engine(model, **kw):
    opts = dict(max_batch=4, max_queue=16, max_len=160, stop_ids=set(), block_size=8, kv_blocks=64)
    opts.update(kw)
    return Engine(model, "cpu", **opts)


SYSTEM = [(i * 37 + 11) % 500 + 3 for i in range(37)]  # 4 full blocks of 8 + 5 tokens


def test_shared_prefix_computes_only_the_suffix(model):
    m = Metrics()
    eng = engine(model, metrics=m)
    p1, p2 = SYSTEM + [40, 41, 42], SYSTEM + [90, 91, 92, 93, 94]
    out1 = run(eng, [req(p1, 6)])
    before = eng.prefill_computed
    out2 = run(eng, [req(p2, 6)])
    assert eng.prefill_computed - before == len(p2) - 32  # the 4 shared full blocks were not computed
    again = eng.prefill_computed
    out3 = run(eng, [req(p2, 6)])  # the same prompt again: only its last token is computed
    assert eng.prefill_computed - again == len(p2) - (len(p2) - 1) // 8 * 8
    cold = engine(model, prefix_caching=False)
    assert run(cold, [req(p1, 6)]) == out1 and run(cold, [req(p2, 6)]) == out2 == out3
    assert cold.prefill_computed == len(p1) + len(p2)
    text = m.render().decode()
    hits = 32 + (len(p2) - 1) // 8 * 8
    assert f"moe_runtime_prefix_cache_hits_total {float(hits)}" in text
    assert f"vllm:prefix_cache_queries_total{{model_name=\"\"}} {float(len(p1) + 2 * len(p2))}" in text
    assert "moe_runtime_prefix_cache_hit_rate " in text and "moe_runtime_kv_cache_blocks 64.0" in text
    assert eng.kv.num_free == 64 and eng.kv.usage == 0  # every block released on finish


def test_chunked_prefill_interleaves_with_decode_and_equals_unchunked(model):
    long_prompt = [(i * 13 + 5) % 500 + 3 for i in range(120)]
    short = [7, 8, 9]
    ref = run(engine(model, max_prefill_tokens=4096), [req(short, 30), req(long_prompt, 5)])
    eng = engine(model, max_prefill_tokens=16)
    s = req(short, 30)
    eng.submit(s)
    eng.step()
    eng.step()  # short is decoding now
    assert len(s.out) == 2
    long_req = req(long_prompt, 5)
    eng.submit(long_req)
    prefill_steps = 0
    while long_req.computed < len(long_prompt):
        had = len(s.out)
        eng.step()
        assert len(s.out) == had + 1, "a decode stalled behind the prefill"
        prefill_steps += 1
    assert prefill_steps == 8  # 120 tokens at 16 - 1 (the decode row) per step
    assert max(p for _, p in eng.steps) <= 15
    while eng.running or eng.waiting:
        eng.step()
    assert [tokens(s), tokens(long_req)] == ref


def test_preemption_happens_when_blocks_run_out(model):
    prompts = [[5 + i, 6, 7, 8, 9, 10] for i in range(3)]
    ref = [run(engine(model), [req(p, 60)])[0] for p in prompts]
    m = Metrics()
    eng = engine(model, kv_blocks=12, max_len=72, metrics=m)  # 3 x 66 tokens need 27 blocks
    assert run(eng, [req(p, 60) for p in prompts]) == ref
    text = m.render().decode()
    n = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("moe_runtime_preemptions_total")))
    assert n >= 1
    assert eng.kv.num_free == 12


def test_capacity_below_one_sequence_is_refused(model):
    from moe_runtime.errors import RuntimeFailure

    with pytest.raises(RuntimeFailure, match="KV cache too small"):
        engine(model, kv_blocks=4, max_len=160)


def test_budget_sets_the_block_count(model):
    per_block = model.kv_bytes_per_block(8)
    eng = engine(model, kv_blocks=None, kv_memory_bytes=per_block * 50 + 7)
    assert eng.kv.num_blocks == 50
