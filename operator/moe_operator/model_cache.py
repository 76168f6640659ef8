"""Model cache: one PVC per (hf:// model, pinned revision) and namespace, filled once by a Job running
`moe-operator download-model`, mounted read-only by every replica of every MoEDeployment of that
model. Rendering is pure (pvc(), fill_job(), pod_parts()); `ensure()` is the I/O step reconcile calls.

A pvc:// model is copied the same way when its spec asks (model.cache.enabled true, typically with a
faster storageClassName; the cluster-wide default turns on hub downloads only): the Job mounts the
source claim read-only and runs `download-model --from`, the pods mount the copy instead of the source.

The PVC is not owned by any MoEDeployment (it outlives each of them): users mark it with a label
`user.moe.serving.dev/<name>`; `collect()` deletes a cache no MoEDeployment uses any more once it
has been unused for the grace period.

Names are predictable and labels and annotations are anyone's to write who may edit PVCs in the
namespace, so neither says who made an object. The operator adopts, marks ready and deletes only
what it made, by UID: its record is status.modelCache (claimUid, jobUid) of the MoEDeployments
(the status subresource only the operator writes) and the ledger in the operator's own namespace
(cache_ledger.py, RECORD), which outlives restarts. The unused-since annotation is for people; the
grace period runs from when the operator first saw the cache unused, by the ledger's clock.
A create whose answer was lost (it landed all the same) is recognised by the random token this
process sent with it (Kube.create, Kube.landed), never by labels or names.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from moe_core.checkpoint import CheckpointInfo

from . import images
from .api import ModelCacheStatus, MoEDeploymentSpec
from .cache_ledger import Record, new_record  # noqa: F401  (Record: tests build empty ones)
from .download_cli import PERMANENT_EXIT_CODES, READY_MARKER
from .model_uri import ModelURI
from .security import container_security, runtime_pod_security

MOUNT = "/models/cache"
SOURCE_MOUNT = "/models/source"  # a pvc:// model's own claim, in the copy Job
VOLUME = "model-cache"
CACHE_LABEL = "moe.serving.dev/model-cache"
USER_PREFIX = "user.moe.serving.dev/"
A_MODEL, A_REVISION = "moe.serving.dev/model", "moe.serving.dev/revision"
A_READY, A_UNUSED = "moe.serving.dev/cache-ready", "moe.serving.dev/unused-since"
GiB = 1024 ** 3


RECORD = new_record()


def hub_endpoint() -> str | None:
    """The hub the operator itself talks to (HF_ENDPOINT of the operator's process: the chart's mirror
    setting), passed to every container of ours that downloads from the hub."""
    return os.environ.get("HF_ENDPOINT") or None


def enabled(spec: MoEDeploymentSpec) -> bool:
    return spec.model.cache.enabled is True and spec.model.uri.startswith(("hf://", "pvc://"))


@dataclass(frozen=True)
class Source:
    key: str  # what the cache holds: org/name, or pvc://claim/path
    revision: str  # the hub commit; for a copy, the pvc:// uri (what the ready marker names)
    claim: str  # the cache PVC
    copy_from: ModelURI | None = None  # pvc:// models


def source(spec: MoEDeploymentSpec) -> Source:
    uri = ModelURI.parse(spec.model.uri)
    if uri.scheme == "pvc":
        key = f"pvc://{uri.claim}/{uri.subpath}".rstrip("/")
        return Source(key, key, claim_name(key, "copy"), uri)
    return Source(uri.repo, uri.revision, claim_name(uri.repo, uri.revision))


def with_defaults(spec: MoEDeploymentSpec, default_enabled: bool, default_class: str | None) -> MoEDeploymentSpec:
    """The cluster-wide defaults (operator flags, chart values modelCache.*) for what the spec leaves
    unset. The default turns on hub downloads only: a pvc:// model is copied when its spec asks."""
    c = spec.model.cache
    update = {}
    if c.enabled is None and not spec.model.uri.startswith("pvc://"):
        update["enabled"] = default_enabled
    if c.storageClassName is None and default_class:
        update["storageClassName"] = default_class
    if not update:
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(update={"cache": c.model_copy(update=update)})})


def claim_name(repo: str, revision: str) -> str:
    return "moe-model-" + hashlib.sha256(f"{repo}@{revision}".encode()).hexdigest()[:16]


def size(spec: MoEDeploymentSpec, ckpt: CheckpointInfo | None) -> str:
    """spec.model.cache.size, else the checkpoint's bytes + 10% (configs, tokenizer), at least 1Gi."""
    if spec.model.cache.size:
        return spec.model.cache.size
    total = ckpt.totalBytes if ckpt else 0
    return f"{max(1, math.ceil(total * 1.1 / GiB))}Gi"


