"""The reconcile work queue, the sweep's due rule and the watch cache's relist diff (issue 34 items 1-2)."""

import asyncio

import pytest

from moe_operator.resync import Mark, due
from moe_operator.watch_cache import relist_changes
from moe_operator.workqueue import WorkQueue


def test_a_key_is_never_worked_on_twice_at_once_and_an_add_while_active_runs_again():
    running, seen, peak = set(), [], [0]

    async def process(key):
        assert key not in running, "two workers on one key"
        running.add(key)
        peak[0] = max(peak[0], len(running))
        seen.append(key)
        await asyncio.sleep(0.05)
        running.discard(key)
        return None

    async def go():
        q = WorkQueue(4, process)
        q.start()
        for _ in range(5):
            q.add("a")  # queued once
        q.add("b")
        await asyncio.sleep(0.01)
        q.add("a")  # while a worker has it: once more after
        q.add("a")
        await asyncio.sleep(0.3)
        await q.stop()

    asyncio.run(go())
    assert sorted(seen) == ["a", "a", "b"] and peak[0] == 2


def test_retry_after_requeues_and_a_failure_is_retried():
    calls = []

    async def process(key):
        calls.append(key)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return 0.05 if len(calls) == 2 else None

    async def go(monkeypatch_retry):
        import moe_operator.workqueue as wq
        wq.RETRY_SECONDS = monkeypatch_retry
        q = WorkQueue(1, process)
        q.start()
        q.add("k")
        await asyncio.sleep(0.4)
        await q.stop()

    import moe_operator.workqueue as wq
    old = wq.RETRY_SECONDS
    try:
        asyncio.run(go(0.05))
    finally:
        wq.RETRY_SECONDS = old
    assert calls == ["k", "k", "k"]


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        WorkQueue(0, lambda k: None)


def test_the_sweep_skips_an_object_whose_inputs_did_not_move():
    m = Mark("7", "inv", at=100.0)
    assert not due(m, "7", "inv", now=150.0, full_seconds=300)
    assert due(None, "7", "inv", 150.0, 300)                 # never reconciled
    assert due(m, "8", "inv", 150.0, 300)                    # the object changed (spec, someone's status edit)
    assert due(m, "7", "inv2", 150.0, 300)                   # the GPU inventory changed
    assert due(m, "7", "inv", 400.0, 300)                    # the safety net
    assert due(m, "7", "inv", 150.0, 0)                      # a kind not watched: every sweep
    r = Mark("7", "inv", at=100.0, retry_at=110.0)
    assert not due(r, "7", "inv", 105.0, 300) and due(r, "7", "inv", 110.0, 300)


def test_a_relist_reports_what_the_watch_missed():
    def o(name, rv):
        return {"metadata": {"namespace": "n", "name": name, "resourceVersion": rv}}
    old = {("n", "a"): o("a", "1"), ("n", "b"): o("b", "1"), ("n", "c"): o("c", "1")}
    new = {("n", "a"): o("a", "1"), ("n", "b"): o("b", "2"), ("n", "d"): o("d", "3")}
    got = sorted((t, x["metadata"]["name"]) for t, x in relist_changes(old, new))
    assert got == [("ADDED", "d"), ("DELETED", "c"), ("MODIFIED", "b")]
