"""The pvc:// (and node-only file://) inspection Job: started by the operator, read back by UID.

The Job's name is predictable (`moe-inspect-<sha256(uri)[:10]>`) and anyone who may create Jobs or
Pods in the namespace could make one of that name, or a pod carrying its `job-name` label, with a
forged termination message: the checkpoint facts the planner then trusts. So a result is read only
from a Job whose UID the operator recorded when it created it (the ledger in its own namespace,
cache_ledger.py, which survives restarts), and only from pods that Job controls (controller owner
reference with the Job's UID). A same-named Job the operator did not make is reported, not used,
and never deleted. A Job whose create answer was lost is the operator's only by the random create
token this process sent with it (Kube.landed).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from . import model_cache
from .render import Owner, inspection_job


def job_name(uri: str) -> str:
    return "moe-inspect-" + hashlib.sha256(uri.encode()).hexdigest()[:10]


def _uid(obj: Any) -> str | None:
    if isinstance(obj, dict):
        return (obj.get("metadata") or {}).get("uid")
    meta = getattr(obj, "metadata", None)
    return getattr(meta, "uid", None)


def controlled_by(pod: Any, job_uid: str) -> bool:
    """The pod's controller is this very Job (the Job controller sets it; a label says nothing)."""
    refs = getattr(getattr(pod, "metadata", None), "owner_references", None) or []
    return any(getattr(r, "uid", None) == job_uid and getattr(r, "controller", False) for r in refs)


def result(kube, namespace: str, owner: Owner, uri: str, image: str) -> dict[str, Any] | None:
    """Start (or look at) the inspection Job for `uri`: None while it runs, else the parsed result
    (`{"error": ...}` for a failure, an untrusted Job included)."""
    rec = model_cache.RECORD
    rec.sync(kube)
    name = job_name(uri)
    job = kube.get("Job", namespace, name)
    if job is None:
        made = kube.create(inspection_job(namespace, name, uri, image, owner))  # None: the name is taken
        uid = _uid(made or {})
        if uid:
            rec.inspect_jobs[(namespace, name)] = uid
            rec.save(kube)
        return None
    uid = _uid(job)
    if uid and rec.inspect_jobs.get((namespace, name)) != uid and kube.landed(job, "Job") is not None:
        rec.inspect_jobs[(namespace, name)] = uid  # our create's answer was lost, but it landed
        rec.save(kube)
    if not uid or rec.inspect_jobs.get((namespace, name)) != uid:
        return {"error": f"inspection Job {name} exists but the operator did not make it (its UID is in no record of "
                         "the operator): its result is not trusted; delete it and the operator runs its own"}
    st = job.get("status") or {}
    pods = [p for p in kube.core.list_namespaced_pod(namespace, label_selector=f"job-name={name}").items
            if controlled_by(p, uid)]
    if not st.get("succeeded") and not st.get("failed"):
        for pod in pods:  # a pod that cannot be scheduled will not finish: say why now
            for c in pod.status.conditions or []:
                if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                    return {"error": f"inspection pod cannot be scheduled: {c.message}"}
        return None
    for pod in pods:
        for cs in (pod.status.container_statuses or []):
            term = cs.state.terminated if cs.state else None
            if term and term.message:
                _done(kube, namespace, name)
                try:
                    return json.loads(term.message)
                except json.JSONDecodeError:
                    return {"error": term.message.strip()[-2000:]}
    return {"error": f"inspection Job {name} finished without a termination message"}


def _done(kube, namespace: str, name: str) -> None:
    """Results are cached by the caller; the Job goes, and so does its record (the next change re-runs it)."""
    kube.delete("Job", namespace, name)
    rec = model_cache.RECORD
    if rec.inspect_jobs.pop((namespace, name), None) is not None:
        rec.save(kube)
