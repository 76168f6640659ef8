"""One reconcile of a MoEDeployment: policy -> inspect -> place + plan -> render -> drift check /
apply -> status.

Called by the kopf handlers, the resync sweep and owned-object events. Cheap when nothing changed:
the rendered objects are compared field by field with the live ones (one GET each) and applied only
when they differ; the caller writes status only when it changed. Every Kubernetes API error lands
in a condition and an Event instead of escaping.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes.client.rest import ApiException
from moe_core.gpu import from_name
from pydantic import ValidationError

from . import day2
from .conditions import rollup
from .api import Condition, MoEDeploymentSpec, MoEDeploymentStatus, WorkloadRef
from .drift import differences
from .images import RUNTIME_REPOSITORY, runtime_image
from .inspection import InspectionFailed, InspectionPending, inspect_spec, pin
from . import model_cache
from .inventory import ClassInventory, fingerprint
from .kube import ApplyError, Kube, _api_message
from .metrics import DECISIONS, ERRORS
from .placement import place, settle_hold
from .policy import TOKEN_SECRET_LABEL, Policy
from .render import Owner, endpoint, engine_image, render, served_name

GPU_CLASS_ANNOTATION = "moe.serving.dev/gpu-class"
log = logging.getLogger("moe_operator.reconcile")


@dataclass
class Config:
    runtime_repository: str = RUNTIME_REPOSITORY
    local_models_dir: str | None = None
    inspect_in_cluster: bool = True  # run inspection Jobs for paths the operator cannot read
    namespaces: list[str] = field(default_factory=list)  # watched namespaces (empty: all)
    admission: str | None = None  # HOST:PORT of the validating webhook kopf serves (None: off)
    admission_listen: str | None = None  # address the webhook binds (default: HOST of `admission`)
    admission_cert_dir: str | None = None  # tls.crt/tls.key/ca.crt (cert-manager); None: operator-made CA
    admission_configuration: str | None = None  # the chart's ValidatingWebhookConfiguration (None: kopf makes one)
    policy: Policy = field(default_factory=Policy)
    engine_cache_root: str | None = None  # host directory for per-namespace engine caches (None: emptyDir)
    model_cache_grace_seconds: float = 3600.0  # an unused model cache PVC is deleted after this long
    model_cache_enabled: bool = False  # spec.model.cache.enabled when the spec leaves it unset
    model_cache_storage_class: str | None = None  # spec.model.cache.storageClassName when unset
    model_cache_copy_groups: tuple[int, ...] = ()  # supplementalGroups of pvc:// copy Jobs (chart value)
    # a running workload keeps a class that stopped fitting this long (a GFD restart takes seconds)
    placement_settle_seconds: float = float(os.environ.get("MOE_PLACEMENT_SETTLE_SECONDS", "60"))


@dataclass
class Outcome:
    status: dict[str, Any]
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    retry_after: float | None = None


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conds: list[dict[str, Any]], type_: str, status: str, reason: str, message: str,
                  generation: int | None) -> list[dict[str, Any]]:
    """Replace one condition; keep lastTransitionTime when the status did not change."""
    old = next((c for c in conds if c.get("type") == type_), None)
    ltt = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else _now()
    new = Condition(type=type_, status=status, reason=reason, message=message[:32000], lastTransitionTime=ltt,
                    observedGeneration=generation).model_dump(exclude_none=True)
    return [c for c in conds if c.get("type") != type_] + [new]


# Failures of reaching the API server at all (an outage): the caller logs one line per kind and
# retries; status cannot be written then anyway.
UNREACHABLE = (OSError, urllib3.exceptions.HTTPError)


def reconcile(body: dict[str, Any], classes: dict[str, ClassInventory], kube: Kube, cfg: Config) -> Outcome:
    try:
        return _reconcile(body, classes, kube, cfg)
    except UNREACHABLE:
        raise
    except ApplyError as e:  # e.g. a missing LeaderWorkerSet CRD, found before anything was applied
        meta, status = body["metadata"], dict(body.get("status") or {})
        conds = set_condition(list(status.get("conditions") or []), "Degraded", "True", e.reason, e.message,
                              meta.get("generation"))
        conds = set_condition(conds, "Progressing", "False", e.reason, e.message, meta.get("generation"))
        ERRORS.labels(e.reason).inc()
        return Outcome(status={"conditions": rollup(conds, meta.get("generation")), "observedGeneration": meta.get("generation")},
                       events=[("Warning", e.reason, e.message)], retry_after=30)
    except ApiException as e:
        # Forbidden (RBAC), quota, admission of an owned object...: say so on the object.
        meta, status = body["metadata"], dict(body.get("status") or {})
        reason = {401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict",
                  422: "Invalid"}.get(e.status, "ApiError")
        msg = f"Kubernetes API error during reconcile: HTTP {e.status} {reason}: {_api_message(e)}"
        conds = set_condition(list(status.get("conditions") or []), "Degraded", "True", "Api" + reason, msg,
                              meta.get("generation"))
        ERRORS.labels("Api" + reason).inc()
        log.warning("reconcile %s/%s: %s", meta["namespace"], meta["name"], msg)
        return Outcome(status={"conditions": rollup(conds, meta.get("generation")), "observedGeneration": meta.get("generation")},
                       events=[("Warning", "Api" + reason, msg)], retry_after=30)
    except Exception as e:  # noqa: BLE001 - a bug of ours: on the object, not only in the log
        meta, status = body["metadata"], dict(body.get("status") or {})
        msg = f"reconcile failed: {type(e).__name__}: {e}"
        log.exception("reconcile %s/%s failed", meta["namespace"], meta["name"])
        conds = set_condition(list(status.get("conditions") or []), "Degraded", "True", "ReconcileError", msg[:2000],
                              meta.get("generation"))
        ERRORS.labels("ReconcileError").inc()
        return Outcome(status={"conditions": rollup(conds, meta.get("generation")), "observedGeneration": meta.get("generation")},
                       events=[("Warning", "ReconcileError", msg)], retry_after=30)


# (namespace, name) -> when its running workload's class was first seen not to fit (process memory:
# after a restart the settle period starts again, which only errs on the side of not moving pods)
_leaving_since: dict[tuple[str, str], float] = {}


def _live_gpu_class(live: dict[str, Any] | None) -> str | None:
    return ((live or {}).get("metadata", {}).get("annotations") or {}).get(GPU_CLASS_ANNOTATION)


def _reconcile(body: dict[str, Any], classes: dict[str, ClassInventory], kube: Kube, cfg: Config) -> Outcome:
    meta, status = body["metadata"], dict(body.get("status") or {})
    ns, name, gen = meta["namespace"], meta["name"], meta.get("generation")
    conds = list(status.get("conditions") or [])
    out = Outcome(status={})

    def finish(**fields: Any) -> Outcome:
        fields.update(conditions=rollup(conds, gen), observedGeneration=gen)  # Ready, Reconciling, Stalled
        # Built through the status model so a field the CRD does not know never reaches the API.
        out.status.update(MoEDeploymentStatus.model_validate(fields).model_dump(exclude_unset=True, mode="json"))
        return out

    try:
        spec = MoEDeploymentSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:  # the CRD schema should have refused this; say so rather than crash
        conds = set_condition(conds, "Degraded", "True", "InvalidSpec", str(e), gen)
        ERRORS.labels("InvalidSpec").inc()
        return finish()
    out.status.update(endpoint=endpoint(name, ns, spec), modelName=served_name(spec, name))

    # 0. what the cluster admin allows (host paths, images, token Secrets)
    problems = cfg.policy.problems(spec)
    ref = spec.model.tokenSecretRef
    if ref and cfg.policy.require_token_label:
        labels = kube.secret_labels(ns, ref.name)
        if labels is None:
            problems.append(f"model.tokenSecretRef: Secret {ref.name!r} not found in namespace {ns}")
        elif labels.get(TOKEN_SECRET_LABEL) != "true":
            problems.append(f"model.tokenSecretRef: Secret {ref.name!r} lacks the label {TOKEN_SECRET_LABEL}=true "
                            "(its owner must mark it for model-token use before a MoEDeployment may mount it)")
    if problems:
        msg = "; ".join(problems)
        if not any(c.get("reason") == "PolicyViolation" and c.get("message") == msg for c in conds):
            out.events.append(("Warning", "PolicyViolation", msg))
        conds = set_condition(conds, "Planned", "False", "PolicyViolation", msg, gen)
        conds = set_condition(conds, "Available", "False", "NotPlanned", "refused by the cluster's policy", gen)
        ERRORS.labels("PolicyViolation").inc()
        return finish()

    # 1. checkpoint
    def hf_token() -> str | None:
        return kube.read_secret_key(ns, ref.name, ref.key) if ref else None

    def job(uri: str) -> dict[str, Any] | None:
        image = runtime_image(from_name("sm90"), cfg.runtime_repository)  # amd64; the Job is pinned to amd64
        return kube.inspection_job(ns, Owner(name, ns, meta["uid"]), uri, image)

    try:
        # hf:// is served at one hub commit: the spec from here on names it (inspection cache, pods)
        if (pinned := pin(spec, status, hf_token)) is not None:
            out.status.update(revision=pinned.revision, revisionUri=spec.model.uri)
            spec = spec.model_copy(update={"model": spec.model.model_copy(update={"uri": pinned.uri})})
        ckpt = inspect_spec(spec, local_models_dir=cfg.local_models_dir, hub=True, hf_token=hf_token,
                            pvc_job=job if cfg.inspect_in_cluster else None,
                            pvc_scope=lambda claim: (ns, uid) if (uid := kube.pvc_uid(ns, claim)) else None)
    except InspectionPending as e:  # hub calls or a Job run in the background: nothing here waits on them
        conds = set_condition(conds, "CheckpointInspected", "Unknown", "Inspecting", str(e), gen)
        out.retry_after = 3
        return finish()
    except InspectionFailed as e:
        was = next((c for c in conds if c.get("type") == "CheckpointInspected"), {})
        conds = set_condition(conds, "CheckpointInspected", "False", e.reason, e.message, gen)
        conds = set_condition(conds, "Planned", "False", "CheckpointNotInspected", "waiting for a readable checkpoint", gen)
        if (was.get("status"), was.get("reason"), was.get("message")) != ("False", e.reason, e.message):
            out.events.append(("Warning", "CheckpointInspectionFailed", e.message))  # once per cause
        ERRORS.labels(e.reason).inc()
        out.retry_after = 30 if e.retry else 300
        return finish()
    conds = set_condition(conds, "CheckpointInspected", "True", "Inspected",
                          f"{ckpt.architecture} {ckpt.format} ({ckpt.formatSource})", gen)

    # 2. placement + plan. Sticky: the class the live workload runs on wins over status (a crash
    # between apply and the status write must not move pods), status is the fallback.
    kind = "LeaderWorkerSet" if spec.nodesPerReplica > 1 else "Deployment"
    live_workload = kube.get(kind, ns, name)
    current = _live_gpu_class(live_workload) or status.get("gpuClass")
    placement = place(spec, ckpt, classes, current=current)
    inv_fp = fingerprint(classes)
    running = int(((live_workload or {}).get("status") or {}).get("readyReplicas") or 0) > 0
    key = (ns, name)
    # only the inventory moving is settled: a spec change (a new generation) follows placement at once
    leaving = current is not None and status.get("observedGeneration") == gen and not (
        placement.ok and placement.inventory.gpu_class.key() == current)
    since = _leaving_since.setdefault(key, time.monotonic()) if leaving else _leaving_since.pop(key, None)
    held = settle_hold(spec, current, placement, running, time.monotonic() - (since or time.monotonic()),
                       cfg.placement_settle_seconds) if leaving else None
    if held:
        if not any(c.get("type") == "PlacementHeld" and c.get("status") == "True" for c in conds):
            out.events.append(("Normal", "PlacementHeld", held))
        conds = set_condition(conds, "PlacementHeld", "True", "SettlingInventory", held, gen)
        out.retry_after = 5
        return finish()  # the rest of status (gpuClass, plan) and the workload stay as they are
    if any(c.get("type") == "PlacementHeld" for c in conds):
        conds = set_condition(conds, "PlacementHeld", "False", "Settled", "placement follows the inventory", gen)
    if not placement.ok:
        msg = f"no GPU class can run this: {placement.explain()}"
        if status.get("inventoryHash") != inv_fp or not any(
                c.get("type") == "Planned" and c.get("reason") == "NoFeasibleGpuClass" for c in conds):
            out.events.append(("Warning", "NoFeasibleGpuClass", msg))
        conds = set_condition(conds, "Planned", "False", "NoFeasibleGpuClass", msg, gen)
        conds = set_condition(conds, "Available", "False", "NotPlanned", "no plan", gen)
        ERRORS.labels("NoFeasibleGpuClass").inc()
        return finish(checkpoint=ckpt.model_dump(), format=ckpt.format, inventoryHash=inv_fp)
    plan, inv = placement.plan, placement.inventory
    spec = placement.spec or spec  # the layout sizing chose (tp, GPUs per node, nodes) when the spec left it unset
    gpu = inv.gpu_class
    plan, pending = day2.held_plan(spec, status, plan, gpu.key(), gen)  # spec.planPolicy pin
    if pending:
        msg = ("a plan change the spec did not cause (new rule tables or a driver rule) is held by spec.planPolicy "
               "pin; change the spec (e.g. planPolicy: follow) to accept it: " + "; ".join(pending))
        if (status.get("pendingPlan") or {}).get("diff") != pending:
            out.events.append(("Normal", "PlanHeld", msg))
        conds = set_condition(conds, "PlanPending", "True", "HeldByPlanPolicy", msg, gen)
    else:
        conds = set_condition(conds, "PlanPending", "False", "UpToDate", "the pods run the current plan", gen)
    conds = set_condition(conds, "Planned", "True", "Planned",
                          f"{gpu.key()}: {plan.moe.runnerBackend} (deferred finalize "
                          f"{'on' if plan.moe.deferredFinalize else 'off'}); " + " ".join(plan.reasons[:3]), gen)

    # 2b. model cache: one PVC per (model, revision) in the namespace; the workload waits for it
    spec = model_cache.with_defaults(spec, cfg.model_cache_enabled, cfg.model_cache_storage_class)
    if model_cache.enabled(spec):
        image = runtime_image(from_name("sm90"), cfg.runtime_repository)  # amd64; the Job is pinned to amd64
        old_claim = (status.get("modelCache") or {}).get("claimName")
        cache = model_cache.ensure(kube, ns, name, spec, ckpt, image, copy_groups=cfg.model_cache_copy_groups)
        if old_claim and old_claim != cache.claimName:  # the revision moved (follow, or a new uri)
            model_cache.release(kube, ns, name, keep=cache.claimName)
        out.status["modelCache"] = cache.model_dump(exclude_none=True)
        progress = (f"{cache.bytesDone or 0}/{cache.bytesTotal} bytes" if cache.bytesTotal else "size unknown")
        conds = set_condition(conds, "ModelCacheReady", "True" if cache.state == "Ready" else "False", cache.state,
                              f"{cache.claimName}: {progress}; {cache.message}", gen)
        if cache.state != "Ready":
            conds = set_condition(conds, "Available", "False", "WaitingForModelCache",
                                  f"pods start once model cache {cache.claimName} is Ready ({progress})", gen)
            if cache.state == "Failed":
                out.events.append(("Warning", "ModelCacheFailed", cache.message))
            out.retry_after = 10 if cache.state != "Failed" else 60
            return finish(checkpoint=ckpt.model_dump(), format=ckpt.format, gpuClass=gpu.key(),
                          runnerBackend=plan.moe.runnerBackend, plan=plan.model_dump(), inventoryHash=inv_fp)
    elif status.get("modelCache"):  # the cache was turned off
        model_cache.release(kube, ns, name)
        out.status["modelCache"] = None

    # 3. render, compare with the live objects, apply what differs
    spare = day2.spare_gpu_sets(inv.free_per_node, spec.gpus_per_node(), spec.nodesPerReplica)
    rollout = day2.rollout_policy(spec, gpu.key(), spare, running=day2.running_roll(live_workload))
    objects = render(Owner(name, ns, meta["uid"]), spec, plan, gpu, cfg.runtime_repository, cfg.engine_cache_root,
                     rollout=rollout)
    optional = day2.optional_kinds(objects)
    optional_failed: list[ApplyError] = []
    workload = next(o for o in objects if o["kind"] in ("Deployment", "LeaderWorkerSet"))
    out.status["image"] = engine_image(spec, plan, gpu, cfg.runtime_repository)
    if workload["kind"] != kind:  # sizing chose the other kind than the spec alone says
        live_workload = kube.get(workload["kind"], ns, name)
    day2.hold_strategy(workload, live_workload, spec)  # roll numbers change when a roll starts, not between
    stale_kind = "LeaderWorkerSet" if workload["kind"] == "Deployment" else "Deployment"
    picker_taken = False
    try:
        for obj in objects:
          try:
            if picker_taken and day2.is_picker(obj):
                continue  # its Service is someone else's: none of the picker is made
            live = live_workload if obj is workload else kube.get(obj["kind"], ns, obj["metadata"]["name"])
            if live is None and day2.is_picker(obj):  # the cache sees only ours: is the name someone else's?
                live = kube.get(obj["kind"], ns, obj["metadata"]["name"], cached=False)
            if why := day2.picker_not_owned(obj, live, meta["uid"]):
                picker_taken = True
                raise ApplyError("EndpointPickerNotOwned", why)
            drift = differences(obj, live) if live is not None else ["missing"]
            if not drift:
                continue
            if live is not None:
                log.info("drift on %s %s/%s, repairing: %s", obj["kind"], ns, obj["metadata"]["name"], "; ".join(drift[:5]))
            kube.apply(obj)
            if live is not None and (after := kube.get(obj["kind"], ns, obj["metadata"]["name"])) is not None \
                    and differences(obj, after):
                kube.merge_patch(obj)  # items another manager added survive apply: replace the lists
            if obj is workload:
                live_workload = kube.get(obj["kind"], ns, obj["metadata"]["name"])
          except ApplyError as e:  # an optional object (e.g. its CRD is missing) never holds back the rest
            if not day2.is_optional(obj):
                raise
            optional_failed.append(e)
        for kind, obj_name in day2.stale_objects(name, status.get("optionalObjects") or [], optional):
            try:  # the spec stopped asking for it (autoscaling off, replicas 1, the picker not deployed, ...)
                if day2.prunable(obj_name, name, kube.get(kind, ns, obj_name, cached=False) if obj_name != name else None,
                                 meta["uid"]):
                    kube.delete(kind, ns, obj_name)
            except ApplyError:
                pass  # its CRD went away, and the object with it
        if status.get("workload", {}).get("kind") == stale_kind:
            kube.delete(stale_kind, ns, name)  # nodesPerReplica changed: the other workload kind goes
    except ApplyError as e:
        conds = set_condition(conds, "Degraded", "True", e.reason, e.message, gen)
        conds = set_condition(conds, "Progressing", "False", e.reason, e.message, gen)
        out.events.append(("Warning", e.reason, e.message))
        ERRORS.labels(e.reason).inc()
        out.retry_after = 30
        return finish(checkpoint=ckpt.model_dump(), format=ckpt.format, gpuClass=gpu.key(),
                      runnerBackend=plan.moe.runnerBackend, plan=plan.model_dump())
    if optional_failed:
        e = optional_failed[0]
        if not any(c.get("type") == "Degraded" and c.get("reason") == e.reason for c in conds):
            out.events.append(("Warning", e.reason, e.message))
        conds = set_condition(conds, "Degraded", "True", e.reason,
                              "workload applied; " + "; ".join(f.message for f in optional_failed), gen)
        # a missing CRD appears without any event on this object: look again (the sweep runs only what is due)
        out.retry_after = min(out.retry_after or 30, 30)
    else:
        conds = set_condition(conds, "Degraded", "False", "Applied", "workload applied", gen)
    # the pool's endpoint picker: the operator renders the pool, not the picker (day2.endpoint_picker_condition)
    if "InferencePool" in optional and not any(f.reason == "InferencePoolCrdMissing" for f in optional_failed):
        try:  # read from the API: the watch cache holds only the Services the operator owns
            epp = kube.core.read_namespaced_service(day2.endpoint_picker_ref(name, spec)[0], ns).to_dict()
        except ApiException as e:
            if e.status != 404:
                raise
            epp = None
        picker = day2.endpoint_picker_condition(name, spec, epp, kube.get("InferencePool", ns, name))
        if picker and picker[0] == "False" and not any(
                c.get("type") == "InferencePoolReady" and c.get("reason") == picker[1] for c in conds):
            out.events.append(("Warning", picker[1], picker[2]))
        if picker:
            conds = set_condition(conds, "InferencePoolReady", *picker, gen)
        if picker and picker[0] == "False":  # the picker's Service is not ours: no watch event tells us it came
            out.retry_after = min(out.retry_after or 30, 30)
    elif any(c.get("type") == "InferencePoolReady" for c in conds):
        conds = [c for c in conds if c.get("type") != "InferencePoolReady"]  # no pool rendered any more

    h = workload["metadata"]["annotations"]["moe.serving.dev/inputs-hash"]
    if status.get("inputsHash") != h:
        DECISIONS.labels(plan.engine.name, gpu.family, plan.moe.runnerBackend).inc()
        out.events.append(("Normal", "Planned", f"{gpu.key()}: " + " | ".join(plan.reasons)))
        for w in plan.warnings:
            out.events.append(("Warning", "PlanWarning", w))

    # 4. readiness from the live workload
    wst = (live_workload or {}).get("status") or {}
    ready, desired = int(wst.get("readyReplicas") or 0), spec.replicas
    # a roll: pods of an older template are still there (updatedReplicas counts the new ones)
    rolling = "updatedReplicas" in wst and int(wst.get("updatedReplicas") or 0) < desired
    if desired == 0:
        conds = set_condition(conds, "Available", "True", "ScaledToZero", "replicas: 0", gen)
        conds = set_condition(conds, "Progressing", "False", "ScaledToZero", "replicas: 0", gen)
    elif ready >= desired and not rolling:
        conds = set_condition(conds, "Available", "True", "ReplicasReady", f"{ready}/{desired} replicas ready", gen)
        conds = set_condition(conds, "Progressing", "False", "Complete",
                              f"{ready}/{desired} replicas ready; next roll: {rollout.message}", gen)
    else:
        if ready >= desired:  # old pods still serve while the roll runs
            conds = set_condition(conds, "Available", "True", "ReplicasReady", f"{ready}/{desired} replicas ready", gen)
        else:
            conds = set_condition(conds, "Available", "False", "ReplicasNotReady", f"{ready}/{desired} replicas ready", gen)
        reason = rollout.progress_reason() if rolling else "RollingOut"  # why the roll goes as it goes
        conds = set_condition(conds, "Progressing", "True", reason,
                              f"{ready}/{desired} replicas ready, {wst.get('updatedReplicas', 0)} updated; "
                              + rollout.message, gen)
    return finish(checkpoint=ckpt.model_dump(), format=ckpt.format, gpuClass=gpu.key(),
                  runnerBackend=plan.moe.runnerBackend, deferredFinalize=plan.moe.deferredFinalize,
                  plan=plan.model_dump(), inputsHash=h, inventoryHash=inv_fp,
                  workload=WorkloadRef(apiVersion=workload["apiVersion"], kind=workload["kind"], name=name).model_dump(),
                  replicas=spec.replicas, readyReplicas=ready,
                  selector=day2.selector_string(day2.serving_selector(name, spec.nodesPerReplica > 1)),
                  optionalObjects=optional,
                  planGeneration=status.get("planGeneration") if pending else gen,
                  pendingPlan={"diff": pending, "message": "held by spec.planPolicy pin"} if pending else None)


def _without_nulls(v: Any) -> Any:
    """What the API server keeps of a merge patch: a null removes a field, so it is absent."""
    if isinstance(v, dict):
        return {k: _without_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_without_nulls(x) for x in v]
    return v


def status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether writing `new` (a merge patch of status) would change `old`."""
    return any(_without_nulls(old.get(k)) != _without_nulls(v) for k, v in new.items())
