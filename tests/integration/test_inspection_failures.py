"""A failing hub inspection against the real API server (issue 32 item 7): the failure is held for
its retry delay (30 s when the hub may recover, 300 s when it said the repo is not there), the hub
is not asked again in between (by the sweep every 2 s, by a spec change, by another object of the
same model), and the CheckpointInspectionFailed Warning Event is posted once per change of cause,
not per reconcile. The hub is a loopback HTTP server given to the operator as HF_ENDPOINT: 503 for
one repo (retryable; later 404, a new cause), 404 for another (permanent)."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .operator_fixture import OperatorProcess, chart_service_account_kubeconfig, condition, get_json, wait_for

pytestmark = pytest.mark.integration
SHA = "0123456789abcdef0123456789abcdef01234567"
RETRY_HOLD, PERMANENT_HOLD = 30, 300  # inspection.FAILED_HOLD_SECONDS


class FailingHub:
    """Answers every request for org/<repo> with the status `status[repo]`, as the hub words its
    errors (X-Error-Code, a JSON body); records when each repo was asked."""

    def __init__(self, status: dict[str, int]):
        self.status = dict(status)
        self.hits: dict[str, list[float]] = {r: [] for r in status}
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _answer(self, head: bool):
                repo = next((r for r in hub.status if f"/org/{r}/" in self.path + "/"), None)
                with hub._lock:
                    if repo is not None:
                        hub.hits[repo].append(time.monotonic())
                    code = hub.status.get(repo, 404)
                body = json.dumps({"error": f"org/{repo}: HTTP {code}"}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Error-Code", "RepoNotFound" if code == 404 else "ServerError")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def do_GET(self):
                self._answer(head=False)

            def do_HEAD(self):
                self._answer(head=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def asked(self, repo: str) -> list[float]:
        with self._lock:
            return list(self.hits[repo])

    def set(self, repo: str, code: int) -> None:
        with self._lock:
            self.status[repo] = code

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def hub_operator(crd, dev_cluster, kubectl, tmp_path_factory):
    hub = FailingHub({"flaky": 503, "gone": 404})
    d = tmp_path_factory.mktemp("inspection-failures")
    sa = chart_service_account_kubeconfig(dev_cluster, kubectl, d / "sa.kubeconfig")
    op = OperatorProcess(str(sa), d / "operator.log", env={
        "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(d / "hf-home")})
    op.start()
    time.sleep(2)
    yield op, hub
    op.stop()
    hub.close()


def test_a_failing_inspection_is_held_and_reported_once_per_cause(kubectl, hub_operator):
    op, hub = hub_operator
    ns = f"it-inspect-fail-{os.getpid()}"
    kubectl("create", "namespace", ns)

    def moed(name: str, uri: str) -> None:
        doc = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": name, "namespace": ns},
               "spec": {"model": {"uri": uri}, "engine": {"name": "sglang"}}}
        kubectl("apply", "-f", "-", input=json.dumps(doc))

    def inspected(name: str, reason: str, generation: int = 1):
        def check():
            c = condition(get_json(kubectl, "moed", name, "-n", ns), "CheckpointInspected")
            ok = c and c["status"] == "False" and c["reason"] == reason and c.get("observedGeneration") == generation
            return c if ok else None
        return check

    def events(name: str) -> list[dict]:
        items = get_json(kubectl, "events", "-n", ns, "--field-selector",
                         f"involvedObject.kind=MoEDeployment,involvedObject.name={name}")["items"]
        return [e for e in items if e["reason"] == "CheckpointInspectionFailed"]

    try:
        # flaky: the revision is resolved first (model_info, one request, no client retry): 503, retryable
        moed("flaky", "hf://org/flaky")
        # gone: a commit sha in the uri, so the headers are read at once: 404, permanent
        moed("gone", f"hf://org/gone@{SHA}")
        first = wait_for(inspected("flaky", "HubError"), 60, "flaky: CheckpointInspected=False HubError", op.log_tail)
        assert "503" in first["message"], first
        c = wait_for(inspected("gone", "NotFound"), 60, "gone: CheckpointInspected=False NotFound", op.log_tail)
        assert "404" in c["message"], c
        flaky0, gone0 = hub.asked("flaky"), hub.asked("gone")
        assert flaky0 and gone0
        t0 = flaky0[0]

        # within the hold: the sweep (every 2 s), a spec change and another object of the model get
        # the failure from memory, and the hub hears nothing
        moed("flaky-twin", "hf://org/flaky")
        for name in ("flaky", "gone"):
            kubectl("patch", "moed", name, "-n", ns, "--type", "merge", "-p", json.dumps({"spec": {"replicas": 2}}))
        wait_for(inspected("flaky-twin", "HubError"), 30, "flaky-twin: the held failure", op.log_tail)
        wait_for(inspected("flaky", "HubError", 2), 30, "flaky at generation 2: the held failure", op.log_tail)
        wait_for(inspected("gone", "NotFound", 2), 30, "gone at generation 2: the held failure", op.log_tail)
        assert hub.asked("flaky") == flaky0 and hub.asked("gone") == gone0, "the hub was asked during the hold"
        assert [len(events(n)) for n in ("flaky", "flaky-twin", "gone")] == [1, 1, 1]

        # past the retryable hold the hub is asked again, once; the same cause posts no new Event
        def asked_again():
            now = hub.asked("flaky")
            return now[len(flaky0):] or None
        again = wait_for(asked_again, RETRY_HOLD + 45, "the hub asked again after the retry delay", op.log_tail)
        held_s = again[0] - t0
        assert held_s >= RETRY_HOLD - 1, f"asked again after {held_s:.1f} s, inside the {RETRY_HOLD} s hold"
        time.sleep(3)  # the reconciles of that retry (and the twin's, answered from memory) finish
        assert len(hub.asked("flaky")) - len(flaky0) <= 2, hub.asked("flaky")  # one call (at most one reconcile's)
        c = condition(get_json(kubectl, "moed", "flaky", "-n", ns), "CheckpointInspected")
        assert (c["reason"], c["message"]) == ("HubError", first["message"])
        assert len(events("flaky")) == 1 and len(events("flaky-twin")) == 1, "an Event per retry of the same cause"

        # a new cause (the repo is gone now): one more Event, and the permanent hold from then on
        hub.set("flaky", 404)
        retried = len(hub.asked("flaky"))
        c = wait_for(inspected("flaky", "NotFound", 2), RETRY_HOLD + 45, "flaky: the new cause NotFound", op.log_tail)
        assert "404" in c["message"]
        wait_for(lambda: len(events("flaky")) == 2, 20, "a second Event for the new cause", op.log_tail)
        assert sorted(e["message"] == first["message"] for e in events("flaky")) == [False, True]
        o = get_json(kubectl, "moed", "flaky", "-n", ns)
        assert condition(o, "Stalled")["status"] == "True"  # a permanent cause: Stalled, retried every 300 s

        # gone was never asked again: its 404 is held 300 s, well past the 30 s a retryable failure gets
        elapsed = time.monotonic() - gone0[-1]
        assert elapsed > RETRY_HOLD + 10 and hub.asked("gone") == gone0, (elapsed, hub.asked("gone"))
        assert len(events("gone")) == 1
        time.sleep(4)
        assert len(hub.asked("flaky")) - retried <= 2  # the new 404 is held too
        print(f"hub asked again after {held_s:.1f} s; gone not asked for {elapsed:.0f} s")
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
