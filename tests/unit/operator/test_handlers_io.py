"""The operator's edges under faults (issues 27 item 6, 34 item 5): one log line per kind of
failure, liveness that follows the sweep, the sweep never waiting on a busy object."""

import asyncio
import logging
import time

import pytest

from moe_operator import handlers
from moe_operator.handlers import Quiet, State, sweep_health


def test_quiet_logs_one_line_per_kind_and_one_when_it_recovers(caplog):
    now = [0.0]
    q = Quiet(logging.getLogger("t"), clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="t"):
        for _ in range(200):
            q.failed("Kubernetes API unreachable", "MaxRetryError: connection refused", "retried in 10s")
        q.failed("listing MoEDeployments", "MaxRetryError", "retried in 10s")
        now[0] += handlers.QUIET_SECONDS + 1
        q.failed("Kubernetes API unreachable", "MaxRetryError: connection refused", "retried in 10s")
        q.ok("Kubernetes API unreachable")
        q.ok("Kubernetes API unreachable")  # nothing failed since: no second line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and sum("unreachable" in m for m in lines) == 3
    assert "retried in 10s" in lines[0] and lines[-1] == "Kubernetes API unreachable: recovered"
    assert not any(r.exc_info for r in caplog.records)  # no tracebacks


def test_liveness_fails_only_when_the_sweep_stops_going_round():
    st = State(kube=None, cfg=None)  # type: ignore[arg-type]
    assert sweep_health(st)["lastSweepSecondsAgo"] < 1
    with pytest.raises(RuntimeError, match="not finished a round"):
        sweep_health(st, now=time.monotonic() + handlers.LIVENESS_STALL_SECONDS + 1)


class _SlowKube:
    """get_moed of the busy object blocks until released; the others answer at once."""

    cache = moed_cache = None

    def __init__(self, release):
        self.release, self.reads = release, []

    def list_moeds(self, namespaces, cached=False):
        return [{"metadata": {"namespace": "a", "name": n, "resourceVersion": "1"}} for n in ("busy", "x", "y")]

    def get_moed(self, ns, name, cached=False):
        self.reads.append(name)
        if name == "busy":
            self.release.wait(10)
        return None  # gone: nothing more to do


def test_the_sweep_queues_without_waiting_and_a_slow_object_holds_one_worker(monkeypatch):
    import threading

    from moe_operator.workqueue import WorkQueue

    monkeypatch.setattr(handlers, "OBJECT_SECONDS", 0.3)
    monkeypatch.setattr(handlers.model_cache, "sweep", lambda *a: [])
    release = threading.Event()
    kube = _SlowKube(release)
    st = State(kube=kube, cfg=handlers.Config())  # type: ignore[arg-type]
    st.indexes.update(nodes={}, pods={})

    async def go():
        st.queue = WorkQueue(2, lambda key: handlers.work(st, key, logging.getLogger("t")))
        st.queue.start()
        t = time.monotonic()
        await handlers.sweep(st, logging.getLogger("t"))  # busy takes 10 s: the sweep does not wait for it
        queued = time.monotonic() - t
        while sorted(kube.reads) != ["busy", "x", "y"] and time.monotonic() - t < 3:
            await asyncio.sleep(0.01)
        others = time.monotonic() - t
        kube.reads.clear()
        await handlers.sweep(st, logging.getLogger("t"))  # no watch cache: every object is due again
        await asyncio.sleep(0.2)
        release.set()
        await st.queue.stop()
        return queued, others

    queued, others = asyncio.run(go())
    assert queued < 0.2 and others < 1
    assert sorted(kube.reads) == ["x", "y"]  # busy still holds its lock: skipped, not awaited


