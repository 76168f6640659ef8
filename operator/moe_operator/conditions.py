"""The summary conditions of a MoEDeployment (issue 32 item 2), rolled up from the others. Pure.

`Ready`: the model serves the current spec: Available=True and Degraded not True, both observed
at the object's generation (a condition from an older generation says nothing about this one), and
nothing in BLOCKING (an InferencePool whose FailClose endpoint picker is missing fails every
request through the gateway).

`Reconciling` / `Stalled` follow kstatus's "abnormal-true" conditions (sigs.k8s.io/cli-utils
v0.37.2, pkg/kstatus/status/generic.go, checkGenericProperties): Reconciling=True reads as
InProgress, Stalled=True as Failed, before any other rule; then status.observedGeneration must equal
metadata.generation (checkGeneration), then a Ready condition decides (status.go, checkReadyCondition;
Ready=False is InProgress there, which is why a refusal needs Stalled=True to read as Failed).
Flux and `kubectl wait --for=condition=Ready` read the same three. Both are always written (False
when not so) so `kubectl get -o wide` and Argo CD's health check (charts/moe-operator/files/argocd/
health.lua) see a definite value.

Stalled: the operator cannot get further without a change by someone (the spec, the cluster's
policy, a missing CRD or endpoint picker, a hub repo that refuses or does not exist); it keeps
retrying, and the condition clears when the cause goes. Reconciling: work the operator is doing or
waiting for by itself (inspection, a hub that did not answer, the model cache filling, pods
starting, a roll).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

Cond = dict[str, Any]
# InferencePoolReady reasons (day2.endpoint_picker_condition) of a FailClose pool without a usable
# endpoint picker: every request through the gateway fails. Under FailOpen they end in "FailOpen".
# NoReadyEndpoints (no Ready pod in the pool) is not among them: pods starting are Available=False
# already, and a pool scaled to zero is a state the user chose, neither Stalled nor blocking Ready.
EPP_BLOCKING = ("EndpointPickerMissing", "EndpointPickerPortMissing", "EndpointPickerUnresolved")

# (type, status) -> reasons that mean "stuck until someone changes something"; None: every reason
STALLED: dict[tuple[str, str], frozenset[str] | None] = {
    ("Planned", "False"): frozenset({"PolicyViolation", "NoFeasibleGpuClass"}),
    # inspection failures the hub or the spec will not fix by themselves (inspection.py: retry=False,
    # and 401/403/404 from the hub); HubError, HubTimeout and Unreadable are retried: Reconciling
    ("CheckpointInspected", "False"): frozenset({"MalformedConfig", "Unauthorized", "Forbidden", "NotFound",
                                                 "UnsupportedURI", "NoInspector"}),
    ("ModelCacheReady", "False"): frozenset({"Failed"}),
    ("InferencePoolReady", "False"): frozenset(EPP_BLOCKING),
}
# Degraded=True is Stalled except for API errors a retry usually clears: reconcile.py's Api* reasons
# and kube.py's _apply_reason for 409 and 5xx (ApplyInvalid, a 422, and ApplyFailed need a change)
DEGRADED_TRANSIENT = frozenset({"ApiConflict", "ApiError", "ApiNotFound", "ApplyConflict", "ApiServerBusy"})
# conditions that hold Ready at False even with Available=True (the gateway path fails)
BLOCKING: dict[tuple[str, str], frozenset[str] | None] = {("InferencePoolReady", "False"): frozenset(EPP_BLOCKING)}
# (type, status) whose presence at this generation means work in progress (reason is kept)
RECONCILING: tuple[tuple[str, str], ...] = (
    ("CheckpointInspected", "Unknown"), ("CheckpointInspected", "False"), ("PlacementHeld", "True"),
    ("ModelCacheReady", "False"), ("Progressing", "True"), ("Available", "False"), ("Degraded", "True"),
)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _current(c: Cond, generation: int | None) -> bool:
    og = c.get("observedGeneration")
    return generation is None or og is None or og == generation


def _find(conds: list[Cond], type_: str, generation: int | None) -> Cond | None:
    c = next((c for c in conds if c.get("type") == type_), None)
    return c if c is not None and _current(c, generation) else None


def _matches(table: dict[tuple[str, str], frozenset[str] | None], c: Cond) -> bool:
    key = (c.get("type"), c.get("status"))
    if key not in table:
        return False
    reasons = table[key]
    return reasons is None or c.get("reason") in reasons


def _put(conds: list[Cond], type_: str, status: str, reason: str, message: str, generation: int | None,
         now: str) -> list[Cond]:
    old = next((c for c in conds if c.get("type") == type_), None)
    ltt = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    new: Cond = {"type": type_, "status": status, "reason": reason, "message": message[:32000],
                 "lastTransitionTime": ltt}
    if generation is not None:
        new["observedGeneration"] = generation
    return [c for c in conds if c.get("type") != type_] + [new]


def stalled_by(conds: list[Cond], generation: int | None) -> Cond | None:
    """The first condition at this generation that means Stalled, else None."""
    for c in conds:
        if not _current(c, generation):
            continue
        if _matches(STALLED, c) or (c.get("type") == "Degraded" and c.get("status") == "True"
                                    and c.get("reason") not in DEGRADED_TRANSIENT):
            return c
    return None


def reconciling_by(conds: list[Cond], generation: int | None) -> tuple[str, str] | None:
    """(reason, message) of the work in progress, else None. Available or Degraded missing or from
    an older generation is work in progress too (the new spec has not been through the pipeline)."""
    for type_, status in RECONCILING:
        c = _find(conds, type_, generation)
        if c is not None and c.get("status") == status:
            return c.get("reason") or type_, f"{type_}={status}: {c.get('message', '')}"
    if _find(conds, "Available", generation) is None:
        return "LatestGenerationNotObserved", f"generation {generation} has no Available condition yet"
    return None


def rollup(conds: list[Cond], generation: int | None, now: str | None = None) -> list[Cond]:
    """`conds` with Ready, Reconciling and Stalled set from the others (observedGeneration =
    `generation`). lastTransitionTime is kept while a condition's status stays."""
    now = now or _now()
    stalled = stalled_by(conds, generation)
    available = _find(conds, "Available", generation)
    degraded = _find(conds, "Degraded", generation)
    blocking = next((c for c in conds if _current(c, generation) and _matches(BLOCKING, c)), None)
    serving = (available is not None and available.get("status") == "True"
               and not (degraded is not None and degraded.get("status") == "True") and blocking is None)
    busy = None if stalled else reconciling_by(conds, generation)
    if serving and busy and busy[0] == "LatestGenerationNotObserved":
        busy = None
    if serving:
        ready = ("True", available.get("reason") or "Available", available.get("message", ""))
    elif stalled is not None:
        ready = ("False", stalled["reason"], f"{stalled['type']}={stalled['status']}: {stalled.get('message', '')}")
    elif blocking is not None:
        ready = ("False", blocking["reason"], blocking.get("message", ""))
    elif busy is not None:
        ready = ("False", busy[0], busy[1])
    else:
        ready = ("False", "NotAvailable", "no Available=True condition at this generation")
    out = _put(conds, "Ready", *ready, generation, now)
    if stalled is not None:
        out = _put(out, "Stalled", "True", stalled["reason"], ready[2], generation, now)
    else:
        out = _put(out, "Stalled", "False", "NotStalled", "", generation, now)
    if busy is not None:
        out = _put(out, "Reconciling", "True", busy[0], busy[1], generation, now)
    else:
        out = _put(out, "Reconciling", "False", "Stalled" if stalled is not None else "ReconcileComplete", "",
                   generation, now)
    return out
