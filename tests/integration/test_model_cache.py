"""Model cache and pinned revisions through the real API server: the operator (as the chart's
ServiceAccount, HF_ENDPOINT at a local hub server) pins hf:// to a commit, creates one PVC per
(model, revision) filled by one download Job, renders the pods of two MoEDeployments with it mounted
read-only behind the ready check, and deletes the cache after its last user is gone."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from moe_core.checkpoint import read_safetensors_header
from moe_operator.sample_checkpoints import write_sample

from .operator_fixture import OperatorProcess, chart_service_account_kubeconfig, condition, forbidden_lines, get_json, \
    wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hub_server import Hub  # noqa: E402

pytestmark = pytest.mark.integration
STORAGE_CLASS = "moe-it-cache"
GRACE = 4


@pytest.fixture(scope="module")
def hub():
    h = Hub()
    h.start()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def hub_operator(crd, dev_cluster, kubectl, tmp_path_factory, hub):
    d = tmp_path_factory.mktemp("operator-cache")
    kc = chart_service_account_kubeconfig(dev_cluster, kubectl, d / "sa.kubeconfig")
    saved = {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_HOME")}
    os.environ.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HOME=str(d / "hf-home"))
    op = OperatorProcess(str(kc), d / "operator.log", extra=["--model-cache-grace", str(GRACE)])
    try:
        op.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    time.sleep(2)
    yield op
    op.stop()
    refused = forbidden_lines(op.log_path.read_text(errors="replace"))
    assert not refused, "requests refused with the chart's RBAC:\n" + "\n".join(refused[:10])


def upload_sample(hub, tmp: Path, repo: str, sample: str) -> str:
    d = write_sample(sample, tmp / sample)
    files = {p.name: p.read_bytes() for p in d.iterdir()}
    st = next(p for p in d.iterdir() if p.suffix == ".safetensors")
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {t.name: st.name for t in read_safetensors_header(st)}}).encode()
    return hub.upload(repo, files)


def moed(name: str, ns: str, uri: str) -> dict:
    return {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"uri": uri, "cache": {"enabled": True, "storageClassName": STORAGE_CLASS}},
                     "engine": {"name": "sglang"}, "gpu": {"product": "NVIDIA-H200"}}}


def static_pv(kubectl, name: str, tmp: Path) -> None:
    """Local storage for the claim to bind to (no provisioner runs in the test cluster)."""
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
          "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": STORAGE_CLASS,
                   "persistentVolumeReclaimPolicy": "Delete", "hostPath": {"path": str(tmp / name)}}}
    kubectl("apply", "-f", "-", input=json.dumps(pv))


def test_two_deployments_share_one_cache_filled_once_then_it_goes(hub, hub_operator, kubectl, namespace, tmp_path):
    sha = upload_sample(hub, tmp_path, "org/dsv3", "deepseek-v3-nvfp4")
    static_pv(kubectl, f"{namespace}-pv", tmp_path)
    for n in ("alpha", "beta"):
        kubectl("apply", "-f", "-", input=json.dumps(moed(n, namespace, "hf://org/dsv3")))

    def ready(name):
        def check():
            obj = get_json(kubectl, "moed", name, "-n", namespace)
            c = condition(obj, "ModelCacheReady")
            return obj if c and c["status"] == "True" else None
        return check

    objs = [wait_for(ready(n), 120, f"{n} ModelCacheReady", hub_operator.log_tail) for n in ("alpha", "beta")]
    claims = {o["status"]["modelCache"]["claimName"] for o in objs}
    assert len(claims) == 1, claims
    claim = claims.pop()
    for o in objs:
        assert o["status"]["revision"] == sha and o["status"]["revisionUri"] == "hf://org/dsv3"
        assert o["status"]["modelCache"]["state"] == "Ready"
        assert o["status"]["modelCache"]["bytesTotal"] == o["status"]["checkpoint"]["totalBytes"] > 0
        assert "bytes" in condition(o, "ModelCacheReady")["message"]

    pvcs = get_json(kubectl, "pvc", "-n", namespace, "-l", "moe.serving.dev/model-cache=true")["items"]
    assert [p["metadata"]["name"] for p in pvcs] == [claim]
    pvc = pvcs[0]
    assert pvc["metadata"]["annotations"]["moe.serving.dev/revision"] == sha
    assert {"user.moe.serving.dev/alpha", "user.moe.serving.dev/beta"} <= set(pvc["metadata"]["labels"])
    assert json.loads(pvc["metadata"]["annotations"]["moe.serving.dev/cache-ready"])["revision"] == sha
    jobs = get_json(kubectl, "jobs", "-n", namespace, "-l", "moe.serving.dev/role=model-cache")["items"]
    assert len(jobs) == 1, [j["metadata"]["name"] for j in jobs]  # filled once, for both
    job_pod = jobs[0]["spec"]["template"]["spec"]
    c = job_pod["containers"][0]
    assert c["command"][:2] == ["moe-operator", "download-model"] and sha in c["command"]
    assert job_pod["automountServiceAccountToken"] is False and c["securityContext"]["allowPrivilegeEscalation"] is False
    # the hub was asked for the revision and headers, never for the weights (the Job downloads them)
    assert not [p for m, p, _ in hub.requests if m == "GET" and p.endswith(".safetensors") and "resolve" in p
                and not _ranged(hub, p)]

    for n in ("alpha", "beta"):
        dep = wait_for(lambda: get_json(kubectl, "deployment", n, "-n", namespace), 60, f"Deployment {n}",
                       hub_operator.log_tail)
        pod = dep["spec"]["template"]["spec"]
        vol = next(v for v in pod["volumes"] if v.get("persistentVolumeClaim"))
        assert vol["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        init = next(i for i in pod["initContainers"] if i["name"] == "model-cache-ready")
        assert sha in init["command"][-1] and ".moe-ready" in init["command"][-1]
        eng = pod["containers"][0]
        assert eng["args"][eng["args"].index("--model-path") + 1] == "/models/cache"
        assert {"name": "HF_REVISION", "value": sha} in eng["env"]
        assert any(m["mountPath"] == "/models/cache" and m["readOnly"] for m in eng["volumeMounts"])

    out = kubectl("get", "moed", "-n", namespace).stdout
    assert "CACHE" in out and "Ready" in out
    wide = kubectl("get", "moed", "-n", namespace, "-o", "wide").stdout
    assert sha in wide

    # a new upload changes nothing for the pinned deployments
    upload_sample(hub, tmp_path, "org/dsv3", "deepseek-v3-fp8")
    time.sleep(5)  # two resync ticks
    assert get_json(kubectl, "moed", "alpha", "-n", namespace)["status"]["revision"] == sha

    # the last user goes: the cache stays for the grace period, then is deleted
    kubectl("delete", "moed", "alpha", "-n", namespace)
    time.sleep(3)
    assert get_json(kubectl, "pvc", claim, "-n", namespace) is not None  # beta still uses it
    kubectl("delete", "moed", "beta", "-n", namespace)
    unused = wait_for(lambda: (get_json(kubectl, "pvc", claim, "-n", namespace) or {}).get("metadata", {})
                      .get("annotations", {}).get("moe.serving.dev/unused-since"), 30, "unused-since",
                      hub_operator.log_tail)
    assert unused
    wait_for(lambda: get_json(kubectl, "pvc", claim, "-n", namespace) is None
             or get_json(kubectl, "pvc", claim, "-n", namespace)["metadata"].get("deletionTimestamp"),
             30 + GRACE, "cache PVC deleted", hub_operator.log_tail)


def _ranged(hub, path):
    return any(p == path and r for _, p, r in hub.requests)
