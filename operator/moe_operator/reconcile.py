"""One reconcile of a MoEDeployment: the stages policy -> checkpoint -> placement (+ plan) -> model
cache -> apply (render, drift check) -> ready, each a function of moe_operator.reconcile_stages that
returns its value or the early Outcome; this module runs them and turns what escapes into status.

Called by the kopf handlers, the resync sweep and owned-object events. Cheap when nothing changed:
the rendered objects are compared field by field with the live ones (one GET each) and applied only
when they differ; the caller writes status only when it changed. Every Kubernetes API error lands
in a condition and an Event instead of escaping.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes.client.rest import ApiException

from .conditions import rollup
from .images import RUNTIME_REPOSITORY
from .inventory import ClassInventory
from .kube import ApplyError, Kube, _api_message
from .metrics import ERRORS
from .policy import Policy
from .reconcile_stages import (GPU_CLASS_ANNOTATION, STAGES, Outcome, Run, _leaving_since,  # noqa: F401 (names of this module)
                               set_condition)

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


def _reconcile(body: dict[str, Any], classes: dict[str, ClassInventory], kube: Kube, cfg: Config) -> Outcome:
    """The stages in order (reconcile_stages.STAGES): each one's value goes to the run for the next,
    and the first Outcome is the reconcile's."""
    run = Run.start(body, classes, kube, cfg)
    for name, stage in STAGES:
        got = stage(run)
        if isinstance(got, Outcome):
            return got
        setattr(run, name, got)
    raise AssertionError("the last stage (ready) returns the Outcome")


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
