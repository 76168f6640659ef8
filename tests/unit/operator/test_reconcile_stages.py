"""reconcile as its stages (issue 33 item 5): policy -> checkpoint -> placement -> cache -> apply ->
ready, each returning its value or the early Outcome. The scenarios below drive `reconcile()` through
every early exit and the whole path against an in-memory Kube; `outcomes()` is what was compared
with the one-function reconcile before the split (same statuses, events, retries, applied objects)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import yaml
from kubernetes.client.rest import ApiException

from moe_operator import model_cache
from moe_operator.api import ModelCacheStatus
from moe_operator.kube import ApplyError
from moe_operator.policy import TOKEN_SECRET_LABEL, Policy
from moe_operator.reconcile import Config, Outcome, reconcile
from moe_operator.sample_checkpoints import write_sample
from test_render_placement import build, classes, node, node_info

SAMPLE = "deploy/samples/demo/qwen3-moe-fp8.yaml"


class MemKube:
    """Applied objects by (kind, name); a workload's status is set by the test (no controllers)."""

    def __init__(self, secrets=None, fail_kind=None):
        self.objs: dict[tuple[str, str], dict] = {}
        self.secrets = secrets or {}
        self.fail_kind = fail_kind
        self.log: list[str] = []
        self.core = SimpleNamespace(read_namespaced_service=self._service)

    def _service(self, name, ns):
        raise ApiException(status=404)

    def get(self, kind, ns, name, cached=True):
        if kind == self.fail_kind:
            raise ApplyError(f"{kind}Missing", f"no {kind} CRD")
        o = self.objs.get((kind, name))
        return copy.deepcopy(o) if o is not None else None

    def apply(self, obj):
        self.log.append(f"apply {obj['kind']}/{obj['metadata']['name']}")
        o = copy.deepcopy(obj)
        o["metadata"].setdefault("uid", "uid-" + obj["metadata"]["name"])
        self.objs[(obj["kind"], obj["metadata"]["name"])] = o
        return copy.deepcopy(o)

    def merge_patch(self, obj):
        self.log.append(f"patch {obj['kind']}/{obj['metadata']['name']}")

    def delete(self, kind, ns, name):
        self.log.append(f"delete {kind}/{name}")
        self.objs.pop((kind, name), None)

    def secret_labels(self, ns, name):
        return self.secrets.get(name)

    def read_secret_key(self, ns, name, key):
        return None

    def pvc_uid(self, ns, claim):
        return None


def _body(uri, gen=1, status=None, **spec):
    doc = yaml.safe_load(open(SAMPLE))
    doc["spec"]["model"]["uri"] = uri
    doc["spec"].update(spec)
    return {"metadata": {"namespace": "ns", "name": "m", "uid": "u", "generation": gen}, "spec": doc["spec"],
            "status": status or {}}


def _clean(v):
    """An outcome without the clock (lastTransitionTime)."""
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items() if k != "lastTransitionTime"}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def _show(out: Outcome, kube: MemKube | None = None) -> dict:
    return _clean({"status": out.status, "events": [list(e) for e in out.events], "retry": out.retry_after,
                   "kube": kube.log if kube else None})