def test_status_only_events_of_an_owned_workload_change_nothing_the_reconcile_reads():
    from moe_operator.handlers import owned_essence

    dep = {"metadata": {"generation": 3, "labels": {"a": "1"}, "annotations": {"x": "y"}},
           "status": {"readyReplicas": 1, "updatedReplicas": 1, "replicas": 1, "observedGeneration": 3,
                      "conditions": [{"type": "Available", "lastUpdateTime": "t1"}]}}
    churn = {**dep, "status": {**dep["status"], "conditions": [{"type": "Available", "lastUpdateTime": "t2"}],
                               "availableReplicas": 1}}
    assert owned_essence(churn) == owned_essence(dep)
    for changed in ({**dep, "metadata": {**dep["metadata"], "generation": 4}},
                    {**dep, "metadata": {**dep["metadata"], "labels": {}}},
                    {**dep, "status": {**dep["status"], "readyReplicas": 0}}):
        assert owned_essence(changed) != owned_essence(dep)


def test_a_node_heartbeat_rebuilds_nothing_a_gpu_label_change_does():
    import kopf

    node = {"metadata": {"name": "n1", "labels": {"nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.count": "8"}},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}, "capacity": {"nvidia.com/gpu": "8"},
                       "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "t1"}]}}
    v0 = handlers._inventory["node_version"]
    handlers.gpu_nodes(name="n1", body=kopf.Body(node))
    v1 = handlers._inventory["node_version"]
    beat = {**node, "status": {**node["status"], "conditions": [{"type": "Ready", "status": "True",
                                                                 "lastHeartbeatTime": "t2"}]}}
    handlers.gpu_nodes(name="n1", body=kopf.Body(beat))
    assert handlers._inventory["node_version"] == v1 and v1 == v0 + 1
    gone = {**beat, "metadata": {"name": "n1", "labels": {}}}
    handlers.gpu_nodes(name="n1", body=kopf.Body(gone))
    assert handlers._inventory["node_version"] == v1 + 1
    st = State(kube=None, cfg=None)  # type: ignore[arg-type]
    st.indexes.update(nodes={"n1": [handlers.node_info(gone)]}, pods={})
    assert handlers.refresh_inventory(st) is True and st.inventory is not None
    assert handlers.refresh_inventory(st) is False  # nothing moved since


def _gpu_node(name, product, major, minor):
    labels = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.count": "8",
              "nvidia.com/gpu.compute.major": major, "nvidia.com/gpu.compute.minor": minor}
    return {"metadata": {"name": name, "labels": labels},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}, "capacity": {"nvidia.com/gpu": "8"},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


class _OneKube:
    cache = moed_cache = None

    def get_moed(self, ns, name, cached=False):
        return {"metadata": {"namespace": ns, "name": name, "resourceVersion": "5"}, "status": {}}

    def patch_status(self, ns, name, status):
        pass


def test_a_pool_arriving_during_a_reconcile_makes_the_sweep_run_it_again(monkeypatch):
    """The CI flake of test_node_pool_appearing_replans: the reconcile planned on the old classes
    while the loop took the new inventory's fingerprint; the mark must name what was planned on."""
    nodes = {"h": [handlers.node_info(_gpu_node("h", "NVIDIA-H200", "9", "0"))]}
    st = State(kube=_OneKube(), cfg=handlers.Config())  # type: ignore[arg-type]
    st.indexes.update(nodes=nodes, pods={})
    st.nodes_seen = -1
    handlers.refresh_inventory(st)
    before = st.inventory
    assert handlers.current_classes(nodes, {})  # the H200 node is a class

    def reconcile_while_a_pool_arrives(moed, classes, kube, cfg):
        nodes["b"] = [handlers.node_info(_gpu_node("b", "NVIDIA-B200", "10", "0"))]
        st.nodes_seen = -1  # the loop saw the node event and took the fingerprint
        assert handlers.refresh_inventory(st) is True
        return handlers.Outcome(status={"phase": "Pending"})

    monkeypatch.setattr(handlers, "reconcile", reconcile_while_a_pool_arrives)
    asyncio.run(handlers._reconcile_and_report(st, "a", "m", nodes, {}, logging.getLogger("t"), "test"))
    mark = st.marks[("a", "m")]
    assert st.inventory != before and mark.inventory == before
    assert handlers.due(mark, "5", st.inventory, mark.at, 300.0)  # the sweep runs it on the new pool
