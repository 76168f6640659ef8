"""A standby replica (kopf peering paused it) runs no sweep, work-queue or revocation round; the
leader does. The pause signal is kopf's own: a daemon on the peering object, which kopf's real
daemon machinery stops on pause. Here the daemon runs under kopf's Toggle and a real stop flag."""
import asyncio
import dataclasses

import kopf
import pytest
from kopf._cogs.aiokits.aiotoggles import Toggle
from kopf._core.intents import registries

from moe_operator import handlers, revocation
from moe_operator.handlers import State


class _Kube:
    def __init__(self):
        self.lists = 0

    def list_moeds(self, *_):
        self.lists += 1
        return []


def _st(leading: bool) -> State:
    st = State(kube=_Kube(), cfg=handlers.Config())  # type: ignore[arg-type]
    st.leading = Toggle(leading, name="leading")
    return st


def test_revocation_waits_while_standing_by_and_resumes():
    async def go():
        st = _st(False)
        task = asyncio.create_task(revocation.run(st, interval=0.01))
        await asyncio.sleep(0.15)
        paused = st.kube.lists
        await st.leading.turn_to(True)
        await asyncio.sleep(0.15)
        resumed = st.kube.lists
        await st.leading.turn_to(False)
        await asyncio.sleep(0.05)
        before = st.kube.lists
        await asyncio.sleep(0.15)
        after = st.kube.lists
        task.cancel()
        return paused, resumed, before, after

    paused, resumed, before, after = asyncio.run(go())
    assert paused == 0
    assert resumed >= 3
    assert after - before <= 1  # at most the round already past the gate


def test_sweep_waits_while_standing_by_and_resumes(monkeypatch):
    rounds = []

    async def fake_sweep(st, logger):
        rounds.append(1)

    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 0.01)
    monkeypatch.setattr(handlers, "sweep", fake_sweep)
    monkeypatch.setattr(handlers, "refresh_inventory", lambda st: None)

    async def go():
        st = _st(False)
        st.indexes["nodes"] = {}
        task = asyncio.create_task(handlers._resync_loop(st, None))
        await asyncio.sleep(0.15)
        paused = len(rounds)
        health = handlers.sweep_health(st, now=st.swept + 10_000)  # standby: not "stuck"
        await st.leading.turn_to(True)
        await asyncio.sleep(0.15)
        task.cancel()
        return paused, health, len(rounds)

    paused, health, resumed = asyncio.run(go())
    assert paused == 0
    assert health == {"standingBy": 1.0}
    assert resumed >= 3


def test_peering_daemon_turns_leading_on_until_kopf_stops_it():
    async def go():
        st = _st(False)
        memo = kopf.Memo(state=st)
        stopped = asyncio.Event()  # the daemon only awaits .wait(), as kopf's DaemonStopped offers
        task = asyncio.create_task(handlers.lead_peering(stopped=stopped, memo=memo))
        await asyncio.sleep(0.02)
        on = st.leading.is_on()
        stopped.set()  # kopf's daemon_killer on pause
        await task
        return on, st.leading.is_on(), st.peering_daemons

    assert asyncio.run(go()) == (True, False, 0)


@pytest.mark.parametrize("clusterwide,plural", [(True, "clusterkopfpeerings"), (False, "kopfpeerings")])
def test_peering_daemon_registered_on_own_peering_without_finalizer(clusterwide, plural):
    settings = kopf.OperatorSettings()
    settings.peering.clusterwide = clusterwide
    settings.peering.name = "rel-moe-operator"
    spawning = registries.get_default_registry()._spawning
    before = list(spawning._handlers)
    try:
        handlers.register_peering_daemon(settings)
        h = spawning._handlers[-1]
        assert h.fn is handlers.lead_peering and h.requires_finalizer is False
        assert h.selector.plural == plural and h.selector.group == "kopf.dev"
        assert h.when(name="rel-moe-operator") and not h.when(name="other")
    finally:
        spawning._handlers[:] = before