def outcomes(tmp_path, monkeypatch) -> dict[str, dict]:
    d = write_sample("qwen3-moe-235b-fp8", tmp_path / "qwen3")
    cfg = Config(inspect_in_cluster=False, policy=Policy(allowed_host_paths=(str(tmp_path),)))
    uri = f"file://{d}"
    got = {}
    got["invalid_spec"] = _show(reconcile({"metadata": {"namespace": "ns", "name": "m", "uid": "u", "generation": 1},
                                           "spec": {"model": {}}}, classes(), MemKube(), cfg))
    got["policy"] = _show(reconcile(_body("file:///elsewhere/x"), classes(), MemKube(), cfg))
    tok = {"tokenSecretRef": {"name": "hf", "key": "token"}}
    b = _body(uri)
    b["spec"]["model"].update(tok)
    got["token_unlabelled"] = _show(reconcile(b, classes(), MemKube(secrets={"hf": {}}), cfg))
    got["token_missing"] = _show(reconcile(b, classes(), MemKube(), cfg))
    got["not_inspected"] = _show(reconcile(_body(f"file://{tmp_path}/missing"), classes(), MemKube(), cfg))
    got["no_class"] = _show(reconcile(_body(uri), {}, MemKube(), cfg))
    got["crd_missing"] = _show(reconcile(_body(uri, nodesPerReplica=2), classes(), MemKube(fail_kind="LeaderWorkerSet"), cfg))

    # the whole path: apply, then ready once the workload reports its replicas; then no change at all
    kube = MemKube()
    first = reconcile(_body(uri), classes(), kube, cfg)
    got["applied"] = _show(first, kube)
    w = kube.objs[("Deployment", "m")]
    w["status"] = {"readyReplicas": 1, "updatedReplicas": 1}
    kube.log.clear()
    second = reconcile(_body(uri, status=first.status), classes(), kube, cfg)
    got["ready"] = _show(second, kube)
    kube.log.clear()
    got["steady"] = _show(reconcile(_body(uri, status=second.status), classes(), kube, cfg), kube)
    # a new generation that cannot be placed any more, while the old class runs: placement moves at once
    kube.log.clear()
    got["moved_spec"] = _show(reconcile(_body(uri, gen=2, status=second.status, replicas=0), classes(), kube, cfg), kube)
    # the inventory moved under a running workload (its H200s gone, a B200 there): held for the settle period
    kube.log.clear()
    kube.objs[("Deployment", "m")]["status"] = {"readyReplicas": 1, "updatedReplicas": 1}
    b200 = build([node_info(node("b200-0", "NVIDIA-B200", 10, 0))], {})
    got["held"] = _show(reconcile(_body(uri, status=second.status), b200, kube, cfg), kube)

    # the model cache stage (ensure stubbed: its own tests cover the PVC and Job)
    states = iter(["Downloading", "Failed"])
    monkeypatch.setattr(model_cache, "enabled", lambda spec: True)
    monkeypatch.setattr(model_cache, "ensure", lambda *a, **k: ModelCacheStatus(
        claimName="c1", state=next(states), message="m", bytesDone=1, bytesTotal=4))
    released = []
    monkeypatch.setattr(model_cache, "release", lambda kube, ns, name, keep=None: released.append(keep))
    got["cache_filling"] = _show(reconcile(_body(uri, status={"modelCache": {"claimName": "c0"}}), classes(), MemKube(), cfg))
    got["cache_failed"] = _show(reconcile(_body(uri), classes(), MemKube(), cfg))
    monkeypatch.setattr(model_cache, "enabled", lambda spec: False)
    k = MemKube()
    got["cache_off"] = _show(reconcile(_body(uri, status={"modelCache": {"claimName": "c0"}}), classes(), k, cfg), k)
    got["released"] = {"keep": released}
    return got


def _cond(out, type_):
    return next((c for c in out["status"]["conditions"] if c["type"] == type_), None)


def test_every_stage_exit_and_the_whole_path(tmp_path, monkeypatch):
    got = outcomes(tmp_path, monkeypatch)
    assert _cond(got["invalid_spec"], "Degraded")["reason"] == "InvalidSpec"
    assert _cond(got["policy"], "Planned")["reason"] == "PolicyViolation" and got["policy"]["events"]
    assert "lacks the label" in _cond(got["token_unlabelled"], "Planned")["message"]
    assert "not found" in _cond(got["token_missing"], "Planned")["message"]
    assert _cond(got["not_inspected"], "CheckpointInspected")["status"] == "False"
    assert got["not_inspected"]["retry"] in (30, 300)
    assert _cond(got["no_class"], "Planned")["reason"] == "NoFeasibleGpuClass"
    assert _cond(got["crd_missing"], "Degraded")["reason"] == "LeaderWorkerSetMissing"
    assert "apply Deployment/m" in got["applied"]["kube"] and _cond(got["applied"], "Available")["status"] == "False"
    assert ["Normal", "Planned"] == got["applied"]["events"][0][:2]
    assert _cond(got["ready"], "Available")["reason"] == "ReplicasReady" and got["ready"]["kube"] == []
    assert got["steady"]["events"] == [] and got["steady"]["kube"] == []
    assert _cond(got["moved_spec"], "Available")["reason"] == "ScaledToZero"
    assert _cond(got["held"], "PlacementHeld")["status"] == "True" and got["held"]["retry"] == 5
    assert _cond(got["cache_filling"], "Available")["reason"] == "WaitingForModelCache"
    assert got["cache_filling"]["retry"] == 10 and got["cache_failed"]["retry"] == 60
    assert ["Warning", "ModelCacheFailed", "m"] in got["cache_failed"]["events"]
    assert got["cache_off"]["status"]["modelCache"] is None
    assert got["released"]["keep"] == ["c1", None]


def test_an_api_error_in_a_stage_is_a_degraded_condition(tmp_path):
    class Forbidden(MemKube):
        def apply(self, obj):
            raise ApiException(status=403, reason="Forbidden")

    d = write_sample("qwen3-moe-235b-fp8", tmp_path / "qwen3")
    cfg = Config(inspect_in_cluster=False, policy=Policy(allowed_host_paths=(str(tmp_path),)))
    out = reconcile(_body(f"file://{d}"), classes(), Forbidden(), cfg)
    assert _cond(_show(out), "Degraded")["reason"] == "ApiForbidden" and out.retry_after == 30


@pytest.fixture(autouse=True)
def _fresh_settle():
    from moe_operator import reconcile as r
    r._leaving_since.clear()
    yield
    r._leaving_since.clear()