def pvc(namespace: str, spec: MoEDeploymentSpec, ckpt: CheckpointInfo | None) -> dict[str, Any]:
    src = source(spec)
    c = spec.model.cache
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": src.claim, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "moe-operator", CACHE_LABEL: "true"},
                     "annotations": {A_MODEL: src.key, A_REVISION: src.revision}},
        "spec": {"accessModes": [c.accessMode], "resources": {"requests": {"storage": size(spec, ckpt)}}},
    }
    if c.storageClassName:
        body["spec"]["storageClassName"] = c.storageClassName
    return body


def fill_job(namespace: str, spec: MoEDeploymentSpec, image: str, hf_endpoint: str | None = None,
             copy_groups: tuple[int, ...] = ()) -> dict[str, Any]:
    """The Job that downloads the pinned commit into the cache PVC (or copies a pvc:// model into it
    from its claim, mounted read-only). Locked down like the engine pods (non-root uid 65532); the
    token only as a secretKeyRef; the operator's hub mirror (HF_ENDPOINT) when it has one; amd64
    nodes (its image is the amd64 one).

    Retries: a failed pod is replaced (restartPolicy Never, up to backoffLimit) and the new one
    continues from the .part files on the PVC, for what another try can fix (network, the hub's 5xx).
    The podFailurePolicy fails the Job at once on download-model's permanent exit codes
    (PERMANENT_EXIT_CODES: a checksum mismatch, the hub's 401/403/404, an unreadable source file),
    which a re-download of the same commit cannot fix; a pod evicted or preempted (DisruptionTarget)
    does not count against backoffLimit.

    A pvc:// copy reads the source claim as uid/gid 65532 (a read-only mount keeps the source's owners
    and modes; fsGroup changes nothing there): `copy_groups` (the cluster admin's chart value
    modelCache.copySupplementalGroups, never the spec) are added as supplementalGroups so files that
    are only group-readable can be read without running as root."""
    src = source(spec)
    claim = src.claim
    env = [{"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}, {"name": "HOME", "value": "/tmp"}]
    mounts = [{"name": VOLUME, "mountPath": MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes = [{"name": VOLUME, "persistentVolumeClaim": {"claimName": claim}}, {"name": "tmp", "emptyDir": {}}]
    if src.copy_from is not None:
        frm = f"{SOURCE_MOUNT}/{src.copy_from.subpath}".rstrip("/")
        what = ["--from", frm]
        mounts.append({"name": "model-source", "mountPath": SOURCE_MOUNT, "readOnly": True})
        volumes.append({"name": "model-source", "persistentVolumeClaim": {"claimName": src.copy_from.claim,
                                                                           "readOnly": True}})
    else:
        what = ["--repo", src.key]
        if hf_endpoint:
            env.append({"name": "HF_ENDPOINT", "value": hf_endpoint})
        if spec.model.tokenSecretRef:
            ref = spec.model.tokenSecretRef
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    security = runtime_pod_security()  # the fill Job runs the runtime image (images.tool_image)
    if src.copy_from is not None and copy_groups:
        security["supplementalGroups"] = sorted(set(copy_groups))
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": claim + "-fill", "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "moe-operator", "moe.serving.dev/role": "model-cache",
                                CACHE_LABEL: "true"},
                     "annotations": {A_MODEL: src.key, A_REVISION: src.revision}},
        "spec": {"backoffLimit": 6, "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": "download", "operator": "In",
                                                  "values": list(PERMANENT_EXIT_CODES)}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]}, "template": {
            "metadata": {"labels": {"moe.serving.dev/role": "model-cache"}},
            "spec": {
                "restartPolicy": "Never",  # podFailurePolicy needs it; the next pod continues from the .part files
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "nodeSelector": {"kubernetes.io/arch": "amd64"},
                "securityContext": security,
                # the operator-wide pull secrets (--image-pull-secret): a private registry's image pulls here too
                **({"imagePullSecrets": [{"name": n} for n in images.REGISTRIES.pull_secrets]}
                   if images.REGISTRIES.pull_secrets else {}),
                "containers": [{
                    "name": "download", "image": image,
                    "command": ["moe-operator", "download-model", *what, "--revision", src.revision,
                                "--dir", MOUNT, "--termination-log", "/dev/termination-log"],
                    "env": env,
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "securityContext": container_security(),
                    "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
                    "volumeMounts": mounts}],
                "volumes": volumes}}},
    }


