"""The operator's durable record of the model caches it made: which PVC (by UID) is its own, which
fill Job (by UID) filled it, and since when the operator has seen it unused; and which pvc://
inspection Jobs (by UID) it started, whose termination message it may trust.

Labels and annotations on a tenant's PVC are the tenant's to write, so the record cannot live there;
MoEDeployment status (status.modelCache) only remembers a cache while some object still uses it.
This record lives in one ConfigMap in the operator's own namespace (MOE_OPERATOR_NAMESPACE, set by
the chart), which tenants cannot write, so a restarted operator still reuses its caches and still
collects the unused ones on the clock it started before the restart. Without that namespace (a
local dev run) the record is this process's memory, as before.

One writer: the active operator (kopf peering keeps standbys idle); a lock orders this process's
reconcile workers. The record is read once, then written through on every change.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

NAME = "moe-operator-model-caches"  # the chart's release "moe-operator"; others set MOE_CACHE_LEDGER_NAME
KEY = "caches.json"
# ~180 bytes a cache: 5,000 caches stay well under the 1 MiB object limit of etcd.
MAX_BYTES = 950 * 1024


def location() -> tuple[str, str] | None:
    """(namespace, name) of the ledger ConfigMap, or None for an in-memory record."""
    ns = os.environ.get("MOE_OPERATOR_NAMESPACE", "").strip()
    return (ns, name()) if ns else None


def name() -> str:
    """The ledger ConfigMap's name: the release's (the chart sets it), so two releases in one
    namespace keep one ledger each."""
    return os.environ.get("MOE_CACHE_LEDGER_NAME", "").strip() or NAME


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: Any) -> dt.datetime | None:
    try:
        return dt.datetime.strptime(str(text), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return None


@dataclass
class Record:
    """What the operator made: (namespace, claim) -> PVC UID, PVC UID -> fill Job UID, and when it
    first saw each PVC unused (its own clock, never an annotation). `store` names the ConfigMap
    that keeps it across restarts (None: memory only)."""
    claims: dict[tuple[str, str], str] = field(default_factory=dict)
    jobs: dict[str, str] = field(default_factory=dict)
    unused_since: dict[str, dt.datetime] = field(default_factory=dict)
    inspect_jobs: dict[tuple[str, str], str] = field(default_factory=dict)  # (namespace, Job) -> UID (pvc:// inspection)
    store: tuple[str, str] | None = None
    loaded: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    # --- persistence -----------------------------------------------------------------------

    def encode(self) -> str:
        return json.dumps({"version": 1,
                           "claims": {f"{ns}/{c}": uid for (ns, c), uid in sorted(self.claims.items())},
                           "jobs": dict(sorted(self.jobs.items())),
                           "unusedSince": {u: _iso(t) for u, t in sorted(self.unused_since.items())},
                           "inspectJobs": {f"{ns}/{j}": uid for (ns, j), uid in sorted(self.inspect_jobs.items())}},
                          separators=(",", ":"))

    def decode(self, text: str) -> None:
        """Merge a stored record in; what cannot be read is dropped with a warning (the caches it
        named are then not the operator's: never used, never deleted, which is the safe side)."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != 1:
                raise ValueError(f"unknown ledger version {data.get('version') if isinstance(data, dict) else data!r}")
            for key, uid in (data.get("claims") or {}).items():
                ns, _, claim = str(key).partition("/")
                if ns and claim and isinstance(uid, str):
                    self.claims.setdefault((ns, claim), uid)
            for pvc_uid, job_uid in (data.get("jobs") or {}).items():
                if isinstance(job_uid, str):
                    self.jobs.setdefault(str(pvc_uid), job_uid)
            for key, uid in (data.get("inspectJobs") or {}).items():
                ns, _, job = str(key).partition("/")
                if ns and job and isinstance(uid, str):
                    self.inspect_jobs.setdefault((ns, job), uid)
            for pvc_uid, when in (data.get("unusedSince") or {}).items():
                t = _parse_time(when)
                if t is not None:
                    self.unused_since.setdefault(str(pvc_uid), t)
        except (ValueError, AttributeError, TypeError) as e:
            log.warning("model cache ledger %s unreadable (%s): starting with an empty record", self.store, e)

    def sync(self, kube) -> None:
        """Read the stored record once (the first time it is needed)."""
        with self.lock:
            if self.loaded or self.store is None:
                self.loaded = True
                return
            try:
                cm = kube.get("ConfigMap", *self.store)
            except Exception as e:  # noqa: BLE001
                if _forbidden(e):  # the chart's RBAC lacks it: keep working from memory, loudly
                    log.error("model cache ledger %s/%s cannot be read (%s): the record is this process's memory "
                              "only; grant configmaps get/create/patch in the operator's namespace", *self.store, e)
                    self.store, self.loaded = None, True
                    return
                raise  # transient: not loaded, so nothing stored is overwritten; the caller retries
            if cm is not None:
                self.decode(((cm.get("data") or {}).get(KEY)) or "{}")
            self.loaded = True

    def save(self, kube) -> None:
        """Write the record through (an apply of the whole ConfigMap: this operator owns it)."""
        if self.store is None:
            return
        with self.lock:
            text = self.encode()
            if len(text) > MAX_BYTES:
                log.error("model cache ledger is %d bytes, over %d: not written; caches made from now on are "
                          "remembered by this process only", len(text), MAX_BYTES)
                return
            ns, name = self.store
            try:
                kube.apply({"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": name, "namespace": ns,
                                         "labels": {"app.kubernetes.io/managed-by": "moe-operator",
                                                    "moe.serving.dev/role": "model-cache-ledger"}},
                            "data": {KEY: text}})
            except Exception as e:  # noqa: BLE001  the next change writes the whole record again
                log.warning("model cache ledger %s/%s not written (%s): the next change retries", ns, name, e)


def _forbidden(e: Exception) -> bool:
    return getattr(e, "status", None) == 403 or "forbidden" in str(e).lower()


def new_record() -> Record:
    return Record(store=location())
