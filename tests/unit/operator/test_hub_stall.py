"""A hub that never answers holds no reconcile (issue 27 item 6): revision pinning and inspection
run on the hub pool, a reconcile waits HUB_WAIT_SECONDS and gets InspectionPending, then
InspectionFailed(HubTimeout) past the deadline; the real huggingface_hub client against a socket
that accepts connections and never sends a byte."""

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from stalled_hub import StalledHub  # noqa: E402

from moe_operator import inspection
from moe_operator.api import MoEDeploymentSpec
from moe_operator.io_pool import Background, DeadlineExceeded, Pending


@pytest.fixture
def stalled_hub(monkeypatch):
    import huggingface_hub.constants as c
    hub = StalledHub()
    monkeypatch.setattr(c, "ENDPOINT", hub.url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(inspection, "HUB_TIMEOUT_SECONDS", 30.0)  # longer than the test: only the pool isolates
    monkeypatch.setattr(inspection, "HUB_WAIT_SECONDS", 0.2)
    monkeypatch.setattr(inspection, "HUB_DEADLINE_SECONDS", 0.6)
    inspection.reset()
    yield hub
    hub.release()  # answers the held requests and later ones: the hub pool's threads end
    deadline = time.monotonic() + 20
    while inspection.HUB.running() and time.monotonic() < deadline:
        time.sleep(0.1)
    hub.close()
    inspection.reset()


def spec(uri, policy="pin"):
    return MoEDeploymentSpec.model_validate({"model": {"uri": uri, "revisionPolicy": policy}, "engine": {"name": "sglang"}})


def test_a_stalled_hub_gives_pending_then_a_timeout_never_a_blocked_caller(stalled_hub):
    t = time.monotonic()
    with pytest.raises(inspection.InspectionPending):
        inspection.pin(spec("hf://org/m"), {})
    assert time.monotonic() - t < 0.5  # the caller waited HUB_WAIT_SECONDS, not the hub
    time.sleep(0.6)
    with pytest.raises(inspection.InspectionFailed) as e:
        inspection.pin(spec("hf://org/m"), {})
    assert e.value.reason == "HubTimeout" and e.value.retry and "no answer after" in e.value.message
    # header inspection of a sha the same way
    sha = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(inspection.InspectionPending):
        inspection.inspect_spec(spec(f"hf://org/m@{sha}"), hub=True)
    assert stalled_hub.connections >= 1  # the hub was asked, and never answered


def test_follow_keeps_its_pinned_sha_while_the_hub_stalls(stalled_hub):
    known = "0123456789abcdef0123456789abcdef01234567"
    t = time.monotonic()
    p = inspection.pin(spec("hf://org/m", policy="follow"), {"revision": known, "revisionUri": "hf://org/m"})
    assert p.revision == known and time.monotonic() - t < 0.5


def test_background_runs_one_per_key_holds_failures_and_forgets_successes():
    bg = Background(workers=2, name="t", hold=0.3)
    gate, calls = threading.Event(), []

    def slow():
        calls.append(1)
        gate.wait(5)
        return 7

    with pytest.raises(Pending):
        bg.run("k", slow, wait=0.05, deadline=10)
    with pytest.raises(DeadlineExceeded):
        bg.run("k", slow, wait=0.05, deadline=0.0)  # still the same run, past its deadline
    gate.set()
    assert bg.run("k", slow, wait=1, deadline=10) == 7 and len(calls) == 1
    assert bg.run("k", lambda: 8, wait=1, deadline=10) == 8  # a success is not held

    def boom():
        calls.append(2)
        raise RuntimeError("hub said no")

    for _ in range(3):  # every waiter sees the one failure; the hub is asked once
        with pytest.raises(RuntimeError):
            bg.run("f", boom, wait=1, deadline=10)
    assert calls.count(2) == 1
    time.sleep(0.35)
    with pytest.raises(RuntimeError):
        bg.run("f", boom, wait=1, deadline=10)
    assert calls.count(2) == 2  # after `hold`, asked again


def test_the_webhook_never_asks_the_hub(stalled_hub):
    from moe_operator.reconcile import Config
    from moe_operator.webhook import fallback_warnings, verdict

    s = {"model": {"uri": "hf://org/m"}, "engine": {"name": "sglang"}, "moe": {"runnerBackend": "marlin"},
         "parallelism": {"tp": 2}}
    t = time.monotonic()
    assert verdict(s, Config()) is None and fallback_warnings(s, Config()) == []
    assert time.monotonic() - t < 0.5 and stalled_hub.connections == 0
