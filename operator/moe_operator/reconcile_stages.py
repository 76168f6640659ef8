"""The stages of one reconcile (moe_operator.reconcile runs them in order): policy -> checkpoint ->
placement -> cache -> apply -> ready. Each takes the `Run` (the object, what the cluster holds, and
what the stages before it found) and returns its value, or an `Outcome` that ends the reconcile
there (a refusal, or something to wait for). The run's conditions and status accumulate as the
stages go; `Run.finish` writes them through the status model.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException
from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import GpuClass
from moe_core.plan import Plan
from pydantic import ValidationError

from . import day2, model_cache
from .api import Condition, MoEDeploymentSpec, MoEDeploymentStatus, WorkloadRef
from .conditions import rollup
from .drift import differences
from .images import tool_image
from .inspection import InspectionFailed, InspectionPending, inspect_spec, pin
from .inventory import ClassInventory, fingerprint
from .kube import ApplyError, Kube
from .metrics import ERRORS, decided
from .placement import place, settle_hold
from .policy import TOKEN_SECRET_LABEL
from .render import Owner, endpoint, engine_image, render, served_name

if TYPE_CHECKING:
    from .reconcile import Config

GPU_CLASS_ANNOTATION = "moe.serving.dev/gpu-class"
log = logging.getLogger("moe_operator.reconcile")


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


# (namespace, name) -> when its running workload's class was first seen not to fit (process memory:
# after a restart the settle period starts again, which only errs on the side of not moving pods)
_leaving_since: dict[tuple[str, str], float] = {}


def _live_gpu_class(live: dict[str, Any] | None) -> str | None:
    return ((live or {}).get("metadata", {}).get("annotations") or {}).get(GPU_CLASS_ANNOTATION)


@dataclass(frozen=True)
class Placed:
    """What the placement stage decided: the plan (the pinned one under planPolicy pin), where."""

    plan: Plan
    inv: ClassInventory
    gpu: GpuClass
    inv_fp: str  # the GPU inventory's fingerprint (status.inventoryHash)
    pending: list[str]  # plan changes held by planPolicy pin
    live_kind: str  # the workload kind the spec alone says (sizing may choose the other)
    live_workload: dict[str, Any] | None  # the live workload of that kind (None: none)


@dataclass(frozen=True)
class Applied:
    """What the apply stage left: the rendered workload and its live copy, the optional kinds."""

    workload: dict[str, Any]
    live_workload: dict[str, Any] | None
    optional: list[str]
    rollout: day2.Rollout
    inputs_hash: str


@dataclass
class Run:
    """One reconcile of one MoEDeployment: its inputs, the conditions and status being built, and
    each stage's value. `spec` is the spec as the stages refined it (pinned revision, sized layout,
    model cache defaults)."""

    body: dict[str, Any]
    classes: dict[str, ClassInventory]
    kube: Kube
    cfg: Config
    conds: list[dict[str, Any]]
    out: Outcome = field(default_factory=lambda: Outcome(status={}))
    spec: MoEDeploymentSpec | None = None
    ckpt: CheckpointInfo | None = None
    placed: Placed | None = None
    applied: Applied | None = None

    @classmethod
    def start(cls, body, classes, kube, cfg) -> Run:
        return cls(body, classes, kube, cfg, conds=list((body.get("status") or {}).get("conditions") or []))

    @property
    def meta(self) -> dict[str, Any]:
        return self.body["metadata"]

    @property
    def status(self) -> dict[str, Any]:
        return dict(self.body.get("status") or {})

    @property
    def ns(self) -> str:
        return self.meta["namespace"]

    @property
    def name(self) -> str:
        return self.meta["name"]

    @property
    def gen(self) -> int | None:
        return self.meta.get("generation")

    def cond(self, type_: str, status: str, reason: str, message: str) -> None:
        self.conds = set_condition(self.conds, type_, status, reason, message, self.gen)

    def has(self, type_: str, **fields: str) -> bool:
        """A condition of this type (with these fields) is there already."""
        return any(c.get("type") == type_ and all(c.get(k) == v for k, v in fields.items()) for c in self.conds)

    def finish(self, **fields: Any) -> Outcome:
        fields.update(conditions=rollup(self.conds, self.gen), observedGeneration=self.gen)  # Ready, Reconciling, Stalled
        # Built through the status model so a field the CRD does not know never reaches the API.
        self.out.status.update(MoEDeploymentStatus.model_validate(fields).model_dump(exclude_unset=True, mode="json"))
        return self.out

    def planned(self) -> dict[str, Any]:
        """The status fields of a reconcile that got as far as a plan."""
        p = self.placed
        return dict(checkpoint=self.ckpt.model_dump(), format=self.ckpt.format, gpuClass=p.gpu.key(),
                    runnerBackend=p.plan.moe.runnerBackend, plan=p.plan.model_dump())


# ------------------------------------------------------------------------------------------------
# 0. policy: the spec is valid and the cluster admin allows it (host paths, images, token Secrets)

def policy(r: Run) -> MoEDeploymentSpec | Outcome:
    try:
        spec = MoEDeploymentSpec.model_validate(r.body.get("spec") or {})
    except ValidationError as e:  # the CRD schema should have refused this; say so rather than crash
        r.cond("Degraded", "True", "InvalidSpec", str(e))
        ERRORS.labels("InvalidSpec").inc()
        return r.finish()
    r.out.status.update(endpoint=endpoint(r.name, r.ns, spec), modelName=served_name(spec, r.name))
    problems = r.cfg.policy.problems(spec)
    ref = spec.model.tokenSecretRef
    if ref and r.cfg.policy.require_token_label:
        labels = r.kube.secret_labels(r.ns, ref.name)
        if labels is None:
            problems.append(f"model.tokenSecretRef: Secret {ref.name!r} not found in namespace {r.ns}")
        elif labels.get(TOKEN_SECRET_LABEL) != "true":
            problems.append(f"model.tokenSecretRef: Secret {ref.name!r} lacks the label {TOKEN_SECRET_LABEL}=true "
                            "(its owner must mark it for model-token use before a MoEDeployment may mount it)")
    if problems:
        msg = "; ".join(problems)
        if not any(c.get("reason") == "PolicyViolation" and c.get("message") == msg for c in r.conds):
            r.out.events.append(("Warning", "PolicyViolation", msg))
        r.cond("Planned", "False", "PolicyViolation", msg)
        r.cond("Available", "False", "NotPlanned", "refused by the cluster's policy")
        ERRORS.labels("PolicyViolation").inc()
        return r.finish()
    return spec


# ------------------------------------------------------------------------------------------------
# 1. checkpoint: hf:// pinned to one hub commit, then inspected (headers only; in the background)

def checkpoint(r: Run) -> CheckpointInfo | Outcome:
    spec, ns, status = r.spec, r.ns, r.status
    ref = spec.model.tokenSecretRef

    def hf_token() -> str | None:
        return r.kube.read_secret_key(ns, ref.name, ref.key) if ref else None

    def job(uri: str) -> dict[str, Any] | None:
        return r.kube.inspection_job(ns, Owner(r.name, ns, r.meta["uid"]), uri, tool_image(r.cfg.runtime_repository))

    try:
        # hf:// is served at one hub commit: the spec from here on names it (inspection cache, pods)
        if (pinned := pin(spec, status, hf_token)) is not None:
            r.out.status.update(revision=pinned.revision, revisionUri=spec.model.uri)
            r.spec = spec = spec.model_copy(update={"model": spec.model.model_copy(update={"uri": pinned.uri})})
        ckpt = inspect_spec(spec, local_models_dir=r.cfg.local_models_dir, hub=True, hf_token=hf_token,
                            pvc_job=job if r.cfg.inspect_in_cluster else None,
                            pvc_scope=lambda claim: (ns, uid) if (uid := r.kube.pvc_uid(ns, claim)) else None)
    except InspectionPending as e:  # hub calls or a Job run in the background: nothing here waits on them
        r.cond("CheckpointInspected", "Unknown", "Inspecting", str(e))
        r.out.retry_after = 3
        return r.finish()
    except InspectionFailed as e:
        was = next((c for c in r.conds if c.get("type") == "CheckpointInspected"), {})
        r.cond("CheckpointInspected", "False", e.reason, e.message)
        r.cond("Planned", "False", "CheckpointNotInspected", "waiting for a readable checkpoint")
        if (was.get("status"), was.get("reason"), was.get("message")) != ("False", e.reason, e.message):
            r.out.events.append(("Warning", "CheckpointInspectionFailed", e.message))  # once per cause
        ERRORS.labels(e.reason).inc()
        r.out.retry_after = 30 if e.retry else 300
        return r.finish()
    r.cond("CheckpointInspected", "True", "Inspected", f"{ckpt.architecture} {ckpt.format} ({ckpt.formatSource})")
    return ckpt


# ------------------------------------------------------------------------------------------------
# 2. placement + plan. Sticky: the class the live workload runs on wins over status (a crash
# between apply and the status write must not move pods), status is the fallback.

def placement(r: Run) -> Placed | Outcome:
    spec, status, ckpt, gen = r.spec, r.status, r.ckpt, r.gen
    kind = "LeaderWorkerSet" if spec.nodesPerReplica > 1 else "Deployment"
    live_workload = r.kube.get(kind, r.ns, r.name)
    current = _live_gpu_class(live_workload) or status.get("gpuClass")
    found = place(spec, ckpt, r.classes, current=current)
    inv_fp = fingerprint(r.classes)
    running = int(((live_workload or {}).get("status") or {}).get("readyReplicas") or 0) > 0
    key = (r.ns, r.name)
    # only the inventory moving is settled: a spec change (a new generation) follows placement at once
    leaving = current is not None and status.get("observedGeneration") == gen and not (
        found.ok and found.inventory.gpu_class.key() == current)
    since = _leaving_since.setdefault(key, time.monotonic()) if leaving else _leaving_since.pop(key, None)
    held = settle_hold(spec, current, found, running, time.monotonic() - (since or time.monotonic()),
                       r.cfg.placement_settle_seconds) if leaving else None
    if held:
        if not r.has("PlacementHeld", status="True"):
            r.out.events.append(("Normal", "PlacementHeld", held))
        r.cond("PlacementHeld", "True", "SettlingInventory", held)
        r.out.retry_after = 5
        return r.finish()  # the rest of status (gpuClass, plan) and the workload stay as they are
    if r.has("PlacementHeld"):
        r.cond("PlacementHeld", "False", "Settled", "placement follows the inventory")
    if not found.ok:
        msg = f"no GPU class can run this: {found.explain()}"
        if status.get("inventoryHash") != inv_fp or not r.has("Planned", reason="NoFeasibleGpuClass"):
            r.out.events.append(("Warning", "NoFeasibleGpuClass", msg))
        r.cond("Planned", "False", "NoFeasibleGpuClass", msg)
        r.cond("Available", "False", "NotPlanned", "no plan")
        ERRORS.labels("NoFeasibleGpuClass").inc()
        return r.finish(checkpoint=ckpt.model_dump(), format=ckpt.format, inventoryHash=inv_fp)
    plan, inv = found.plan, found.inventory
    r.spec = spec = found.spec or spec  # the layout sizing chose (tp, GPUs per node, nodes) when the spec left it unset
    gpu = inv.gpu_class
    plan, pending = day2.held_plan(spec, status, plan, gpu.key(), gen)  # spec.planPolicy pin
    if pending:
        msg = ("a plan change the spec did not cause (new rule tables or a driver rule) is held by spec.planPolicy "
               "pin; change the spec (e.g. planPolicy: follow) to accept it: " + "; ".join(pending))
        if (status.get("pendingPlan") or {}).get("diff") != pending:
            r.out.events.append(("Normal", "PlanHeld", msg))
        r.cond("PlanPending", "True", "HeldByPlanPolicy", msg)
    else:
        r.cond("PlanPending", "False", "UpToDate", "the pods run the current plan")
    r.cond("Planned", "True", "Planned", f"{gpu.key()}: {plan.moe.runnerBackend} (deferred finalize "
           f"{'on' if plan.moe.deferredFinalize else 'off'}); " + " ".join(plan.reasons[:3]))
    return Placed(plan, inv, gpu, inv_fp, pending, kind, live_workload)


# ------------------------------------------------------------------------------------------------
# 2b. model cache: one PVC per (model, revision) in the namespace; the workload waits for it

def cache(r: Run) -> MoEDeploymentSpec | Outcome:
    """The spec with the cache defaults (the Config's), once its cache is Ready or it has none."""
    r.spec = spec = model_cache.with_defaults(r.spec, r.cfg.model_cache_enabled, r.cfg.model_cache_storage_class)
    if model_cache.enabled(spec):
        old_claim = (r.status.get("modelCache") or {}).get("claimName")
        mc = model_cache.ensure(r.kube, r.ns, r.name, spec, r.ckpt, tool_image(r.cfg.runtime_repository),
                             copy_groups=r.cfg.model_cache_copy_groups)
        if old_claim and old_claim != mc.claimName:  # the revision moved (follow, or a new uri)
            model_cache.release(r.kube, r.ns, r.name, keep=mc.claimName)
        r.out.status["modelCache"] = mc.model_dump(exclude_none=True)
        progress = (f"{mc.bytesDone or 0}/{mc.bytesTotal} bytes" if mc.bytesTotal else "size unknown")
        r.cond("ModelCacheReady", "True" if mc.state == "Ready" else "False", mc.state,
               f"{mc.claimName}: {progress}; {mc.message}")
        if mc.state != "Ready":
            r.cond("Available", "False", "WaitingForModelCache",
                   f"pods start once model cache {mc.claimName} is Ready ({progress})")
            if mc.state == "Failed":
                r.out.events.append(("Warning", "ModelCacheFailed", mc.message))
            r.out.retry_after = 10 if mc.state != "Failed" else 60
            return r.finish(**r.planned(), inventoryHash=r.placed.inv_fp)
    elif r.status.get("modelCache"):  # the cache was turned off
        model_cache.release(r.kube, r.ns, r.name)
        r.out.status["modelCache"] = None
    return spec


# ------------------------------------------------------------------------------------------------
# 3. render, compare with the live objects, apply what differs

def _apply_objects(r: Run, objects: list[dict[str, Any]], workload: dict[str, Any],
                   live_workload: dict[str, Any] | None) -> tuple[dict[str, Any] | None, list[ApplyError]]:
    """Apply each object that differs from its live copy; (the live workload after, the optional
    objects that could not be applied). An ApplyError of a required object is raised."""
    ns, uid = r.ns, r.meta["uid"]
    optional_failed: list[ApplyError] = []
    picker_taken = False
    for obj in objects:
        try:
            if picker_taken and day2.is_picker(obj):
                continue  # its Service is someone else's: none of the picker is made
            live = live_workload if obj is workload else r.kube.get(obj["kind"], ns, obj["metadata"]["name"])
            if live is None and day2.is_picker(obj):  # the cache sees only ours: is the name someone else's?
                live = r.kube.get(obj["kind"], ns, obj["metadata"]["name"], cached=False)
            if why := day2.picker_not_owned(obj, live, uid):
                picker_taken = True
                raise ApplyError("EndpointPickerNotOwned", why)
            drift = differences(obj, live) if live is not None else ["missing"]
            if not drift:
                continue
            if live is not None:
                log.info("drift on %s %s/%s, repairing: %s", obj["kind"], ns, obj["metadata"]["name"], "; ".join(drift[:5]))
            r.kube.apply(obj)
            if live is not None and (after := r.kube.get(obj["kind"], ns, obj["metadata"]["name"])) is not None \
                    and differences(obj, after):
                r.kube.merge_patch(obj)  # items another manager added survive apply: replace the lists
            if obj is workload:
                live_workload = r.kube.get(obj["kind"], ns, obj["metadata"]["name"])
        except ApplyError as e:  # an optional object (e.g. its CRD is missing) never holds back the rest
            if not day2.is_optional(obj):
                raise
            optional_failed.append(e)
    return live_workload, optional_failed


def _prune(r: Run, workload: dict[str, Any], optional: list[str]) -> None:
    """Delete what the spec stopped asking for, and the other workload kind."""
    ns, name = r.ns, r.name
    stale_kind = "LeaderWorkerSet" if workload["kind"] == "Deployment" else "Deployment"
    for kind, obj_name in day2.stale_objects(name, r.status.get("optionalObjects") or [], optional):
        try:  # the spec stopped asking for it (autoscaling off, replicas 1, the picker not deployed, ...)
            if day2.prunable(obj_name, name, r.kube.get(kind, ns, obj_name, cached=False) if obj_name != name else None,
                             r.meta["uid"]):
                r.kube.delete(kind, ns, obj_name)
        except ApplyError:
            pass  # its CRD went away, and the object with it
    if r.status.get("workload", {}).get("kind") == stale_kind:
        r.kube.delete(stale_kind, ns, name)  # nodesPerReplica changed: the other workload kind goes


def _picker_condition(r: Run, optional: list[str], optional_failed: list[ApplyError]) -> None:
    """The pool's endpoint picker: the operator renders the pool, not the picker (day2.endpoint_picker_condition)."""
    ns, name, spec = r.ns, r.name, r.spec
    if "InferencePool" in optional and not any(f.reason == "InferencePoolCrdMissing" for f in optional_failed):
        try:  # read from the API: the watch cache holds only the Services the operator owns
            epp = r.kube.core.read_namespaced_service(day2.endpoint_picker_ref(name, spec)[0], ns).to_dict()
        except ApiException as e:
            if e.status != 404:
                raise
            epp = None
        pods = r.kube.core.list_namespaced_pod(ns, label_selector=day2.selector_string(day2.pool_selector(name, spec)))
        ready = day2.ready_endpoints([r.kube.api_client.sanitize_for_serialization(p) for p in pods.items])
        picker = day2.endpoint_picker_condition(name, spec, epp, r.kube.get("InferencePool", ns, name), ready)
        if picker and picker[0] == "False" and picker[1] not in day2.QUIET_REASONS \
                and not r.has("InferencePoolReady", reason=picker[1]):
            r.out.events.append(("Warning", picker[1], picker[2]))
        if picker:
            r.cond("InferencePoolReady", *picker)
        if picker and picker[0] == "False":  # the picker's Service is not ours: no watch event tells us it came
            r.out.retry_after = min(r.out.retry_after or 30, 30)
    elif r.has("InferencePoolReady"):
        r.conds = [c for c in r.conds if c.get("type") != "InferencePoolReady"]  # no pool rendered any more


def apply(r: Run) -> Applied | Outcome:
    spec, status, ns, name = r.spec, r.status, r.ns, r.name
    plan, inv, gpu = r.placed.plan, r.placed.inv, r.placed.gpu
    live_workload = r.placed.live_workload
    spare = day2.spare_gpu_sets(inv.free_per_node, spec.gpus_per_node(), spec.nodesPerReplica)
    rollout = day2.rollout_policy(spec, gpu.key(), spare, running=day2.running_roll(live_workload))
    objects = render(Owner(name, ns, r.meta["uid"]), spec, plan, gpu, r.cfg.runtime_repository, r.cfg.engine_cache_root,
                     rollout=rollout)
    optional = day2.optional_kinds(objects)
    workload = next(o for o in objects if o["kind"] in ("Deployment", "LeaderWorkerSet"))
    r.out.status["image"] = engine_image(spec, plan, gpu, r.cfg.runtime_repository)
    if workload["kind"] != r.placed.live_kind:  # sizing chose the other kind than the spec alone says
        live_workload = r.kube.get(workload["kind"], ns, name)
    day2.hold_strategy(workload, live_workload, spec)  # roll numbers change when a roll starts, not between
    try:
        live_workload, optional_failed = _apply_objects(r, objects, workload, live_workload)
        _prune(r, workload, optional)
    except ApplyError as e:
        r.cond("Degraded", "True", e.reason, e.message)
        r.cond("Progressing", "False", e.reason, e.message)
        r.out.events.append(("Warning", e.reason, e.message))
        ERRORS.labels(e.reason).inc()
        r.out.retry_after = 30
        return r.finish(**r.planned())
    if optional_failed:
        e = optional_failed[0]
        if not r.has("Degraded", reason=e.reason):
            r.out.events.append(("Warning", e.reason, e.message))
        r.cond("Degraded", "True", e.reason, "workload applied; " + "; ".join(f.message for f in optional_failed))
        # a missing CRD appears without any event on this object: look again (the sweep runs only what is due)
        r.out.retry_after = min(r.out.retry_after or 30, 30)
    else:
        r.cond("Degraded", "False", "Applied", "workload applied")
    _picker_condition(r, optional, optional_failed)

    h = workload["metadata"]["annotations"]["moe.serving.dev/inputs-hash"]
    if status.get("inputsHash") != h:  # a new plan reached the pods: counted and told once
        decided(plan.engine.name, gpu, plan.moe.runnerBackend)
        r.out.events.append(("Normal", "Planned", f"{gpu.key()}: " + " | ".join(plan.reasons)))
        for w in plan.warnings:
            r.out.events.append(("Warning", "PlanWarning", w))
    return Applied(workload, live_workload, optional, rollout, h)


# ------------------------------------------------------------------------------------------------
# 4. readiness from the live workload

def ready(r: Run) -> Outcome:
    spec, gen, name = r.spec, r.gen, r.name
    plan, pending, a = r.placed.plan, r.placed.pending, r.applied
    rollout = a.rollout
    wst = (a.live_workload or {}).get("status") or {}
    ready, desired = int(wst.get("readyReplicas") or 0), spec.replicas
    # a roll: pods of an older template are still there (updatedReplicas counts the new ones)
    rolling = "updatedReplicas" in wst and int(wst.get("updatedReplicas") or 0) < desired
    if desired == 0:
        r.cond("Available", "True", "ScaledToZero", "replicas: 0")
        r.cond("Progressing", "False", "ScaledToZero", "replicas: 0")
    elif ready >= desired and not rolling:
        r.cond("Available", "True", "ReplicasReady", f"{ready}/{desired} replicas ready")
        r.cond("Progressing", "False", "Complete", f"{ready}/{desired} replicas ready; next roll: {rollout.message}")
    else:
        if ready >= desired:  # old pods still serve while the roll runs
            r.cond("Available", "True", "ReplicasReady", f"{ready}/{desired} replicas ready")
        else:
            r.cond("Available", "False", "ReplicasNotReady", f"{ready}/{desired} replicas ready")
        reason = rollout.progress_reason() if rolling else "RollingOut"  # why the roll goes as it goes
        r.cond("Progressing", "True", reason,
               f"{ready}/{desired} replicas ready, {wst.get('updatedReplicas', 0)} updated; " + rollout.message)
    return r.finish(**r.planned(), deferredFinalize=plan.moe.deferredFinalize, inputsHash=a.inputs_hash,
                    inventoryHash=r.placed.inv_fp,
                    workload=WorkloadRef(apiVersion=a.workload["apiVersion"], kind=a.workload["kind"],
                                         name=name).model_dump(),
                    replicas=spec.replicas, readyReplicas=ready,
                    selector=day2.selector_string(day2.serving_selector(name, spec.nodesPerReplica > 1)),
                    optionalObjects=a.optional,
                    planGeneration=r.status.get("planGeneration") if pending else gen,
                    pendingPlan={"diff": pending, "message": "held by spec.planPolicy pin"} if pending else None)


# The stages in order, each with the Run field its value goes to ("" for the last: its value is the Outcome).
STAGES = (("spec", policy), ("ckpt", checkpoint), ("placed", placement), ("spec", cache), ("applied", apply),
          ("", ready))
