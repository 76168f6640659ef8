"""One reconcile of a MoEDeployment: inspect -> place + plan -> render -> apply -> status.

Called by the kopf handlers (create/update/resume/timer) and by owned-object events. Idempotent:
server-side apply of the same objects changes nothing, so a restart or a resync is a no-op
when everything is already right.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

from moe_core.gpu import from_name
from pydantic import ValidationError

from .api import Condition, MoEDeploymentSpec, WorkloadRef
from .images import RUNTIME_REPOSITORY, runtime_image
from .inspection import InspectionFailed, InspectionPending, inspect_spec
from .inventory import ClassInventory, fingerprint
from .kube import ApplyError, Kube
from .metrics import DECISIONS, ERRORS
from .placement import place
from .render import Owner, render

log = logging.getLogger("moe_operator.reconcile")


@dataclass
class Config:
    runtime_repository: str = RUNTIME_REPOSITORY
    default_engine: str = "bundled"
    local_models_dir: str | None = None
    inspect_in_cluster: bool = True  # run inspection Jobs for paths the operator cannot read
    namespaces: list[str] = field(default_factory=list)  # watched namespaces (empty: all)
    admission: str | None = None  # HOST:PORT of the validating webhook kopf serves (None: off)


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


def reconcile(body: dict[str, Any], classes: dict[str, ClassInventory], kube: Kube, cfg: Config) -> Outcome:
    meta, status = body["metadata"], dict(body.get("status") or {})
    ns, name, gen = meta["namespace"], meta["name"], meta.get("generation")
    conds = list(status.get("conditions") or [])
    out = Outcome(status={})

    def finish(**fields: Any) -> Outcome:
        out.status.update(fields)
        out.status["conditions"] = conds
        out.status["observedGeneration"] = gen
        return out

    try:
        spec = MoEDeploymentSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:  # the CRD schema should have refused this; say so rather than crash
        conds = set_condition(conds, "Degraded", "True", "InvalidSpec", str(e), gen)
        ERRORS.labels("InvalidSpec").inc()
        return finish()

    # 1. checkpoint
    def hf_token() -> str | None:
        ref = spec.model.tokenSecretRef
        return kube.read_secret_key(ns, ref.name, ref.key) if ref else None

    def job(uri: str) -> dict[str, Any] | None:
        image = runtime_image(from_name("sm90"), cfg.runtime_repository)
        return kube.inspection_job(ns, {"name": name, "uid": meta["uid"]}, uri, image)

    try:
        ckpt = inspect_spec(spec, local_models_dir=cfg.local_models_dir, hf_token=hf_token,
                            pvc_job=job if cfg.inspect_in_cluster else None)
    except InspectionPending as e:
        conds = set_condition(conds, "CheckpointInspected", "Unknown", "Inspecting", str(e), gen)
        out.retry_after = 5
        return finish()
    except InspectionFailed as e:
        conds = set_condition(conds, "CheckpointInspected", "False", e.reason, e.message, gen)
        conds = set_condition(conds, "Planned", "False", "CheckpointNotInspected", "waiting for a readable checkpoint", gen)
        out.events.append(("Warning", "CheckpointInspectionFailed", e.message))
        ERRORS.labels(e.reason).inc()
        out.retry_after = 30 if e.retry else 300
        return finish()
    conds = set_condition(conds, "CheckpointInspected", "True", "Inspected",
                          f"{ckpt.architecture} {ckpt.format} ({ckpt.formatSource})", gen)

    # 2. placement + plan
    placement = place(spec, ckpt, classes, cfg.default_engine, current=status.get("gpuClass"))
    inv_fp = fingerprint(classes)
    if not placement.ok:
        msg = f"no GPU class can run this: {placement.explain()}"
        conds = set_condition(conds, "Planned", "False", "NoFeasibleGpuClass", msg, gen)
        conds = set_condition(conds, "Available", "False", "NotPlanned", "no plan", gen)
        if status.get("inventoryHash") != inv_fp or not any(
                c.get("type") == "Planned" and c.get("reason") == "NoFeasibleGpuClass" for c in status.get("conditions") or []):
            out.events.append(("Warning", "NoFeasibleGpuClass", msg))
        ERRORS.labels("NoFeasibleGpuClass").inc()
        return finish(checkpoint=ckpt.model_dump(), format=ckpt.format, inventoryHash=inv_fp)
    plan, inv = placement.plan, placement.inventory
    gpu = inv.gpu_class
    conds = set_condition(conds, "Planned", "True", "Planned",
                          f"{gpu.key()}: {plan.moe.runnerBackend} (deferred finalize "
                          f"{'on' if plan.moe.deferredFinalize else 'off'}); " + " ".join(plan.reasons[:3]), gen)

    # 3. render + apply
    objects = render(Owner(name, ns, meta["uid"]), spec, plan, gpu, cfg.runtime_repository)
    workload = next(o for o in objects if o["kind"] in ("Deployment", "LeaderWorkerSet"))
    stale_kind = "LeaderWorkerSet" if workload["kind"] == "Deployment" else "Deployment"
    try:
        for obj in objects:
            kube.apply(obj)
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
    conds = set_condition(conds, "Degraded", "False", "Applied", "workload applied", gen)

    h = workload["metadata"]["annotations"]["moe.serving.dev/inputs-hash"]
    if status.get("inputsHash") != h:
        DECISIONS.labels(plan.engine.name, gpu.family, plan.moe.runnerBackend).inc()
        out.events.append(("Normal", "Planned", f"{gpu.key()}: " + " | ".join(plan.reasons)))
        for w in plan.warnings:
            out.events.append(("Warning", "PlanWarning", w))

    # 4. readiness from the workload
    ready, desired = workload_readiness(kube, workload["kind"], ns, name, spec.replicas)
    if desired == 0:
        conds = set_condition(conds, "Available", "True", "ScaledToZero", "replicas: 0", gen)
        conds = set_condition(conds, "Progressing", "False", "ScaledToZero", "replicas: 0", gen)
    elif ready >= desired:
        conds = set_condition(conds, "Available", "True", "ReplicasReady", f"{ready}/{desired} replicas ready", gen)
        conds = set_condition(conds, "Progressing", "False", "Complete", f"{ready}/{desired} replicas ready", gen)
    else:
        conds = set_condition(conds, "Available", "False", "ReplicasNotReady", f"{ready}/{desired} replicas ready", gen)
        conds = set_condition(conds, "Progressing", "True", "RollingOut", f"{ready}/{desired} replicas ready", gen)
    return finish(checkpoint=ckpt.model_dump(), format=ckpt.format, gpuClass=gpu.key(),
                  runnerBackend=plan.moe.runnerBackend, deferredFinalize=plan.moe.deferredFinalize,
                  plan=plan.model_dump(), inputsHash=h, inventoryHash=inv_fp,
                  workload=WorkloadRef(apiVersion=workload["apiVersion"], kind=workload["kind"], name=name).model_dump(),
                  replicas=spec.replicas, readyReplicas=ready)


def workload_readiness(kube: Kube, kind: str, ns: str, name: str, desired: int) -> tuple[int, int]:
    live = kube.get(kind, ns, name) or {}
    st = live.get("status") or {}
    return int(st.get("readyReplicas") or 0), desired
