"""The webhook's own certificate is renewed while the operator runs (issue 26 item 6), end to end:
with a 30 s lifetime the operator renews at 20 s, publishes old + new CA (here into kopf's managed
configuration), then serves the new certificate; the API server keeps calling the webhook (a
policy refusal still comes back: with failurePolicy Ignore a broken TLS would admit silently), and
/healthz reports the renewal and no Degraded admission."""

from __future__ import annotations

import base64
import json
import urllib.request

import pytest

from .operator_fixture import OperatorProcess, free_port, get_json, wait_for

pytestmark = pytest.mark.integration
MANAGED = "validate.moe.serving.dev"


def test_the_certificate_is_renewed_and_admission_still_judged(kubectl, kubeconfig, namespace, crd, tmp_path):
    port, health = free_port(), free_port()
    op = OperatorProcess(kubeconfig, tmp_path / "operator.log",
                         [f"--admission=127.0.0.1:{port}", f"--liveness=http://127.0.0.1:{health}/healthz"],
                         env={"MOE_WEBHOOK_CERT_SECONDS": "30", "MOE_WEBHOOK_PROPAGATION_SECONDS": "3",
                              "MOE_WEBHOOK_CHECK_SECONDS": "2"})
    doc = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "elsewhere"},
           "spec": {"model": {"uri": "file:///srv/not-allowed/model"}, "engine": {"name": "sglang"}}}

    def refused():
        r = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)
        return r.stderr if r.returncode != 0 and "is not under an allowed host path" in r.stderr else None

    def bundle() -> bytes:
        vwc = get_json(kubectl, "validatingwebhookconfiguration", MANAGED)
        return base64.b64decode(vwc["webhooks"][0]["clientConfig"]["caBundle"]) if vwc else b""

    def admission() -> dict:
        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=5).read())["admission"]

    op.start()
    try:
        wait_for(refused, 60, "the webhook to refuse a path outside the allowed host paths", op.log_tail)
        first = bundle()
        assert first.count(b"BEGIN CERTIFICATE") == 1
        renewed = wait_for(lambda: (a := admission())["renewals"] >= 1 and a, 60, "a renewal", op.log_tail)
        # the first certificate has under 10 s left past its renewal at 20 s (+3 s propagation): this is the new one
        assert renewed["degraded"] is False and renewed["certificateExpiresInSeconds"] > 10, renewed
        second = bundle()
        assert second.count(b"BEGIN CERTIFICATE") == 2 and second.startswith(first.strip())
        err = wait_for(refused, 20, "the webhook to judge with the renewed certificate", op.log_tail)
        assert "refused by the cluster's policy" in err
        assert "renewed" in op.log_path.read_text()
    finally:
        op.stop()
        kubectl("delete", "validatingwebhookconfiguration", MANAGED, "--ignore-not-found", check=False)
