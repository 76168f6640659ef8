"""Reads from watches (issue 34 item 1), against the real API server: a deleted owned object comes
back from a watch event within seconds (the full sweep is set far away, so only a watch can do it),
and an idle operator makes at most one request per owned object per minute."""

from __future__ import annotations

import os
import re
import time

import pytest

from .operator_fixture import OperatorProcess, condition, get_json, wait_for
from .test_operator import apply_sample, wait_planned

FULL_RESYNC = "900"  # far beyond the test: a repair within seconds can only come from a watch event


@pytest.fixture(scope="module")
def watching_operator(crd, kubeconfig, tmp_path_factory):
    """The operator with the admin kubeconfig: every owned kind can be watched (the chart's RBAC
    grants list/watch on them once the chart follows moe_operator.permissions)."""
    d = tmp_path_factory.mktemp("watching-operator")
    old = os.environ.get("MOE_FULL_RESYNC_SECONDS")
    os.environ["MOE_FULL_RESYNC_SECONDS"] = FULL_RESYNC
    op = OperatorProcess(kubeconfig, d / "operator.log")
    try:
        op.start()
    finally:
        if old is None:
            os.environ.pop("MOE_FULL_RESYNC_SECONDS", None)
        else:
            os.environ["MOE_FULL_RESYNC_SECONDS"] = old
    time.sleep(2)
    yield op
    op.stop()
    text = op.log_path.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert "not caching" not in text, "an owned kind was not watched:\n" + text[-3000:]


def _available(kubectl, ns, name):
    obj = get_json(kubectl, "moed", name, "-n", ns)
    c = condition(obj, "Available")
    return obj if c and c["status"] == "True" else None


def _back(kubectl, kind, name, ns, timeout):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if kubectl("get", kind, name, "-n", ns, check=False).returncode == 0:
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def test_a_deleted_owned_service_and_configmap_come_back_from_the_watch(kubectl, namespace, watching_operator):
    doc = apply_sample(kubectl, namespace, "qwen3-moe-fp8.yaml")
    name = doc["metadata"]["name"]
    wait_planned(kubectl, namespace, name, watching_operator)
    wait_for(lambda: _available(kubectl, namespace, name), 90, "Available", watching_operator.log_tail)
    time.sleep(3)  # past the sweep's first rounds
    kubectl("delete", "service", name, "-n", namespace, "--wait=false")
    took = _back(kubectl, "service", name, namespace, 30)
    assert took is not None and took < 5, f"Service back after {took}s\n{watching_operator.log_tail()}"
    kubectl("delete", "configmap", f"{name}-plan", "-n", namespace, "--wait=false")
    took = _back(kubectl, "configmap", f"{name}-plan", namespace, 30)
    assert took is not None and took < 5, f"ConfigMap back after {took}s\n{watching_operator.log_tail()}"
    # an edit of the owned workload is drift, repaired from its event
    kubectl("patch", "deployment", name, "-n", namespace, "--type=json",
            "-p", '[{"op":"add","path":"/spec/template/spec/hostNetwork","value":true}]')
    wait_for(lambda: not (get_json(kubectl, "deployment", name, "-n", namespace)["spec"]["template"]["spec"]
                          .get("hostNetwork")), 10, "hostNetwork taken out again", watching_operator.log_tail)


def _owned_requests(kubectl) -> dict[str, float]:
    """Requests other than LIST/WATCH on the kinds the operator owns or reads, every client
    (apiserver_request_total), by verb and resource."""
    total: dict[str, float] = {}
    kinds = ("moedeployments", "deployments", "services", "configmaps", "leaderworkersets", "jobs",
             "persistentvolumeclaims")
    for line in kubectl("get", "--raw", "/metrics").stdout.splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            if labels.get("resource") in kinds and labels.get("verb") not in ("LIST", "WATCH"):
                k = f"{labels['verb']} {labels['resource']}/{labels.get('subresource', '')}"
                total[k] = total.get(k, 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def test_an_idle_operator_reads_nothing_per_object(kubectl, namespace, watching_operator):
    names = []
    for sample in ("qwen3-moe-fp8.yaml", "gpt-oss-mxfp4-h100.yaml", "explicit-backend-override.yaml"):
        names.append(apply_sample(kubectl, namespace, sample)["metadata"]["name"])
    for name in names:
        wait_for(lambda: _available(kubectl, namespace, name), 120, f"{name} Available", watching_operator.log_tail)
    # the last status writes and readiness events settle, and the one GET of each new object that
    # the operator process makes about 30 s after its creation (not through its Kubernetes client:
    # kopf's) is past
    time.sleep(40)
    objects = len(get_json(kubectl, "moed", "-A")["items"])
    window = 30.0
    before = _owned_requests(kubectl)
    time.sleep(window)
    after = _owned_requests(kubectl)
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
    per_object_minute = sum(moved.values()) * 60 / window / objects
    # the sweep runs every 2 s here (MOE_RESYNC_SECONDS=2): a GET per owned object per sweep was
    # 4 kinds x 30 = 120 per object per minute
    assert per_object_minute <= 1.0, f"{moved} in {window:.0f}s for {objects} objects"
