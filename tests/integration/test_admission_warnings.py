"""Admission warnings through the real API server: `kubectl apply` prints where `auto` falls back (issue 16 item 3)."""

from __future__ import annotations

import json

import pytest
import yaml

from .operator_fixture import SAMPLES, get_json, wait_for

pytestmark = pytest.mark.integration


def test_kubectl_apply_prints_where_auto_falls_back(kubectl, kubeconfig, namespace, crd, tmp_path):
    """kopf returns the webhook's `warnings`; the API server passes them on and kubectl prints them
    ("Warning: ..."). The object is admitted: a warning is advice, never a refusal."""
    from .operator_fixture import start_webhook_operator

    op, _ = start_webhook_operator(kubeconfig, tmp_path / "admission.log")
    try:
        wait_for(lambda: get_json(kubectl, "validatingwebhookconfiguration", "validate.moe.serving.dev"), 30,
                 "managed ValidatingWebhookConfiguration", op.log_tail)
        # DeepSeek-V3 NVFP4 may land on Hopper: no FP4 tensor cores, sglang runs the experts W4A16 on Marlin (S6)
        doc = yaml.safe_load((SAMPLES / "deepseek-v3-nvfp4-b200.yaml").read_text())
        doc["metadata"] = {"name": "warned", "namespace": namespace}
        doc["spec"]["gpu"] = {"allowedArchitectures": ["sm90", "sm100"]}

        def warned():
            r = kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
            assert r.returncode == 0, r.stderr
            return r.stderr if "Warning:" in r.stderr else None
        err = wait_for(warned, 30, "an admission warning", op.log_tail)
        lines = [line for line in err.splitlines() if line.startswith("Warning:")]
        assert any("auto on sm90/" in line and "falls back: [S6] moe.runnerBackend=marlin" in line for line in lines), err
        assert not any("sm100/" in line for line in lines), err  # B200 gets the preferred path
        assert get_json(kubectl, "moed", "warned", "-n", namespace)  # admitted

        # DeepSeek-V4 FP4 allowed on Ampere only: auto has no runner sglang accepts there (S2b); the
        # object is admitted (auto is never refused at admission) and the warning says it will not be placed
        doc4 = yaml.safe_load((SAMPLES / "deepseek-v4-fp4-h200.yaml").read_text())
        doc4["metadata"] = {"name": "unplaced", "namespace": namespace}
        doc4["spec"]["gpu"] = {"allowedArchitectures": ["sm80"]}
        r = kubectl("apply", "-f", "-", input=json.dumps(doc4), check=False)
        assert r.returncode == 0, r.stderr
        assert "Warning: cannot run on sm80/" in r.stderr and "[S2b]" in r.stderr, r.stderr
        assert "it will not be placed" in r.stderr, r.stderr

        # nothing falls back: no warning
        doc["metadata"]["name"] = "quiet"
        doc["spec"]["gpu"] = {"allowedArchitectures": ["sm100"]}
        r = kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
        assert r.returncode == 0 and "Warning:" not in r.stderr, r.stderr
    finally:
        op.stop()
        # The managed webhook outlives the process; with no server behind it, it must go.
        kubectl("delete", "validatingwebhookconfiguration", "validate.moe.serving.dev", "--ignore-not-found")
