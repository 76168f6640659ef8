"""Day-2 objects of a MoEDeployment (issue 22): rollout policy, PodDisruptionBudget, autoscaler
(HPA or KEDA ScaledObject) and the gateway's InferencePool. Pure: dicts from the spec, the plan's
engine and what the inventory sees; render.py adds them to the objects it returns.

Rollout defaults follow free capacity: when a spare GPU set of the planned class is free, a roll
surges one replica onto it (no replica is down); when every GPU set of the class is taken, a surge
pod would wait forever for a GPU that never frees, so the roll replaces one replica at a time
(maxSurge 0, maxUnavailable 1) and the Progressing condition says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from moe_core.plan import Plan
from pydantic import ValidationError

from . import epp
from .api import MoEDeploymentSpec
from .engines import registry as engines

TEMPLATES = Path(__file__).parent / "templates"
_env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                          keep_trailing_newline=True)

# Kinds render() may or may not return for one MoEDeployment: reconcile prunes those it rendered
# before and no longer does (status.optionalObjects). Kinds whose CRD is optional in a cluster get
# a condition, not a failed reconcile, when the CRD is missing.
OPTIONAL_KINDS = ("PodDisruptionBudget", "HorizontalPodAutoscaler", "ScaledObject", "InferencePool")
OPTIONAL_CRDS = {"ScaledObject": ("KedaMissing", "spec.autoscaling.provider keda needs KEDA's ScaledObject CRD "
                                  "(keda.sh/v1alpha1); install KEDA (kedacore/keda) or use provider hpa"),
                 "InferencePool": ("InferencePoolCrdMissing", "spec.gateway.inferencePool needs the InferencePool CRD "
                                   "(inference.networking.k8s.io/v1); install the Gateway API Inference Extension "
                                   "(kubernetes-sigs/gateway-api-inference-extension) CRDs")}

# The Prometheus names an autoscaler or a gateway reads are each engine's (Engine.metrics, engines/<engine>/engine.py);
# kv values are fractions (0-1) in every engine.
DEFAULT_TARGET = {"queue": 4, "kv": 80}
EPP_PORT = 9002
# InferencePoolReady=False reasons that get no Warning Event: every new pool passes through them
# while its pods start (the condition says it; an Event per rollout would be noise)
QUIET_REASONS = ("NoReadyEndpoints",)
POOL_LABEL = "moe.serving.dev/inference-pool"  # serving pods of every MoEDeployment sharing a pool


@dataclass(frozen=True)
class Rollout:
    max_surge: int
    max_unavailable: int
    spare_sets: int  # free GPU sets (one replica's worth) of the planned class
    gpu_class: str
    message: str  # why these numbers, for the Progressing condition while a roll runs
    kept: bool = False  # the numbers a running roll started with (free capacity changes under it)

    def progress_reason(self) -> str:
        """Progressing's reason while a roll runs."""
        if self.kept:  # what the roll started with, whatever frees up under it
            return "RollingOut" if self.max_surge > 0 else "RollingOneAtATime"
        if self.spare_sets > 0:
            return "RollingOut"
        return "WaitingForCapacity" if self.max_surge > 0 and self.max_unavailable == 0 else "RollingOneAtATime"


def rollout_policy(spec: MoEDeploymentSpec, gpu_class: str, spare_sets: int,
                   running: tuple[int, int] | None = None) -> Rollout:
    """maxSurge/maxUnavailable: the user's where set, else from the spare GPU sets of the class.

    `running`: (maxSurge, maxUnavailable) of a roll in progress. Its defaults are kept until it
    completes: a surge pod takes the spare GPU set, and switching that roll to maxUnavailable 1
    would take down a replica the surge was there to keep."""
    r = spec.rollout
    if running is not None and (r.maxSurge is None or r.maxUnavailable is None):
        surge = r.maxSurge if r.maxSurge is not None else running[0]
        unavailable = r.maxUnavailable if r.maxUnavailable is not None else running[1]
        if surge + unavailable > 0:
            return Rollout(surge, unavailable, spare_sets, gpu_class,
                           f"roll in progress with maxSurge {surge}, maxUnavailable {unavailable} (kept from its start)",
                           kept=True)
    spare = spare_sets > 0
    surge = r.maxSurge if r.maxSurge is not None else (1 if spare else 0)
    unavailable = r.maxUnavailable if r.maxUnavailable is not None else (0 if spare else 1)
    if surge + unavailable == 0:  # one of them was given as 0 and the other defaulted to 0
        if r.maxSurge is not None:
            unavailable = 1
        else:
            surge = 1
    numbers = f"maxSurge {surge}, maxUnavailable {unavailable}"
    if not spare and surge > 0:
        msg = (f"no free capacity of class {gpu_class}: a surge replica waits for a free GPU set "
               f"({numbers}, set by spec.rollout)")
    elif not spare:
        msg = f"no free capacity of class {gpu_class}: rolling one replica at a time ({numbers})"
    elif surge > 0:
        msg = f"{spare_sets} free GPU set(s) of class {gpu_class}: surging onto free capacity ({numbers})"
    else:
        msg = f"replacing replicas in place ({numbers}, set by spec.rollout)"
    return Rollout(surge, unavailable, spare_sets, gpu_class, msg)


