"""Two operators on one peering (the chart's replicas > 1) against the real API server: the
operator's own loops (resync sweep, work queue, token revocation) run only on the replica kopf
has not paused, and move to the other one when the leader goes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .operator_fixture import CHECKPOINTS, HOST_PATH_ARGS, ROOT, SAMPLES as DEMO, kubectl_json, wait_for
from .test_install import CHART, _exists, _helm, release  # noqa: F401 - release is a fixture

pytestmark = pytest.mark.integration

LEADING, STANDING_BY = "leading: the sweep", "standing by (kopf paused this replica)"


def _state(log: Path) -> str | None:
    """The replica's last leadership line: 'leading', 'standby' or None (never led)."""
    last = None
    for line in log.read_text(errors="replace").splitlines():
        if LEADING in line:
            last = "leading"
        elif STANDING_BY in line:
            last = "standby"
    return last


def _dump(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in logs)


def test_only_the_leader_runs_the_loops_and_the_other_takes_over(dev_cluster, kubectl, release, namespace, tmp_path):
    rel, ns = release
    _helm(dev_cluster, "install", rel, str(CHART), "-n", ns, "--create-namespace", "--set", "replicas=2",
          "--set", f"watchNamespaces={{{namespace}}}", "--take-ownership")
    kubectl("-n", ns, "scale", "deployment", f"{rel}-moe-operator", "--replicas=0")  # kwok pods only pretend
    peering = f"{rel}-moe-operator"
    assert _exists(kubectl, "-n", namespace, "kopfpeering", peering)
    env = {**os.environ, "MOE_RESYNC_SECONDS": "2", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("operator", "runtime", "kernels"))}
    cmd = [sys.executable, "-m", "moe_operator.cli", "run", "--kubeconfig", str(dev_cluster.kubeconfig),
           "--namespace", namespace, "--peering", peering, "--metrics-port", "0", "--liveness", "",
           "--local-models-dir", str(CHECKPOINTS), *HOST_PATH_ARGS]
    procs: dict[str, subprocess.Popen] = {}
    logs = {who: tmp_path / f"op-{who}.log" for who in ("a", "b")}
    try:
        for who in ("a", "b"):
            procs[who] = subprocess.Popen(cmd, stdout=open(logs[who], "w"), stderr=subprocess.STDOUT,
                                          env={**env, "POD_ID": f"op-{who}"}, cwd=ROOT)
            time.sleep(3)

        def one_leads():
            states = {w: _state(p) for w, p in logs.items()}
            return sorted(s or "none" for s in states.values()) in (["leading", "none"], ["leading", "standby"])

        try:
            wait_for(one_leads, 60, "exactly one of the two peered operators to lead")
            time.sleep(8)  # a few sweep and revocation intervals: still exactly one
            assert one_leads()
        except AssertionError as e:
            raise AssertionError(f"{e}\n{_dump(list(logs.values()))}") from None
        leader = next(w for w, p in logs.items() if _state(p) == "leading")
        other = "b" if leader == "a" else "a"
        print(f"leader op-{leader}; op-{other} stands by")

        # the leader goes (SIGTERM: kopf removes its peering entry on exit): the other takes over
        procs[leader].send_signal(signal.SIGTERM)
        procs[leader].wait(30)
        try:
            wait_for(lambda: _state(logs[other]) == "leading", 60, f"op-{other} to lead after op-{leader} left")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{_dump(list(logs.values()))}") from None

        # and it acts: it plans a new object
        kubectl("apply", "-n", namespace, "-f", str(DEMO / "gpt-oss-mxfp4-h100.yaml"))

        def planned():
            obj = kubectl_json(kubectl, "-n", namespace, "get", "moed", "gpt-oss-h100")
            return any(c["type"] == "Planned" and c["status"] == "True" for c in obj.get("status", {}).get("conditions", []))

        try:
            wait_for(planned, 45, f"op-{other} (now leading) to plan the sample")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{_dump(list(logs.values()))}") from None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
