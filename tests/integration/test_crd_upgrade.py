"""CRD upgrades through the chart (issue 26 item 4): a release installed with an older CRD (one
without status.planGeneration) prunes that field from what the operator writes; `helm upgrade` to
the current chart carries the CRD change, and the field is then kept and read back. The CRD stays
after `helm uninstall` (helm.sh/resource-policy keep)."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest
import yaml

from .operator_fixture import GOLDEN_SAMPLES, ROOT, kubectl_json, wait_for

pytestmark = pytest.mark.integration
CHART = ROOT / "charts" / "moe-operator"
CRD = "moedeployments.moe.serving.dev"
SETS = ("--set", "replicas=0", "--set", "webhook.enabled=false")  # the CRD is the subject, not the operator


def _older_chart(dst):
    """The chart as a release before status.planGeneration existed: its CRD without that field."""
    shutil.copytree(CHART, dst)
    f = dst / "files" / "moedeployments.crd.yaml"
    doc = yaml.safe_load(f.read_text())
    status = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    del status["planGeneration"]
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


def _status_fields(kubectl) -> set[str]:
    crd = kubectl_json(kubectl, "get", "crd", CRD)
    return set(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"])


def _write_and_read(kubectl, namespace: str, name: str, value: int):
    kubectl("-n", namespace, "patch", "moed", name, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": {"planGeneration": value}}))
    return kubectl_json(kubectl, "-n", namespace, "get", "moed", name).get("status", {}).get("planGeneration")


def test_helm_upgrade_carries_a_crd_change(dev_cluster, kubectl, crd, namespace, tmp_path):
    rel = f"crd-{uuid.uuid4().hex[:6]}"
    old = _older_chart(tmp_path / "moe-operator")

    def helm(*args):
        proc = dev_cluster.helm(*args, check=False, timeout=240)
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}{proc.stderr}"

    try:
        helm("install", rel, str(old), "-n", rel, "--create-namespace", "--take-ownership", *SETS, "--wait")
        assert "planGeneration" not in _status_fields(kubectl)
        sample = GOLDEN_SAMPLES / "qwen3-235b-fp8.yaml"
        kubectl("apply", "-n", namespace, "-f", str(sample))
        name = yaml.safe_load(sample.read_text())["metadata"]["name"]
        assert _write_and_read(kubectl, namespace, name, 7) is None  # pruned by the older schema, silently

        helm("upgrade", rel, str(CHART), "-n", rel, *SETS, "--wait")
        assert "planGeneration" in _status_fields(kubectl)
        meta = kubectl_json(kubectl, "get", "crd", CRD)["metadata"]
        assert meta["annotations"]["meta.helm.sh/release-name"] == rel
        assert meta["annotations"]["helm.sh/resource-policy"] == "keep"
        got = wait_for(lambda: _write_and_read(kubectl, namespace, name, 8) == 8, 30, "status.planGeneration kept")
        assert got

        helm("uninstall", rel, "-n", rel, "--wait")
        assert _write_and_read(kubectl, namespace, name, 9) == 9  # the CRD and the object outlive the release
    finally:
        dev_cluster.helm("uninstall", rel, "-n", rel, "--wait", check=False)
        kubectl("delete", "namespace", rel, "--wait=false", "--ignore-not-found", check=False)
        # the session's CRD, whatever happened above
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "moedeployments.yaml"))
