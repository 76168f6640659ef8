"""The model cache ledger (cache_ledger.py) through the real API server and real operator restarts.

The operator runs as the chart's ServiceAccount with the RBAC of a release that watches only the
test's namespace (watchNamespaces), so the ledger ConfigMap in the release namespace is reachable
only through the chart's cache-ledger Role; MOE_OPERATOR_NAMESPACE names that namespace, as the
chart's Deployment does. Across restarts (the process stopped, a new one started):
- a cache no MoEDeployment uses any more is reused by a new one without a second fill Job (the
  MoEDeployments' status no longer names it: only the ledger does);
- an unused cache is collected on the clock the previous process started, not a new one;
- a PVC or fill Job of the cache's names, labels and annotations that a tenant made is neither used
  nor deleted, before a restart or after.
The hub is the loopback one of test_model_cache (its fixture and helpers, not a copy)."""

from __future__ import annotations

import calendar
import json
import time
import uuid

import pytest

from moe_operator import cache_ledger, model_cache

from .operator_fixture import OperatorProcess, chart_service_account_kubeconfig, condition, forbidden_lines, get_json, \
    wait_for
from .test_model_cache import STORAGE_CLASS, hub, moed, static_pv, upload_sample  # noqa: F401  (hub: the fixture)

pytestmark = pytest.mark.integration
RELEASE, OP_NS = "moe-ledger", "moe-ledger-system"
LEDGER = f"{RELEASE}-moe-operator-model-caches"  # the chart's MOE_CACHE_LEDGER_NAME for this release
LONG_GRACE = 600  # no collection while a phase waits on something else
GRACE = 40  # the last operator's: the collection to time


@pytest.fixture(scope="module")
def watched(kubectl):
    """The one namespace the release watches (module-scoped: the RBAC names it)."""
    name = f"it-ledger-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operators(crd, dev_cluster, kubectl, tmp_path_factory, hub, watched):  # noqa: F811
    """start(grace) -> a running OperatorProcess with the ledger in OP_NS; each is stopped at the end,
    and none of their requests may have been refused by the chart's RBAC."""
    d = tmp_path_factory.mktemp("operator-ledger")
    kc = chart_service_account_kubeconfig(dev_cluster, kubectl, d / "sa.kubeconfig", release=RELEASE,
                                          namespace=OP_NS, sets=(f"watchNamespaces={{{watched}}}",))
    # the release's namespace is not watched: only the cache-ledger Role grants the ConfigMap there
    sa = f"system:serviceaccount:{OP_NS}:{RELEASE}-moe-operator"
    can = lambda *a: kubectl("auth", "can-i", *a, "--as", sa, check=False).stdout.strip()  # noqa: E731
    assert can("get", f"configmap/{LEDGER}", "-n", OP_NS) == "yes"
    assert can("patch", f"configmap/{LEDGER}", "-n", OP_NS) == "yes"
    assert can("get", "configmap/other", "-n", OP_NS) == "no"
    kubectl("-n", OP_NS, "delete", "configmap", LEDGER, "--ignore-not-found")
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(d / "hf-home"),
           "MOE_OPERATOR_NAMESPACE": OP_NS, "MOE_CACHE_LEDGER_NAME": LEDGER}
    started: list[OperatorProcess] = []

    def start(grace: float) -> OperatorProcess:
        op = OperatorProcess(str(kc), d / f"operator-{len(started)}.log", env=env,
                             extra=["--namespace", watched, "--model-cache-grace", str(grace)])
        op.start()
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
    for op in started:
        refused = forbidden_lines(op.log_path.read_text(errors="replace"))
        assert not refused, f"{op.log_path.name}: requests refused with the chart's RBAC:\n" + "\n".join(refused[:10])
        assert "cannot be read" not in op.log_path.read_text(errors="replace"), "the ledger fell back to memory"


def ledger(kubectl) -> dict:
    cm = get_json(kubectl, "configmap", LEDGER, "-n", OP_NS)
    return json.loads(cm["data"][cache_ledger.KEY]) if cm else {}


