"""A token Secret that loses its moe.serving.dev/model-token label takes the token out of the workload;
a policy that tightens under a running workload scales it to zero when the admin asks for that.

The label consents to the token's use; taking it away must end that use, not only refuse the next
change. The reconcile then reports PolicyViolation and renders nothing; this removes, from the
workload already running, every env entry that reads the Secret (engine and init containers of every
pod template), so the pods roll without it, and posts a TokenRevoked Event. The decision is pure
(`strip_token`); `check` is the I/O of one object.

One operator-level loop (`run`) checks every MoEDeployment each INTERVAL, as the per-object kopf
timer did, without its cost (issue 34): a kopf timer is a task per object, an INFO line per object
per interval, and a finalizer kopf puts on every MoEDeployment (a timer requires one), so deleting
an object took the operator's write and was blocked while the operator was down. The objects are
read from the MoEDeployment watch cache and the workloads from the owned-object cache; a Secret that
several objects name is read once per pass. Secrets are read with a GET, not watched: a watch needs
list/watch on Secrets, which RBAC cannot narrow to labelled ones (it would let the operator read
every Secret of the cluster).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import os
from typing import Any, Callable

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


def check(kube, cfg, body: dict[str, Any],
          secret_labels: Callable[[str, str], dict[str, str] | None] | None = None) -> str | None:
    """Strip a revoked token from the MoEDeployment's workload; returns the Event message, or None.
    `secret_labels(namespace, name)`: how the Secret's labels are read (default kube.secret_labels)."""
    ref = ((body.get("spec") or {}).get("model") or {}).get("tokenSecretRef")
    wl = (body.get("status") or {}).get("workload")
    if not ref or not wl or not cfg.policy.require_token_label:
        return None
    ns = body["metadata"]["namespace"]
    if not revoked((secret_labels or kube.secret_labels)(ns, ref["name"])):
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


def sweep(kube, cfg, moeds: list[dict[str, Any]]) -> tuple[list[tuple[dict[str, Any], str, str]], list[str]]:
    """One pass over `moeds` (blocking I/O): ([(object, Event reason, message)] for what was done,
    [failure lines]). A Secret is read once per pass however many objects name it; one object's
    failure does not stop the others."""
    labels: dict[tuple[str, str], dict[str, str] | None] = {}

    def secret_labels(ns: str, name: str) -> dict[str, str] | None:
        if (ns, name) not in labels:
            labels[(ns, name)] = kube.secret_labels(ns, name)
        return labels[(ns, name)]

    acted, failed = [], []
    for body in moeds:
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp") or not (body.get("status") or {}).get("workload"):
            continue  # going, or nothing running yet: nothing to take away
        for fn, reason in ((functools.partial(check, secret_labels=secret_labels), "TokenRevoked"),
                           (enforce, "PolicyEnforced")):
            try:
                msg = fn(kube, cfg, body)
            except Exception as e:  # noqa: BLE001 - the next pass retries it
                failed.append(f"{meta.get('namespace')}/{meta.get('name')}: {type(e).__name__}: "
                              + (str(e).splitlines() or [""])[0][:300])
                continue
            if msg:
                acted.append((body, reason, msg))
    return acted, failed


async def run(st: Any, interval: float | None = None) -> None:
    """The loop: every `interval` (INTERVAL), one `sweep` of every MoEDeployment (from the watch
    cache once it is synced), each action logged and posted as a Warning Event. `st` is the
    handlers' State (kube, cfg, io, quiet)."""
    interval = INTERVAL if interval is None else interval
    while True:
        await asyncio.sleep(interval)
        leading = getattr(st, "leading", None)
        if leading is not None:
            await leading.wait_for(True)  # a standby revokes nothing (kopf paused this replica)
        try:
            moeds = await st.io(st.kube.list_moeds, st.cfg.namespaces, True)
            acted, failed = await st.io(sweep, st.kube, st.cfg, moeds)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - listing failed (an API outage): the next pass retries
            st.quiet.failed("token revocation", f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0][:300],
                            f"retried in {interval:g}s")
            continue
        for line in failed:
            st.quiet.failed("token revocation", line, f"retried in {interval:g}s")
        if not failed:
            st.quiet.ok("token revocation")
        for body, reason, msg in acted:
            meta = body["metadata"]
            log.warning("%s/%s: %s", meta["namespace"], meta["name"], msg)
            try:
                await st.io(st.kube.post_event, body, "Warning", reason, msg)
            except Exception as e:  # noqa: BLE001 - the action is done; only its Event is lost
                st.quiet.failed("posting Events", f"{reason} on {meta['namespace']}/{meta['name']}: {e}", "not retried")