def running_roll(live: dict[str, Any] | None) -> tuple[int, int] | None:
    """(maxSurge, maxUnavailable) of the live Deployment or LeaderWorkerSet while it rolls, else None."""
    if not live:
        return None
    spec, st = live.get("spec") or {}, live.get("status") or {}
    cfg = ((spec.get("strategy") or {}).get("rollingUpdate")
           or ((spec.get("rolloutStrategy") or {}).get("rollingUpdateConfiguration")))
    if not cfg or not all(isinstance(cfg.get(k), int) for k in ("maxSurge", "maxUnavailable")):
        return None
    want = int(spec.get("replicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    rolling = (st.get("observedGeneration") or 0) < (live.get("metadata") or {}).get("generation", 0) \
        or updated < want or int(st.get("replicas") or 0) > updated
    return (cfg["maxSurge"], cfg["maxUnavailable"]) if rolling else None


def hold_strategy(workload: dict[str, Any], live: dict[str, Any] | None, spec: MoEDeploymentSpec) -> bool:
    """Free capacity decides a roll's numbers when the roll starts. While the pods stay as they are
    (the rendered pod template is the live one) the live numbers stay: free GPUs come and go with
    every pod elsewhere, and re-rendering the strategy on each change would rewrite the workload
    for nothing. Sets the rendered defaults to the live ones; the user's explicit values win.
    Returns whether it did."""
    from .drift import differences

    if not live:
        return False
    template = "template" if workload["kind"] == "Deployment" else "leaderWorkerTemplate"
    outer, inner = (("strategy", "rollingUpdate") if workload["kind"] == "Deployment"
                    else ("rolloutStrategy", "rollingUpdateConfiguration"))
    live_spec = live.get("spec") or {}
    live_cfg = (live_spec.get(outer) or {}).get(inner) or {}
    if not all(isinstance(live_cfg.get(k), int) for k in ("maxSurge", "maxUnavailable")):
        return False
    if differences(workload["spec"][template], live_spec.get(template)):
        return False  # a roll starts now: the numbers come from the capacity seen now
    cfg = workload["spec"][outer][inner]
    held = {"maxSurge": spec.rollout.maxSurge if spec.rollout.maxSurge is not None else live_cfg["maxSurge"],
            "maxUnavailable": (spec.rollout.maxUnavailable if spec.rollout.maxUnavailable is not None
                               else live_cfg["maxUnavailable"])}
    if held["maxSurge"] + held["maxUnavailable"] == 0 or held == cfg:
        return False
    cfg.update(held)
    return True


def spare_gpu_sets(free_per_node: dict[str, int], gpus_per_node: int, nodes_per_replica: int) -> int:
    """How many more replicas fit on the free GPUs of a class (whole nodes' worth per replica)."""
    fitting = sum(1 for free in free_per_node.values() if free >= gpus_per_node)
    return fitting // max(nodes_per_replica, 1)


def serving_selector(name: str, multi_node: bool) -> dict[str, str]:
    """Labels of the pods that serve HTTP (a LeaderWorkerSet's leaders; every pod of a Deployment)."""
    return {"app.kubernetes.io/instance": name, "moe.serving.dev/deployment": name,
            "moe.serving.dev/role": "leader" if multi_node else "single"}


def selector_string(selector: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def _load(template: str, **kw: Any) -> dict[str, Any]:
    return yaml.safe_load(_env.get_template(template).render(**kw))


def pod_disruption_budget(name: str, namespace: str, labels: dict[str, str], selector: dict[str, str],
                          spec: MoEDeploymentSpec) -> dict[str, Any] | None:
    """One per MoEDeployment with replicas > 1. A multi-node replica is down when any of its pods
    is, so its budget counts pods unavailable (replicas - minAvailable): a drain never takes a pod
    of a second group while one is down."""
    if spec.replicas <= 1:
        return None
    keep = spec.rollout.minAvailable if spec.rollout.minAvailable is not None else spec.replicas - 1
    keep = min(keep, spec.replicas)
    budget = {"minAvailable": keep} if spec.nodesPerReplica == 1 else {"maxUnavailable": spec.replicas - keep}
    return _load("pdb.yaml.j2", name=name, namespace=namespace, labels=labels, selector=selector, budget=budget)


def _metric(spec: MoEDeploymentSpec) -> tuple[str, int]:
    a = spec.autoscaling
    return engines.get(spec.engine.name).metrics[a.metric], a.target or DEFAULT_TARGET[a.metric]


def _pod_regex(name: str, multi_node: bool) -> str:
    # Deployment pods: NAME-<template hash>-<5>; LeaderWorkerSet leaders: NAME-<group index>
    return f"{name}-[0-9]+" if multi_node else f"{name}-[a-z0-9]+-[a-z0-9]{{5}}"


def autoscaler(name: str, namespace: str, labels: dict[str, str], spec: MoEDeploymentSpec) -> dict[str, Any] | None:
    """An HPA (autoscaling/v2, Pods metric through a custom-metrics adapter) or a KEDA ScaledObject
    (Prometheus trigger), both targeting the MoEDeployment's scale subresource."""
    a = spec.autoscaling
    if not a.enabled:
        return None
    prom_name, target = _metric(spec)
    kw = dict(name=name, namespace=namespace, labels=labels, min_replicas=a.minReplicas, max_replicas=a.maxReplicas)
    if a.provider == "hpa":
        metric_name = a.metricName or prom_name.replace(":", "_")
        value = str(target) if a.metric == "queue" else f"{target * 10}m"  # percent -> fraction (80 -> 800m)
        return _load("hpa.yaml.j2", **kw, metric_name=metric_name, average_value=value)
    where = f'namespace="{namespace}",pod=~"{_pod_regex(name, spec.nodesPerReplica > 1)}"'
    if a.metric == "queue":  # waiting requests in all replicas, spread over replicas (AverageValue)
        query, metric_type, threshold = f"sum({prom_name}{{{where}}})", "AverageValue", str(target)
    else:  # mean KV-cache use of the replicas against the target fraction
        query, metric_type, threshold = f"avg({prom_name}{{{where}}})", "Value", f"{target / 100:g}"
    return _load("scaledobject.yaml.j2", **kw, server=a.prometheusAddress, query=query, metric_type=metric_type,
                 threshold=threshold)


def pool_pod_labels(spec: MoEDeploymentSpec, role: str) -> dict[str, str]:
    """The shared pool's label, on the pods that serve HTTP (not a LeaderWorkerSet's workers)."""
    p = spec.gateway.inferencePool
    return {POOL_LABEL: p.poolName} if p.enabled and p.poolName and role != "worker" else {}


def pool_selector(name: str, spec: MoEDeploymentSpec) -> dict[str, str]:
    """The labels the rendered InferencePool selects: the serving pods of this MoEDeployment, or of
    every MoEDeployment sharing spec.gateway.inferencePool.poolName."""
    p = spec.gateway.inferencePool
    return {POOL_LABEL: p.poolName} if p.poolName else serving_selector(name, spec.nodesPerReplica > 1)


def inference_pool(name: str, namespace: str, labels: dict[str, str], selector: dict[str, str], port: int,
                   spec: MoEDeploymentSpec) -> dict[str, Any] | None:
    p = spec.gateway.inferencePool
    if not p.enabled:
        return None
    if p.poolName:  # shared: the MoEDeployment named like the pool renders it; the others only join
        if p.poolName != name:
            return None
        selector = pool_selector(name, spec)
    epp_name, epp_port, failure_mode = endpoint_picker_ref(name, spec)
    return _load("inferencepool.yaml.j2", name=name, namespace=namespace, labels=labels, selector=selector, port=port,
                 epp_name=epp_name, epp_port=epp_port, failure_mode=failure_mode)


def ready_endpoints(pods: list[dict[str, Any]]) -> int:
    """How many of `pods` (API JSON) the endpoint picker routes to: Ready=True, with a pod IP, not
    being deleted, as the picker's pod reconciler keeps them in its datastore (gateway-api-inference-
    extension v1.0.1 pkg/epp/controller/pod_reconciler.go: podutil.IsPodReady and the pool's labels)."""
    def ready(pod: dict[str, Any]) -> bool:
        st = pod.get("status") or {}
        return (not (pod.get("metadata") or {}).get("deletionTimestamp") and bool(st.get("podIP"))
                and any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []))
    return sum(1 for p in pods if ready(p))


def endpoint_picker_ref(name: str, spec: MoEDeploymentSpec) -> tuple[str, int, str]:
    """(Service name, port, failure mode) of the endpoint picker the pool names."""
    epp = spec.gateway.inferencePool.endpointPicker
    return (epp.name or f"{name}-epp", epp.port, epp.failureMode) if epp else (f"{name}-epp", EPP_PORT, "FailClose")


def endpoint_picker_condition(name: str, spec: MoEDeploymentSpec, service: dict[str, Any] | None,
                              pool: dict[str, Any] | None, ready: int | None = None) -> tuple[str, str, str] | None:
    """(status, reason, message) of the InferencePoolReady condition, None when this MoEDeployment
    renders no pool (none asked for, or it joins another's shared pool).

    The pool needs its endpoint picker (EPP): the pool's endpointPickerRef must name a Service in
    the namespace. Without it a gateway calling the pool with failureMode FailClose fails every
    request, so its absence is reported first: the Service (`service`, None when missing) and its
    port, then what the gateways say of the live pool (`pool`: status.parents[].conditions
    ResolvedRefs, InvalidExtensionRef when they cannot reach the picker; gateway-api-inference-
    extension v1.0.1 api/v1/inferencepool_types.go). Then the pool must have somewhere to send a
    request: `ready`, the pool's ready endpoints (ready_endpoints of the pods pool_selector picks);
    True needs at least one. None: not counted (a caller that did not list the pods; the verdict is
    the picker's alone and the message says so)."""
    p = spec.gateway.inferencePool
    if not p.enabled or (p.poolName and p.poolName != name):
        return None
    epp, port, mode = endpoint_picker_ref(name, spec)
    open_ = mode == "FailOpen"  # the same causes end in "FailOpen": they only say so (conditions.EPP_BLOCKING)

    def bad(reason: str, why: str) -> tuple[str, str, str]:
        effect = ("failureMode FailOpen: the gateway routes to the pool's pods without it" if open_ else
                  "failureMode FailClose: the gateway fails every request to this pool")
        return ("False", reason + ("FailOpen" if open_ else ""),
                f"InferencePool {name}: {why}; {effect}. Let the operator deploy the endpoint picker (epp) "
                "(spec.gateway.inferencePool.endpointPicker.deploy, the default unless endpointPicker.name is set), "
                f"or deploy yours for pool {name} behind Service {epp} port {port} and name it in "
                "spec.gateway.inferencePool.endpointPicker")
    if service is None:
        return bad("EndpointPickerMissing", f"endpoint picker Service {epp!r} not found in the namespace")
    ports = [q.get("port") for q in ((service.get("spec") or {}).get("ports") or [])]
    if port not in ports:
        return bad("EndpointPickerPortMissing", f"Service {epp!r} has no port {port} (it has {ports or 'none'})")
    for parent in (((pool or {}).get("status") or {}).get("parents") or []):
        gateway = ((parent.get("parentRef") or {}).get("name")) or "a gateway"
        for c in parent.get("conditions") or []:
            if c.get("type") == "ResolvedRefs" and c.get("status") == "False":
                return bad("EndpointPickerUnresolved", f"{gateway} cannot use the endpoint picker: "
                           f"{c.get('reason', '')}: {c.get('message', '')}".rstrip(": "))
    found = f"endpoint picker Service {epp}:{port} ({mode})"
    if ready is None:
        return ("True", "EndpointPickerFound", f"{found}; ready endpoints not counted")
    selected = selector_string(pool_selector(name, spec))
    if ready < 1:
        return ("False", "NoReadyEndpoints",
                f"InferencePool {name}: no ready endpoint (no Ready pod with labels {selected}): the gateway has "
                f"nowhere to send a request; {found}")
    return ("True", "EndpointPickerFound",
            f"{ready} ready endpoint{'s' if ready != 1 else ''} (pods {selected}); {found}")


def endpoint_picker(name: str, namespace: str, spec: MoEDeploymentSpec) -> list[dict[str, Any]]:
    """The picker's objects (epp.py) when this MoEDeployment renders the pool and its endpointPicker
    deploys (the default); none for a picker of the user's own (endpointPicker.name, deploy unset)."""
    p = spec.gateway.inferencePool
    if not p.enabled or (p.poolName and p.poolName != name):
        return []
    ref = p.endpointPicker
    if ref is not None and not ref.deploys():
        return []
    service, port, _ = endpoint_picker_ref(name, spec)
    engine = engines.get(spec.engine.name)
    return epp.objects(name, namespace, service, port, ref.replicas if ref else 1, ref.image if ref else None,
                       engine.metrics["queue"], engine.metrics["kv"], lora_metric=engine.lora_metric)


def optional_kinds(objs: list[dict[str, Any]]) -> list[str]:
    """status.optionalObjects: the optional kinds rendered (pruned under the MoEDeployment's name)
    and one EndpointPicker/<service> per deployed picker (pruned by its own names, epp.stale). The
    picker's Deployment and Service never count as optional kinds: pruning those by kind would
    delete the workload and its Service."""
    return sorted({o["kind"] for o in objs if o["kind"] in OPTIONAL_KINDS and not epp.is_picker(o)}) + epp.markers(objs)


def stale_objects(name: str, before: list[str], now: list[str]) -> list[tuple[str, str]]:
    """(kind, object name) to delete: what was rendered before (status.optionalObjects) and is not now."""
    kinds = [(k, name) for k in sorted(set(before) - set(now)) if k in OPTIONAL_KINDS]
    return kinds + epp.stale(before, now)


def picker_not_owned(obj: dict[str, Any], live: dict[str, Any] | None, uid: str) -> str | None:
    """For reconcile, before applying `obj`: why a picker object must not go over the live one (epp.not_owned)."""
    return epp.not_owned(obj, live, uid) if epp.is_picker(obj) else None


def prunable(obj_name: str, name: str, live: dict[str, Any] | None, uid: str) -> bool:
    """Whether reconcile may delete a stale object: one under the MoEDeployment's own name, or a picker
    object it controls (a Service <name>-epp made by hand is never deleted)."""
    return obj_name == name or (live is not None and epp.controlled(live, uid))


def is_picker(obj: dict[str, Any]) -> bool:
    """One of the endpoint picker's objects (epp.py), not the workload's."""
    return epp.is_picker(obj)


def is_optional(obj: dict[str, Any]) -> bool:
    """An apply failure of it is reported (Degraded) without holding back the rest of the reconcile."""
    return obj["kind"] in OPTIONAL_KINDS or epp.is_picker(obj)


def objects(name: str, namespace: str, labels: dict[str, str], pod_selector: dict[str, str], port: int,
            spec: MoEDeploymentSpec) -> list[dict[str, Any]]:
    """The optional objects for one MoEDeployment, in apply order (after the workload)."""
    serving = serving_selector(name, spec.nodesPerReplica > 1)
    out = [pod_disruption_budget(name, namespace, labels, pod_selector, spec), autoscaler(name, namespace, labels, spec),
           inference_pool(name, namespace, labels, serving, port, spec)]
    return [o for o in out if o is not None] + endpoint_picker(name, namespace, spec)


# --- plan policy: pin holds plan changes the spec did not cause ----------------------------------
# The parts of a plan that change the pods (layout follows the spec and the sizing, not the rules).
PLAN_DECISIONS = ("engine", "moe", "env", "args")


def plan_diff(old: dict[str, Any], new: Plan) -> list[str]:
    """What would change in the pods, one line per field: 'moe.runnerBackend: a -> b'."""
    now = new.model_dump(mode="json")
    out = []
    for key in PLAN_DECISIONS:
        o, n = old.get(key), now.get(key)
        if isinstance(n, dict) or isinstance(o, dict):
            o, n = o or {}, n or {}
            for k in sorted(set(o) | set(n)):
                if o.get(k) != n.get(k):
                    out.append(f"{key}.{k}: {o.get(k)!r} -> {n.get(k)!r}")
        elif (o or []) != (n or []):
            out.append(f"{key}: {' '.join(o or []) or '(none)'} -> {' '.join(n or []) or '(none)'}")
    return out


def held_plan(spec: MoEDeploymentSpec, status: dict[str, Any], new: Plan, gpu_class: str,
              generation: int | None) -> tuple[Plan, list[str]]:
    """Under planPolicy pin, the plan status records for this very generation of the spec stays
    while the GPU class is the same: a new plan then comes from the operator (new rule tables after
    an upgrade, a driver rule), not from the user, and waits until the spec changes. Returns the
    plan to render and the pending diff (empty: nothing held)."""
    old = status.get("plan")
    if spec.planPolicy != "pin" or not old or generation is None or status.get("planGeneration") != generation \
            or status.get("gpuClass") != gpu_class:
        return new, []
    try:
        running = Plan.model_validate(old)
    except ValidationError:  # a plan an older operator wrote in another shape: nothing to hold
        return new, []
    diff = plan_diff(old, new)
    return (running, diff) if diff else (new, [])
