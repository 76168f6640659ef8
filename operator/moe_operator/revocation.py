"""A token Secret that loses its moe.serving.dev/model-token label takes the token out of the workload;
a policy that tightens under a running workload scales it to zero when the admin asks for that.

The label consents to the token's use; taking it away must end that use, not only refuse the next
change. The reconcile then reports PolicyViolation and renders nothing; this removes, from the
workload already running, every env entry that reads the Secret (engine and init containers of every
pod template), so the pods roll without it, and posts a TokenRevoked Event. The decision is pure
(`strip_token`); `check` is the I/O, run on a timer per MoEDeployment.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from typing import Any

import kopf

from . import API_GROUP, API_VERSION, PLURAL
from .api import MoEDeploymentSpec
from .policy import TOKEN_SECRET_LABEL

log = logging.getLogger("moe_operator.revocation")
INTERVAL = float(os.environ.get("MOE_RESYNC_SECONDS", "30"))
_TEMPLATES = (("template",), ("leaderWorkerTemplate", "leaderTemplate"), ("leaderWorkerTemplate", "workerTemplate"))


def strip_token(workload: dict[str, Any], secret: str) -> dict[str, Any] | None:
    """The workload with every env entry that reads Secret `secret` removed from its pod templates'
    containers and init containers; None when there is none."""
    out = copy.deepcopy(workload)
    changed = False
    for path in _TEMPLATES:
        node: Any = out.get("spec") or {}
        for k in path:
            node = (node or {}).get(k)
        pod = (node or {}).get("spec") or {}
        for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
            env = c.get("env") or []
            kept = [e for e in env if ((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name") != secret]
            if len(kept) != len(env):
                c["env"], changed = kept, True
    return out if changed else None


def revoked(labels: dict[str, str] | None) -> bool:
    """The Secret is gone or no longer marked for model-token use."""
    return labels is None or labels.get(TOKEN_SECRET_LABEL) != "true"


def check(kube, cfg, body: dict[str, Any]) -> str | None:
    """Strip a revoked token from the MoEDeployment's workload; returns the Event message, or None."""
    ref = ((body.get("spec") or {}).get("model") or {}).get("tokenSecretRef")
    wl = (body.get("status") or {}).get("workload")
    if not ref or not wl or not cfg.policy.require_token_label:
        return None
    ns = body["metadata"]["namespace"]
    if not revoked(kube.secret_labels(ns, ref["name"])):
        return None
    live = kube.get(wl["kind"], ns, wl["name"])
    stripped = strip_token(live, ref["name"]) if live else None
    if stripped is None:
        return None
    kube.merge_patch(stripped)  # lists replaced whole: the entries are gone whoever added them
    return (f"Secret {ref['name']!r} is no longer labelled {TOKEN_SECRET_LABEL}=true (or is gone): its token was "
            f"removed from {wl['kind']} {wl['name']}")


def scale_to_zero(workload: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch that scales a Deployment or LeaderWorkerSet to 0 replicas; None when it is
    at 0 already."""
    if not ((workload.get("spec") or {}).get("replicas") or 0):
        return None
    meta = workload["metadata"]
    return {"apiVersion": workload.get("apiVersion"), "kind": workload["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "spec": {"replicas": 0}}


def enforce(kube, cfg, body: dict[str, Any]) -> str | None:
    """A policy that tightened under a running workload, with policy.onViolation scaleToZero: scale
    the workload to 0 (the reconcile renders nothing for the object meanwhile, so nothing scales it
    back until the spec or the policy allows it again); returns the Event message, or None."""
    if getattr(cfg.policy, "on_violation", "keep") != "scaleToZero":
        return None
    wl = (body.get("status") or {}).get("workload")
    if not wl:
        return None
    try:
        spec = MoEDeploymentSpec.model_validate(body.get("spec") or {})
    except ValueError:
        return None  # InvalidSpec is the reconcile's to report
    problems = cfg.policy.problems(spec)
    if not problems:
        return None
    ns = body["metadata"]["namespace"]
    live = kube.get(wl["kind"], ns, wl["name"])
    patch = scale_to_zero(live) if live else None
    if patch is None:
        return None
    kube.merge_patch(patch)
    return (f"the cluster's policy no longer allows this spec ({'; '.join(problems)}): {wl['kind']} {wl['name']} "
            "scaled to 0 replicas (policy.onViolation scaleToZero); it comes back once the spec or the policy allows it")


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=INTERVAL, initial_delay=INTERVAL)
async def token_revocation(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    st = memo["state"]
    for fn, reason in ((check, "TokenRevoked"), (enforce, "PolicyEnforced")):
        msg = await asyncio.to_thread(fn, st.kube, st.cfg, dict(body))
        if msg:
            log.warning("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], msg)
            kopf.warn(dict(body), reason=reason, message=msg)
