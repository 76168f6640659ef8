"""The golden path (issue 26 item 3): `helm install` with the chart's defaults, then `kubectl apply`
of every sample in deploy/samples/ is admitted by the operator's validating webhook; a file://
demo sample is refused by the same webhook (the default policy allows no host path), which shows
that admission was really judged.

The chart's operator pod only pretends to run on the simulated nodes (kwok), so the same operator
runs here with the flags the chart rendered into its Deployment, as the release's ServiceAccount
(its RBAC only), and the chart's own ValidatingWebhookConfiguration is pointed at it by URL (its
rules, failurePolicy and timeout are the chart's; the operator writes its CA into it, as in a pod).
"""

from __future__ import annotations

import json
import urllib.request
import uuid

import pytest
import yaml

from .operator_fixture import (GOLDEN_SAMPLES, ROOT, SAMPLES as DEMO, OperatorProcess, free_port, kubectl_json,
                               token_kubeconfig, wait_for)

pytestmark = pytest.mark.integration
CHART = ROOT / "charts" / "moe-operator"
GOLDEN = sorted(GOLDEN_SAMPLES.glob("*.yaml"))
# flags of the chart's Deployment that describe where it runs, not what it allows: set here instead
LOCAL = ("--standalone", "--peering", "--metrics-port", "--liveness", "--admission")


@pytest.fixture
def default_install(dev_cluster, kubectl, crd, tmp_path):
    """The chart installed with its defaults (--take-ownership only because the session applied the
    CRD with kubectl), and the operator it describes running here; yields (operator, health URL)."""
    rel = f"gp-{uuid.uuid4().hex[:6]}"
    proc = dev_cluster.helm("install", rel, str(CHART), "-n", rel, "--create-namespace", "--take-ownership",
                            check=False, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    op = None
    try:
        dep = kubectl_json(kubectl, "-n", rel, "get", "deployment", f"{rel}-moe-operator")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        vwc = next(a.split("=", 1)[1] for a in args if a.startswith("--admission-configuration="))
        port, health = free_port(), free_port()
        kubectl("patch", "validatingwebhookconfiguration", vwc, "--type=json", "-p", json.dumps([
            {"op": "replace", "path": "/webhooks/0/clientConfig",
             "value": {"url": f"https://127.0.0.1:{port}/explicit-backend-possible"}}]))
        assert args[0] == "run", args
        flags = [a for a in args[1:] if not a.startswith(LOCAL)] + [
            f"--admission=127.0.0.1:{port}", f"--admission-configuration={vwc}",
            f"--liveness=http://127.0.0.1:{health}/healthz"]
        kc = token_kubeconfig(dev_cluster, kubectl, rel, f"{rel}-moe-operator", tmp_path / "sa.kubeconfig")
        op = OperatorProcess(str(kc), tmp_path / "operator.log", flags, demo_models=False)
        op.start()
        yield op, f"http://127.0.0.1:{health}/healthz"
    finally:
        if op:
            op.stop()
        dev_cluster.helm("uninstall", rel, "-n", rel, "--wait", check=False)
        kubectl("delete", "namespace", rel, "--wait=false", "--ignore-not-found", check=False)


def test_every_sample_is_admitted_by_the_default_install(kubectl, namespace, default_install):
    op, healthz = default_install
    demo = DEMO / "deepseek-v4-fp4-h200.yaml"

    def refused():  # the webhook is up once it judges (a dry run: nothing is created)
        r = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(demo), check=False)
        return r.stderr if r.returncode != 0 and "denied the request" in r.stderr else None

    err = wait_for(refused, 60, "the webhook to refuse a file:// demo sample", op.log_tail)
    assert "host paths are not allowed on this cluster" in err and "use pvc:// or hf://" in err

    assert len(GOLDEN) >= 6
    for sample in GOLDEN:
        r = kubectl("apply", "-n", namespace, "-f", str(sample), check=False)
        assert r.returncode == 0 and "denied" not in r.stderr, f"{sample.name}: {r.stdout}{r.stderr}\n{op.log_tail()}"
        name = yaml.safe_load(sample.read_text())["metadata"]["name"]
        obj = kubectl_json(kubectl, "-n", namespace, "get", "moed", name)
        assert obj["spec"]["model"]["uri"] == yaml.safe_load(sample.read_text())["spec"]["model"]["uri"]

    # the operator's own view of its admission endpoint (/healthz detail, issue 26 item 6)
    body = wait_for(lambda: json.loads(urllib.request.urlopen(healthz, timeout=5).read()), 30, "/healthz", op.log_tail)
    assert body["admission"]["enabled"] is True and body["admission"]["degraded"] is False, body
    assert body["admission"]["certificateExpiresInSeconds"] > 80 * 86400, body
