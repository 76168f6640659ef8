"""Model cache and pinned revisions through the real API server: the operator (as the chart's
ServiceAccount, HF_ENDPOINT at a local hub server) pins hf:// to a commit, creates one PVC per
(model, revision) filled by one download Job, renders the pods of two MoEDeployments with it mounted
read-only behind the ready check, and deletes the cache after its last user is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_core.checkpoint import read_safetensors_header
from moe_operator import model_cache
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
    # kwok ran no container: the Job as the API server stores it runs here, into the PV's directory
    # (HF_ENDPOINT from the operator's own, in the Job's env), and the pods' init check accepts it
    assert {"name": "HF_ENDPOINT", "value": hub.url} in c["env"]
    pv_dir = tmp_path / f"{namespace}-pv"
    assert run_here(c, {"model-cache": pv_dir, "tmp": tmp_path}, tmp_path).returncode == 0
    assert json.loads((pv_dir / ".moe-ready").read_text())["revision"] == sha
    assert [p for m, p, _ in hub.requests if m == "GET" and p.endswith(".safetensors") and "resolve" in p]

    for n in ("alpha", "beta"):
        dep = wait_for(lambda: get_json(kubectl, "deployment", n, "-n", namespace), 60, f"Deployment {n}",
                       hub_operator.log_tail)
        pod = dep["spec"]["template"]["spec"]
        vol = next(v for v in pod["volumes"] if v.get("persistentVolumeClaim"))
        assert vol["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        init = next(i for i in pod["initContainers"] if i["name"] == "model-cache-ready")
        assert sha in init["command"][3:] and any(a.endswith("/.moe-ready") for a in init["command"][3:])
        assert run_here(init, {"model-cache": pv_dir}, tmp_path).returncode == 0
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


def test_a_pvc_the_operator_did_not_make_is_neither_adopted_nor_collected(hub, hub_operator, kubectl, namespace,
                                                                          tmp_path):
    """A tenant who may edit PVCs pre-creates the cache's predictable name with a ready annotation,
    and labels another PVC as an old unused cache: the first is not mounted as the model (Failed,
    no Job, no workload), the second is not deleted."""
    sha = upload_sample(hub, tmp_path, "org/poison", "deepseek-v3-nvfp4")
    claim = model_cache.claim_name("org/poison", sha)

    def pvc(name, labels, annotations):
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
                "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": STORAGE_CLASS,
                         "resources": {"requests": {"storage": "1Gi"}}}}
    cache = {model_cache.CACHE_LABEL: "true"}
    kubectl("apply", "-f", "-", input=json.dumps(pvc(claim, cache, {model_cache.A_READY: json.dumps({"revision": sha})})))
    kubectl("apply", "-f", "-", input=json.dumps(pvc("team-db", cache, {model_cache.A_UNUSED: "2000-01-01T00:00:00Z"})))
    kubectl("apply", "-f", "-", input=json.dumps(moed("poisoned", namespace, f"hf://org/poison@{sha}")))

    def failed():
        c = condition(get_json(kubectl, "moed", "poisoned", "-n", namespace), "ModelCacheReady")
        return c if c and c["reason"] == "Failed" else None
    c = wait_for(failed, 60, "ModelCacheReady Failed", hub_operator.log_tail)
    assert c["status"] == "False" and "the operator did not make it" in c["message"]
    assert get_json(kubectl, "job", f"{claim}-fill", "-n", namespace) is None
    assert get_json(kubectl, "deployment", "poisoned", "-n", namespace) is None
    time.sleep(GRACE + 4)  # two resyncs past the grace period
    db = get_json(kubectl, "pvc", "team-db", "-n", namespace)
    assert db is not None and not db["metadata"].get("deletionTimestamp"), "a PVC the operator did not make was deleted"


def run_here(container: dict, dirs: dict, tmp: Path) -> subprocess.CompletedProcess:
    """A container of an object the API server stores, run on this machine as rendered, its volumes'
    mountPaths mapped to local directories (model_cache.local_invocation)."""
    argv, env = model_cache.local_invocation(container, {k: str(v) for k, v in dirs.items()},
                                             executables={"moe-operator": str(Path(sys.executable).parent / "moe-operator")})
    argv = [str(tmp / "termination-log") if a == "/dev/termination-log" else a for a in argv]
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    r = subprocess.run(argv, env={**base, **env}, capture_output=True, text=True, timeout=120)
    return r


def test_a_pvc_model_is_copied_to_a_faster_class_when_asked(hub_operator, kubectl, namespace, tmp_path):
    """pvc:// with model.cache.enabled: a cache PVC of the asked class, a copy Job mounting the source
    claim read-only, pods mounting the copy (not the source) once it is Ready; the stored Job's
    container, run here on the two PVs' directories, copies what engines read."""
    src_dir = tmp_path / "source"
    write_sample("deepseek-v3-nvfp4", src_dir / "dsv3")
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"models-{namespace}"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                   "hostPath": {"path": str(src_dir)}, "claimRef": {"namespace": namespace, "name": "models"}}}
    src = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": namespace},
           "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": f"models-{namespace}",
                    "resources": {"requests": {"storage": "1Gi"}}}}
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, src]}))
    static_pv(kubectl, f"{namespace}-fast", tmp_path)
    doc = moed("copied", namespace, "pvc://models/dsv3")
    doc["spec"]["model"].update(format="nvfp4", architecture="DeepseekV3ForCausalLM")  # kwok runs no inspection Job
    doc["spec"]["parallelism"] = {"tp": 8}
    kubectl("apply", "-f", "-", input=json.dumps(doc))

    def ready():
        obj = get_json(kubectl, "moed", "copied", "-n", namespace)
        c = condition(obj, "ModelCacheReady")
        return obj if c and c["status"] == "True" else None
    obj = wait_for(ready, 120, "ModelCacheReady of the copy", hub_operator.log_tail)
    claim = obj["status"]["modelCache"]["claimName"]
    assert "copied from pvc://models/dsv3" in condition(obj, "ModelCacheReady")["message"]
    pvc = get_json(kubectl, "pvc", claim, "-n", namespace)
    assert pvc["spec"]["storageClassName"] == STORAGE_CLASS
    assert pvc["metadata"]["annotations"]["moe.serving.dev/model"] == "pvc://models/dsv3"
    job = get_json(kubectl, "job", f"{claim}-fill", "-n", namespace)
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"][:4] == ["moe-operator", "download-model", "--from", "/models/source/dsv3"]
    assert {"name": "model-source", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    fast_dir = tmp_path / f"{namespace}-fast"
    assert run_here(c, {"model-cache": fast_dir, "model-source": src_dir, "tmp": tmp_path}, tmp_path).returncode == 0
    for p in (src_dir / "dsv3").iterdir():
        assert (fast_dir / p.name).read_bytes() == p.read_bytes()

    dep = wait_for(lambda: get_json(kubectl, "deployment", "copied", "-n", namespace), 60, "Deployment copied",
                   hub_operator.log_tail)
    pod = dep["spec"]["template"]["spec"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v.get("persistentVolumeClaim")]
    assert claims == [claim]  # the copy, not the source
    eng = pod["containers"][0]
    assert eng["args"][eng["args"].index("--model-path") + 1] == "/models/cache"
    assert eng["args"][eng["args"].index("--served-model-name") + 1] == "copied"  # spec.model.servedName: the object's name
    init = next(i for i in pod["initContainers"] if i["name"] == "model-cache-ready")
    assert run_here(init, {"model-cache": fast_dir}, tmp_path).returncode == 0


def _ranged(hub, path):
    return any(p == path and r for _, p, r in hub.requests)


def test_a_corrupted_file_fails_the_fill_job_at_once_through_its_pod_failure_policy(hub, hub_operator, kubectl,
                                                                                     namespace, tmp_path):
    """The stored fill Job's container, run here against a hub serving a corrupted tokenizer.json,
    exits EXIT_CHECKSUM; its pod (kept unscheduled: the cache PVC has no volume to bind, so kwok never
    completes it) is marked Failed with that exit code and termination message, as a kubelet would;
    the real Job controller applies the Job's podFailurePolicy: Failed (reason PodFailurePolicy) after
    one pod, no retry; the MoEDeployment's cache status names the file and says it was not retried."""
    from moe_operator.download_cli import EXIT_CHECKSUM

    sha = upload_sample(hub, tmp_path, "org/corrupt", "deepseek-v3-nvfp4")
    files = dict(hub.repos["org/corrupt"].commits[sha], **{"tokenizer.json": b'{"version": "1.0", "model": {}}'})
    sha = hub.upload("org/corrupt", files)
    hub.corrupt("org/corrupt", sha, "tokenizer.json")
    kubectl("apply", "-f", "-", input=json.dumps(moed("corrupt", namespace, f"hf://org/corrupt@{sha}")))
    job = wait_for(lambda: (get_json(kubectl, "jobs", "-n", namespace, "-l", "moe.serving.dev/role=model-cache")
                            or {}).get("items", [None])[0], 60, "fill Job", hub_operator.log_tail)
    name = job["metadata"]["name"]
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["podFailurePolicy"]["rules"][0]["action"] == "FailJob"
    c = spec["template"]["spec"]["containers"][0]
    r = run_here(c, {"model-cache": tmp_path / "cache", "tmp": tmp_path}, tmp_path)
    assert r.returncode == EXIT_CHECKSUM, r.stdout + r.stderr
    message = (tmp_path / "termination-log").read_text()
    pod = wait_for(lambda: (get_json(kubectl, "pods", "-n", namespace, "-l", f"job-name={name}") or {})
                   .get("items", [None])[0], 60, "fill Job pod", hub_operator.log_tail)
    assert not pod["spec"].get("nodeName")  # unscheduled: kwok leaves it to us
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {"status": {"phase": "Failed", "containerStatuses": [{
        "name": "download", "image": c["image"], "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": r.returncode, "reason": "Error", "message": message,
                                 "startedAt": now, "finishedAt": now}}}]}}
    kubectl("patch", "pod", pod["metadata"]["name"], "-n", namespace, "--subresource=status", "--type=merge",
            "-p", json.dumps(status))

    def failed():
        j = get_json(kubectl, "job", name, "-n", namespace)
        c = condition(j, "Failed")
        return j if c and c["status"] == "True" else None
    j = wait_for(failed, 60, "Job Failed by its podFailurePolicy", hub_operator.log_tail)
    assert condition(j, "Failed")["reason"] == "PodFailurePolicy", condition(j, "Failed")
    assert j["status"].get("failed") == 1
    assert len(get_json(kubectl, "pods", "-n", namespace, "-l", f"job-name={name}")["items"]) == 1  # no retry pod

    def cache_failed():
        o = get_json(kubectl, "moed", "corrupt", "-n", namespace)
        mc = ((o or {}).get("status") or {}).get("modelCache") or {}
        return mc if mc.get("state") == "Failed" else None
    mc = wait_for(cache_failed, 60, "status.modelCache Failed", hub_operator.log_tail)
    assert "tokenizer.json" in mc["message"] and "ChecksumMismatch" in mc["message"]
    assert "a permanent error, the Job failed without retrying" in mc["message"] and f"delete Job {name}" in mc["message"]
