"""Scheduler defaults sized from the KV cache and the device (issue 31 item 3): without --max-batch the
running set is bounded by the KV blocks (one block of its own per decoding sequence; sglang 0.5.23
bounds it by KV tokens // 2) and vLLM 0.11.0's per-device max_num_seqs (1024 on H100/H200-class GPUs,
256 on other GPUs, 128 on CPU); without --max-queue a burst of many times the running set waits
instead of 429 (the old defaults, 8 running and 64 waiting, refused the 65th request)."""

import types

import torch

from moe_runtime import cli
from moe_runtime.engine import Engine, Finished, QueueFull, Request, SamplingParams, device_seq_ceiling
from moe_runtime.kv_cache import queue_limit, running_limit
from table_model import TableModel


class _Loop:
    def call_soon_threadsafe(self, fn, *a):
        fn(*a)


class _Sink(list):
    def put_nowait(self, item):
        self.append(item)


def test_running_limit_is_the_smaller_of_blocks_and_the_device_ceiling():
    assert running_limit(10_000, 1024) == 1024 and running_limit(300, 1024) == 300
    assert running_limit(0, 128) == 1 and queue_limit(1024) == 8192 and queue_limit(4) == 1024


def test_device_ceiling_follows_vllm(monkeypatch):
    assert device_seq_ceiling("cpu") == 128
    for name, gib, want in [("NVIDIA H200", 141, 1024), ("NVIDIA H100 80GB HBM3", 80, 1024),
                            ("NVIDIA A100-SXM4-80GB", 80, 256), ("NVIDIA L40S", 48, 256)]:
        props = types.SimpleNamespace(name=name, total_memory=gib * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, p=props: p)
        assert device_seq_ceiling("cuda:0") == want, name


def test_serve_leaves_both_unset_by_default():
    ns = cli._parser().parse_args(["serve", "--model", "/nonexistent"])
    assert ns.max_batch is None and ns.max_queue is None  # the engine sizes them


def test_a_burst_of_256_is_queued_and_served_by_default():
    eng = Engine(TableModel(64, seed=1), "cpu", None, None, 64, set(), kv_blocks=512, block_size=8)
    assert eng.max_batch == 128 and eng.max_queue == 1024  # 512 blocks, CPU ceiling 128
    reqs = [Request([1 + i % 60], SamplingParams(max_tokens=2, ignore_eos=True), _Loop(), _Sink())
            for i in range(256)]
    for r in reqs:
        eng.submit(r)  # QueueFull would raise here
    steps = 0
    while eng.waiting or eng.running:
        eng.step()
        steps += 1
        assert len(eng.running) <= 128
    assert all(isinstance(r.out[-1], Finished) and r.out[-1].completion_tokens == 2 for r in reqs)
    assert steps <= 8  # 128 at a time: two waves of prefill + decode


def test_the_kv_cache_bounds_the_running_set():
    eng = Engine(TableModel(64, seed=1), "cpu", None, 2, 64, set(), kv_blocks=24, block_size=8)
    assert eng.max_batch == 24
    try:
        for _ in range(3):
            eng.submit(Request([3], SamplingParams(max_tokens=1), _Loop(), _Sink()))
    except QueueFull:
        pass
    else:
        raise AssertionError("an explicit --max-queue 2 still bounds the queue")


def test_128_concurrent_streams_get_no_429_with_the_defaults(tmp_path):
    """The issue's burst, doubled: 128 streaming clients at once against the app with the default sizes
    (the old 8 running + 64 waiting refused those past the 72nd)."""
    import asyncio
    import json

    import httpx

    from moe_runtime.http.app import create_app
    from moe_runtime.http.state import ServerState
    from moe_runtime.metrics import Metrics
    from moe_runtime.tokenizer import Tokenizer, build_tokenizer_files

    build_tokenizer_files(tmp_path, 512, 64)
    tok = Tokenizer(tmp_path)
    m = Metrics()
    eng = Engine(TableModel(tok.vocab_size, seed=1), "cpu", None, None, 64, tok.stop_ids, m)
    eng.start()

    async def one(client, i):
        body = {"prompt": [5 + i], "max_tokens": 4, "ignore_eos": True, "stream": True}
        r = await client.post("/v1/completions", json=body)
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        return r.status_code, events[-1]["choices"][0]["finish_reason"] if events else None

    async def burst():
        transport = httpx.ASGITransport(app=create_app(ServerState("m", m, eng, tok, ready=True)))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await asyncio.gather(*[one(client, i % 60) for i in range(128)])

    try:
        assert asyncio.run(burst()) == [(200, "length")] * 128
    finally:
        eng.stop()
