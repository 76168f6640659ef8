"""A token Secret that loses its moe.serving.dev/model-token label takes the token out of the workload.

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


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=INTERVAL, initial_delay=INTERVAL)
async def token_revocation(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    st = memo["state"]
    msg = await asyncio.to_thread(check, st.kube, st.cfg, dict(body))
    if msg:
        log.warning("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], msg)
        kopf.warn(dict(body), reason="TokenRevoked", message=msg)