def cache_state(kubectl, ns, name, state):
    def check():
        mc = ((get_json(kubectl, "moed", name, "-n", ns) or {}).get("status") or {}).get("modelCache") or {}
        return mc if mc.get("state") == state else None
    return check


def pvc(name, ns, labels, annotations):
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": ns, "labels": labels, "annotations": annotations},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": STORAGE_CLASS,
                     "resources": {"requests": {"storage": "1Gi"}}}}


def apply(kubectl, doc):
    kubectl("apply", "-f", "-", input=json.dumps(doc))


def uid_of(kubectl, kind, name, ns):
    obj = get_json(kubectl, kind, name, "-n", ns)
    return obj["metadata"]["uid"] if obj and not obj["metadata"].get("deletionTimestamp") else None


def test_restarted_operators_reuse_and_collect_their_cache_and_never_a_tenants(hub, operators, kubectl, watched,  # noqa: F811
                                                                              tmp_path):
    ns = watched
    upload_sample(hub, tmp_path, "org/ledger", "deepseek-v3-nvfp4")
    poison_sha = upload_sample(hub, tmp_path, "org/poison", "deepseek-v3-nvfp4")
    job_sha = upload_sample(hub, tmp_path, "org/poisonjob", "deepseek-v3-nvfp4")
    static_pv(kubectl, f"{ns}-pv", tmp_path)

    # --- operator 1 makes the cache and fills it; its user goes ---------------------------------
    op = operators(LONG_GRACE)
    apply(kubectl, moed("alpha", ns, "hf://org/ledger"))
    mc = wait_for(cache_state(kubectl, ns, "alpha", "Ready"), 120, "alpha's cache Ready", op.log_tail)
    claim, claim_uid, job_uid = mc["claimName"], mc["claimUid"], mc["jobUid"]
    assert claim_uid == uid_of(kubectl, "pvc", claim, ns) and job_uid == uid_of(kubectl, "job", f"{claim}-fill", ns)
    rec = ledger(kubectl)
    assert rec["claims"] == {f"{ns}/{claim}": claim_uid} and rec["jobs"] == {claim_uid: job_uid}
    kubectl("delete", "moed", "alpha", "-n", ns)
    wait_for(lambda: claim_uid in ledger(kubectl).get("unusedSince", {}), 60, "the ledger's unused clock", op.log_tail)
    op.stop()

    # --- while no operator runs, a tenant who may edit PVCs and Jobs in the namespace pre-creates
    # the next caches' names, copying the labels and annotations of the operator's own objects
    real = get_json(kubectl, "pvc", claim, "-n", ns)["metadata"]
    real_job = get_json(kubectl, "job", f"{claim}-fill", "-n", ns)["metadata"]
    poison_claim = model_cache.claim_name("org/poison", poison_sha)
    ready = json.loads(real["annotations"][model_cache.A_READY])
    apply(kubectl, pvc(poison_claim, ns, real["labels"],
                       {**real["annotations"], model_cache.A_READY: json.dumps({**ready, "revision": poison_sha}),
                        model_cache.A_REVISION: poison_sha, model_cache.A_MODEL: "hf://org/poison"}))
    apply(kubectl, pvc("team-db", ns, {model_cache.CACHE_LABEL: "true"},
                       {model_cache.A_UNUSED: "2000-01-01T00:00:00Z"}))
    job_claim = model_cache.claim_name("org/poisonjob", job_sha)
    apply(kubectl, {"apiVersion": "batch/v1", "kind": "Job",
                    "metadata": {"name": f"{job_claim}-fill", "namespace": ns, "labels": real_job["labels"],
                                 "annotations": {model_cache.A_MODEL: "hf://org/poisonjob", model_cache.A_REVISION: job_sha}},
                    "spec": {"template": {"metadata": {"labels": {"moe.serving.dev/role": "model-cache"}},
                                          "spec": {"restartPolicy": "Never", "containers": [
                                              {"name": "download", "image": "busybox", "command": ["true"]}]}}}})
    tenant = {name: uid_of(kubectl, kind, name, ns) for kind, name in
              (("pvc", poison_claim), ("pvc", "team-db"), ("job", f"{job_claim}-fill"))}

    # --- operator 2 reuses the cache for a new user, without a second fill; refuses the tenant's
    op = operators(LONG_GRACE)
    apply(kubectl, moed("beta", ns, "hf://org/ledger"))
    mc = wait_for(cache_state(kubectl, ns, "beta", "Ready"), 90, "beta's cache Ready (the ledger's)", op.log_tail)
    assert (mc["claimName"], mc["claimUid"], mc["jobUid"]) == (claim, claim_uid, job_uid)
    jobs = get_json(kubectl, "jobs", "-n", ns, "-l", "moe.serving.dev/role=model-cache")["items"]
    assert sorted(j["metadata"]["name"] for j in jobs) == sorted([f"{claim}-fill", f"{job_claim}-fill"])  # not refilled
    assert uid_of(kubectl, "job", f"{claim}-fill", ns) == job_uid
    assert claim_uid not in ledger(kubectl).get("unusedSince", {})  # a user again: the clock stopped

    apply(kubectl, moed("poisoned", ns, f"hf://org/poison@{poison_sha}"))
    apply(kubectl, moed("poisonjob", ns, f"hf://org/poisonjob@{job_sha}"))
    bad = wait_for(cache_state(kubectl, ns, "poisoned", "Failed"), 60, "poisoned Failed", op.log_tail)
    assert f"PVC {poison_claim} exists but the operator did not make it" in bad["message"], bad
    bad = wait_for(cache_state(kubectl, ns, "poisonjob", "Failed"), 60, "poisonjob Failed", op.log_tail)
    assert f"Job {job_claim}-fill exists but the operator did not make it" in bad["message"], bad
    c = condition(get_json(kubectl, "moed", "poisoned", "-n", ns), "ModelCacheReady")
    assert c["status"] == "False"
    assert get_json(kubectl, "deployment", "poisoned", "-n", ns) is None  # the tenant's PVC is not mounted as the model
    own_job_claim_uid = uid_of(kubectl, "pvc", job_claim, ns)  # the operator made this PVC itself
    rec = ledger(kubectl)
    assert rec["claims"] == {f"{ns}/{claim}": claim_uid, f"{ns}/{job_claim}": own_job_claim_uid}, rec
    assert rec["jobs"] == {claim_uid: job_uid}  # the tenant's Job is in no record

    # --- every user goes; operator 2 starts the clock and stops; operator 3 collects on that clock
    for n in ("beta", "poisoned", "poisonjob"):
        kubectl("delete", "moed", n, "-n", ns)

    def clocks():
        since = ledger(kubectl).get("unusedSince", {})
        return since if {claim_uid, own_job_claim_uid} <= set(since) else None
    since = wait_for(clocks, 60, "the unused clocks of both caches", op.log_tail)
    op.stop()
    t0 = calendar.timegm(time.strptime(since[claim_uid], "%Y-%m-%dT%H:%M:%SZ"))
    time.sleep(max(0.0, t0 + GRACE / 2 - time.time()))  # half the grace period with no operator
    started = time.time()
    op = operators(GRACE)

    def collected():
        return uid_of(kubectl, "pvc", claim, ns) is None and uid_of(kubectl, "pvc", job_claim, ns) is None
    wait_for(collected, GRACE, "both caches collected", op.log_tail)
    done = time.time()
    # on the first clock (t0 + GRACE), not a clock started by operator 3 (started + GRACE)
    assert t0 + GRACE - 1 <= done < started + GRACE - 5, (t0, started, done)
    assert uid_of(kubectl, "job", f"{claim}-fill", ns) is None  # its own fill Job goes with it
    assert ledger(kubectl) == {"version": 1, "claims": {}, "jobs": {}, "unusedSince": {}, "inspectJobs": {}}

    # the tenant's objects: same UIDs, not deleted, not adopted, two resyncs past every grace period
    time.sleep(4)
    assert {name: uid_of(kubectl, kind, name, ns) for kind, name in
            (("pvc", poison_claim), ("pvc", "team-db"), ("job", f"{job_claim}-fill"))} == tenant