@dataclass(frozen=True)
class PodParts:
    volume: dict[str, Any]
    mount: dict[str, Any]
    init_container: dict[str, Any]


def pod_parts(spec: MoEDeploymentSpec, image: str) -> PodParts:
    """What an engine pod needs to read the cache: the PVC read-only, and an init container that
    refuses to start the engine until the ready marker of this very revision is there."""
    src = source(spec)
    claim, revision = src.claim, src.revision
    # The revision (for a copy: the tenant's pvc:// uri) and the claim reach the shell only as
    # positional parameters ("$1"...), never spliced into the script; grep -F matches them as text.
    script = ('grep -qF -- "\\"revision\\": \\"$1\\"" "$2" || '
              '{ echo "model cache $3 has no ready marker for $1" >&2; exit 1; }')
    check = {"name": "model-cache-ready", "image": image,
             "command": ["sh", "-c", script, "model-cache-ready", revision, f"{MOUNT}/{READY_MARKER}", claim],
             "securityContext": container_security(),
             "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
             "volumeMounts": [{"name": VOLUME, "mountPath": MOUNT, "readOnly": True}]}
    return PodParts({"name": VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
                    {"name": VOLUME, "mountPath": MOUNT, "readOnly": True}, check)


# ---------------------------------------------------------------------------------------------
# I/O: what reconcile calls


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _progress_from_log(text: str) -> tuple[int | None, int | None]:
    for line in reversed((text or "").strip().splitlines()):
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(d, dict) and "bytesTotal" in d:
            return d.get("bytesDone"), d.get("bytesTotal")
    return None, None


def recorded(kube, namespace: str) -> tuple[dict[str, str], dict[str, str]]:
    """(claim name -> PVC UID, PVC UID -> fill Job UID) the operator made in `namespace`: its
    MoEDeployments' status.modelCache and the ledger (RECORD)."""
    RECORD.sync(kube)
    claims = {c: uid for (ns, c), uid in RECORD.claims.items() if ns == namespace}
    jobs = dict(RECORD.jobs)
    for m in kube.list_moeds([namespace]):
        mc = (m.get("status") or {}).get("modelCache") or {}
        if mc.get("claimName") and mc.get("claimUid"):
            claims.setdefault(mc["claimName"], mc["claimUid"])
            if mc.get("jobUid"):
                jobs.setdefault(mc["claimUid"], mc["jobUid"])
    return claims, jobs


def ensure(kube, namespace: str, user: str, spec: MoEDeploymentSpec, ckpt: CheckpointInfo | None,
           image: str, copy_groups: tuple[int, ...] = ()) -> ModelCacheStatus:
    """Create the PVC and its fill Job when missing, mark `user`, and say where the cache stands.
    A PVC or Job of the cache's name that the operator did not make is never used (Failed, saying so)."""
    claim_obj = pvc(namespace, spec, ckpt)
    claim = claim_obj["metadata"]["name"]
    claims, jobs = recorded(kube, namespace)
    live = kube.get("PersistentVolumeClaim", namespace, claim)
    if live is None or claims.get(claim) != _uid(live):
        # None: someone else made one of this name since our get. An object in the way is ours
        # only if it is one an earlier create of ours sent whose answer was lost (Kube.landed).
        made = kube.create(claim_obj) if live is None else kube.landed(live, "PersistentVolumeClaim")
        live = made or live or kube.get("PersistentVolumeClaim", namespace, claim) or claim_obj
        if uid := _uid(made):
            RECORD.claims[(namespace, claim)] = claims[claim] = uid
            RECORD.save(kube)
    meta = live.get("metadata") or {}
    claim_uid = meta.get("uid")
    if not claim_uid or claims.get(claim) != claim_uid:
        return ModelCacheStatus(claimName=claim, state="Failed", message=(
            f"PVC {claim} exists but the operator did not make it (its UID is in no record of the operator): it is "
            "not used as the model cache; delete it and the operator makes its own"))
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    if RECORD.unused_since.pop(claim_uid, None) is not None:
        RECORD.save(kube)
    if labels.get(USER_PREFIX + user) != "true" or A_UNUSED in annotations:
        kube.merge_patch_metadata("PersistentVolumeClaim", namespace, claim,
                                  {"labels": {USER_PREFIX + user: "true"}, "annotations": {A_UNUSED: None}})
    src = source(spec)
    revision = src.revision
    filled = f"copied from {revision}" if src.copy_from is not None else f"filled with {revision}"
    job_uid = jobs.get(claim_uid)
    base = dict(claimName=claim, claimUid=claim_uid, jobUid=job_uid)
    ready = _ready_marker(annotations.get(A_READY))
    if ready and job_uid and ready.get("job") == job_uid:  # written by us for our own Job's result
        return ModelCacheStatus(**base, state="Ready", bytesDone=ready.get("bytesDone"),
                                bytesTotal=ready.get("bytesTotal"), message=filled)
    job_name = claim + "-fill"
    job = kube.get("Job", namespace, job_name)
    if job is None or (job_uid != _uid(job) and kube.landed(job, "Job") is not None):
        # an existing Job is adopted only as the object of a create of ours whose answer was lost
        made = kube.create(fill_job(namespace, spec, image, hub_endpoint(), copy_groups)) if job is None else job
        if job is None:
            job = None if made else kube.get("Job", namespace, job_name)  # None made: the name was taken since
        if uid := _uid(made):
            RECORD.jobs[claim_uid] = uid
            RECORD.save(kube)
            base["jobUid"] = job_uid = uid
    if job is None:
        return ModelCacheStatus(**base, state="Pending", bytesTotal=ckpt.totalBytes if ckpt else None,
                                message=f"download Job {job_name} created")
    if not job_uid or (job.get("metadata") or {}).get("uid") != job_uid:
        return ModelCacheStatus(**base, state="Failed", message=(
            f"Job {job_name} exists but the operator did not make it (its UID is in no record of the operator): its "
            "result is not trusted; delete it and the operator runs its own"))
    st = job.get("status") or {}
    conds = {c.get("type"): c for c in st.get("conditions") or [] if c.get("status") == "True"}
    if st.get("succeeded") or "Complete" in conds:
        result = kube.job_termination_message(namespace, job_name) or {}
        total = result.get("bytesTotal", ckpt.totalBytes if ckpt else None)
        marker = {"revision": revision, "bytesDone": result.get("bytesDone", total), "bytesTotal": total,
                  "job": job_uid, "at": _now()}
        kube.merge_patch_metadata("PersistentVolumeClaim", namespace, claim, {"annotations": {A_READY: json.dumps(marker)}})
        return ModelCacheStatus(**base, state="Ready", bytesDone=marker["bytesDone"], bytesTotal=total,
                                message=filled)
    if st.get("failed") and "Failed" in conds:
        result = kube.job_termination_message(namespace, job_name) or {}
        message = str(result.get("error") or conds["Failed"].get("message") or "download Job failed")[:3500]
        if result.get("permanent") or conds["Failed"].get("reason") == "PodFailurePolicy":
            code = f" {result['exitCode']}" if result.get("exitCode") else ""
            message += f" (exit code{code}: a permanent error, the Job failed without retrying"
        else:
            message += f" (after {st.get('failed')} attempts"
        message += f"; delete Job {job_name} to try again once the cause is fixed)"
        return ModelCacheStatus(**base, state="Failed", message=message)
    done, total = _progress_from_log(kube.job_log_tail(namespace, job_name))
    return ModelCacheStatus(**base, state="Downloading", bytesDone=done,
                            bytesTotal=total or (ckpt.totalBytes if ckpt else None),
                            message=f"download Job {job_name} running")


def _uid(obj: dict[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("uid")


def _ready_marker(text: str | None) -> dict[str, Any] | None:
    try:
        d = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    return d if isinstance(d, dict) else None


def release(kube, namespace: str, user: str, keep: str | None = None) -> None:
    """A MoEDeployment stopped using caches (deleted, or its model changed): drop its user label
    (except on `keep`); a cache left without users gets unused-since (collect() deletes it after
    the grace period)."""
    for c in kube.list_labeled("PersistentVolumeClaim", namespace, f"{CACHE_LABEL}=true,{USER_PREFIX}{user}=true"):
        if c["metadata"]["name"] == keep:
            continue
        labels = c["metadata"].get("labels") or {}
        others = [k for k in labels if k.startswith(USER_PREFIX) and k != USER_PREFIX + user]
        patch: dict[str, Any] = {"labels": {USER_PREFIX + user: None}}
        if not others:
            patch["annotations"] = {A_UNUSED: _now()}
        kube.merge_patch_metadata("PersistentVolumeClaim", namespace, c["metadata"]["name"], patch)


def collect(kube, namespace: str, grace_seconds: float, now: dt.datetime | None = None) -> list[str]:
    """Delete the caches (PVC and fill Job) the operator made that have had no user for longer than
    the grace period, counted from when it first saw them unused; returns their names. A PVC it did
    not make is never deleted, whatever its labels and annotations say."""
    now = now or dt.datetime.now(dt.timezone.utc)
    RECORD.sync(kube)
    gone, changed = [], False
    mine = {uid for (ns, _), uid in RECORD.claims.items() if ns == namespace}
    listed = kube.list_labeled("PersistentVolumeClaim", namespace, f"{CACHE_LABEL}=true")
    for c in listed:
        meta = c["metadata"]
        uid = meta.get("uid")
        if uid not in mine:
            continue
        if any(k.startswith(USER_PREFIX) for k in (meta.get("labels") or {})):
            changed |= RECORD.unused_since.pop(uid, None) is not None
            continue
        if uid not in RECORD.unused_since:
            RECORD.unused_since[uid] = now
            changed = True
        if (now - RECORD.unused_since[uid]).total_seconds() >= grace_seconds:
            job = kube.get("Job", namespace, meta["name"] + "-fill")
            if job and RECORD.jobs.get(uid) == (job.get("metadata") or {}).get("uid"):
                kube.delete("Job", namespace, meta["name"] + "-fill")
            kube.delete("PersistentVolumeClaim", namespace, meta["name"])
            RECORD.claims.pop((namespace, meta["name"]), None)
            RECORD.jobs.pop(uid, None)
            RECORD.unused_since.pop(uid, None)
            gone.append(meta["name"])
            changed = True
    # a recorded claim that no longer exists (deleted by hand) leaves the record
    live = {c["metadata"]["name"] for c in listed}
    for (ns, claim_name), uid in list(RECORD.claims.items()):
        if ns == namespace and claim_name not in live and claim_name not in gone and uid in mine \
                and kube.get("PersistentVolumeClaim", ns, claim_name) is None:
            RECORD.claims.pop((ns, claim_name), None)
            RECORD.jobs.pop(uid, None)
            RECORD.unused_since.pop(uid, None)
            changed = True
    if changed:
        RECORD.save(kube)
    return gone


def sweep(kube, moeds: list[dict[str, Any]], namespaces: list[str], grace_seconds: float) -> list[str]:
    """The resync's pass over the caches: users that no longer exist are released (there is no
    finalizer to see a MoEDeployment go), then unused caches past the grace period are deleted."""
    live: dict[str, set[str]] = {}
    for m in moeds:
        if not (m["metadata"].get("deletionTimestamp")):
            live.setdefault(m["metadata"]["namespace"], set()).add(m["metadata"]["name"])
    claims = [c for ns in namespaces for c in kube.list_labeled("PersistentVolumeClaim", ns, f"{CACHE_LABEL}=true")] \
        if namespaces else kube.list_labeled("PersistentVolumeClaim", None, f"{CACHE_LABEL}=true")
    for c in claims:
        meta = c["metadata"]
        ns, labels = meta["namespace"], meta.get("labels") or {}
        users = {k[len(USER_PREFIX):] for k in labels if k.startswith(USER_PREFIX)}
        for gone in sorted(users - live.get(ns, set())):
            release(kube, ns, gone)
    deleted = []
    for ns in sorted({c["metadata"]["namespace"] for c in claims}):
        deleted += collect(kube, ns, grace_seconds)
    return deleted


# ---------------------------------------------------------------------------------------------
# Dev/demo/tests: a rendered container run on this machine (kwok runs no containers)


def local_invocation(container: dict[str, Any], volume_dirs: dict[str, str],
                     secret_values: dict[tuple[str, str], str] | None = None,
                     executables: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run a rendered container's command here exactly as rendered, but with each
    volume's mountPath replaced by a local directory (`volume_dirs`: volume name -> path) wherever it
    appears in the command, args and env values; secretKeyRef env from `secret_values`
    ((secret, key) -> value); a command's program from `executables` (name -> path) if given."""
    mounts = sorted(((m["mountPath"], volume_dirs[m["name"]]) for m in container.get("volumeMounts") or []
                     if m["name"] in volume_dirs), key=lambda mp: -len(mp[0]))

    def here(s: str) -> str:
        for path, local in mounts:
            if s == path or s.startswith(path + "/"):
                return local + s[len(path):]
            s = s.replace(f" {path}/", f" {local}/").replace(f" {path} ", f" {local} ")
        return s

    argv = [here(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    if executables and argv and argv[0] in executables:
        argv[0] = executables[argv[0]]
    env = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = here(e["value"])
        elif (ref := (e.get("valueFrom") or {}).get("secretKeyRef")) and secret_values:
            if (ref["name"], ref["key"]) in secret_values:
                env[e["name"]] = secret_values[(ref["name"], ref["key"])]
    return argv, env
