"""revocation.run: one operator-level loop, not a kopf timer per MoEDeployment (issue 34).

A Secret that loses its label takes the token out within one interval, as the per-object timer did;
a Secret named by several objects is read once per pass; no kopf timer (and so no finalizer kopf
would put on every object) is registered for MoEDeployments."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from types import SimpleNamespace

import kopf

from moe_operator import handlers, revocation
from moe_operator.policy import TOKEN_SECRET_LABEL, Policy

TOK = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}


def _moed(name, secret="hf", workload=True):
    return {"metadata": {"namespace": "t", "name": name, "uid": f"u-{name}", "resourceVersion": "1"},
            "spec": {"model": {"uri": "hf://org/m", "tokenSecretRef": {"name": secret, "key": "token"}}},
            "status": {"workload": {"kind": "Deployment", "name": name}} if workload else {}}


def _deployment(name):
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"namespace": "t", "name": name},
            "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "engine", "env": [TOK]}]}}}}


class _Kube:
    """MoEDeployments, their Deployments and Secrets' labels in memory; counts Secret reads."""

    cache = moed_cache = None

    def __init__(self, names):
        self.moeds = [_moed(n) for n in names]
        self.workloads = {n: _deployment(n) for n in names}
        self.labels = {("t", "hf"): {TOKEN_SECRET_LABEL: "true"}}
        self.secret_reads, self.events, self.fail = 0, [], set()

    def list_moeds(self, namespaces=None, cached=False):
        return self.moeds

    def secret_labels(self, ns, name):
        self.secret_reads += 1
        return self.labels.get((ns, name))

    def get(self, kind, ns, name, cached=True):
        if name in self.fail:
            raise RuntimeError("boom")
        return copy.deepcopy(self.workloads.get(name))

    def merge_patch(self, obj):
        self.workloads[obj["metadata"]["name"]]["spec"].update(obj["spec"])

    def post_event(self, obj, type_, reason, message):
        self.events.append((obj["metadata"]["name"], type_, reason))

    def token_in(self, name):
        return TOK in self.workloads[name]["spec"]["template"]["spec"]["containers"][0]["env"]


def _cfg(**kw):
    return SimpleNamespace(policy=Policy(**kw), namespaces=[])


def test_a_secret_named_by_many_objects_is_read_once_per_pass_and_one_failure_stops_nothing():
    kube = _Kube(["a", "b", "c"])
    kube.moeds.append(_moed("pending", workload=False))  # no workload yet: not looked at
    acted, failed = revocation.sweep(kube, _cfg(), kube.moeds)
    assert acted == [] and failed == [] and kube.secret_reads == 1
    del kube.labels[("t", "hf")]  # the Secret is gone
    kube.fail = {"b"}
    acted, failed = revocation.sweep(kube, _cfg(), kube.moeds)
    assert kube.secret_reads == 2
    assert [(body["metadata"]["name"], reason) for body, reason, _ in acted] == [("a", "TokenRevoked"), ("c", "TokenRevoked")]
    assert len(failed) == 1 and failed[0].startswith("t/b: RuntimeError: boom")
    assert not kube.token_in("a") and not kube.token_in("c") and kube.token_in("b")


def test_a_secret_losing_its_label_takes_the_token_out_within_one_interval():
    """The timer ran each object's check every INTERVAL; the loop does all of them every INTERVAL,
    so the token is out within one interval (plus the pass) of the label's removal, for every object."""
    interval = 0.3
    kube = _Kube([f"m{i}" for i in range(50)])
    st = handlers.State(kube=kube, cfg=_cfg())  # type: ignore[arg-type]

    async def go():
        task = asyncio.create_task(revocation.run(st, interval))
        await asyncio.sleep(interval * 1.5)  # a pass or more with the label on: nothing happens
        assert all(kube.token_in(m["metadata"]["name"]) for m in kube.moeds) and not kube.events
        t0 = time.monotonic()
        kube.labels[("t", "hf")] = {}  # the owner takes the label off
        while any(kube.token_in(m["metadata"]["name"]) for m in kube.moeds) and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        took = time.monotonic() - t0
        await asyncio.sleep(0.1)
        task.cancel()
        return took

    took = asyncio.run(go())
    assert took < interval + 0.25, took
    assert sorted(e[0] for e in kube.events) == sorted(m["metadata"]["name"] for m in kube.moeds)
    assert {e[1:] for e in kube.events} == {("Warning", "TokenRevoked")}  # one Event per object, once
    st.pool.shutdown()


def test_the_loop_scales_to_zero_under_a_tightened_policy_and_survives_a_failed_list(caplog):
    kube = _Kube(["m"])
    kube.moeds[0]["spec"] = {"model": {"uri": "hf://org/m"}, "engine": {"image": "evil.example/engine:1"}}
    st = handlers.State(kube=kube, cfg=_cfg(allowed_registries=("ghcr.io/moe-operator",),  # type: ignore[arg-type]
                                            on_violation="scaleToZero"))
    calls = {"n": 0}
    listing = kube.list_moeds

    def flaky_list(namespaces=None, cached=False):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("connection refused")
        return listing(namespaces, cached)

    kube.list_moeds = flaky_list

    async def go():
        task = asyncio.create_task(revocation.run(st, 0.05))
        t0 = time.monotonic()
        while not kube.events and time.monotonic() - t0 < 3:
            await asyncio.sleep(0.01)
        task.cancel()

    with caplog.at_level(logging.WARNING):
        asyncio.run(go())
    assert kube.workloads["m"]["spec"]["replicas"] == 0 and kube.events[0][2] == "PolicyEnforced"
    assert any("token revocation: ConnectionError" in r.getMessage() for r in caplog.records)
    assert not any(r.exc_info for r in caplog.records)  # one line, no traceback
    st.pool.shutdown()


def test_no_per_object_timer_and_so_no_finalizer_on_moedeployments():
    """kopf spawns a task per object for every timer or daemon, and a timer makes kopf put its
    finalizer on every object (a PATCH at creation, one at deletion, and a delete that waits for the
    operator). None is registered; the revocation loop starts with the sweep."""
    registry = kopf.get_default_registry()
    assert not list(registry._spawning.get_all_handlers()), [h.id for h in registry._spawning.get_all_handlers()]
    assert not any(h.requires_finalizer for h in registry._changing.get_all_handlers())
    assert not hasattr(revocation, "token_revocation")
    import inspect

    assert "revocation.run(st)" in inspect.getsource(handlers.start_resync)
