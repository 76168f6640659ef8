"""kopf handlers: the operator's edges. Decisions live in reconcile/placement/planner."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from typing import Any

import kopf
from moe_core.gpu import FAMILIES, from_name

from . import API_GROUP, API_VERSION, PLURAL
from .api import MoEDeploymentSpec
from .inspection import InspectionFailed, InspectionPending, inspect_spec
from .inventory import NodeInfo, build, node_info, pod_gpu_requests
from .kube import Kube
from .metrics import GPU_CLASSES, RECONCILES
from .placement import impossible_everywhere
from .reconcile import Config, Outcome, reconcile

log = logging.getLogger("moe_operator")
RESYNC_SECONDS = float(os.environ.get("MOE_RESYNC_SECONDS", "10"))
G, V, P = API_GROUP, API_VERSION, PLURAL
CONFIG = Config()  # filled by run_cli before kopf starts
_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = "moe.serving.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="moe.serving.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="moe.serving.dev", key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 8
    settings.networking.error_backoffs = [1, 2, 5, 10, 30]
    # Peers of equal priority all pause each other; a random priority per replica makes exactly
    # one of them (the highest) act while the others stand by.
    settings.peering.priority = random.randint(1, 2**30)
    if CONFIG.admission:
        # kopf serves the webhook with a self-signed certificate and manages the
        # ValidatingWebhookConfiguration (caBundle included) itself.
        host, _, port = CONFIG.admission.rpartition(":")
        certfile, pkeyfile = webhook_certificate(host or "localhost")
        settings.admission.server = kopf.WebhookServer(addr="0.0.0.0", port=int(port), host=host or "localhost",
                                                       certfile=certfile, pkeyfile=pkeyfile, cafile=certfile)
        settings.admission.managed = "validate.moe.serving.dev"


def webhook_certificate(host: str) -> tuple[str, str]:
    """A self-signed serving certificate for the webhook (openssl CLI; kopf's own generator needs
    oscrypto, which cannot read OpenSSL 3). In production, mount one from cert-manager instead."""
    import ipaddress
    import subprocess
    import tempfile

    d = tempfile.mkdtemp(prefix="moe-webhook-")
    try:
        ipaddress.ip_address(host)
        san = f"IP:{host}"
    except ValueError:
        san = f"DNS:{host}"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "365", "-subj", f"/CN={host}",
                    "-addext", f"subjectAltName={san}", "-keyout", f"{d}/tls.key", "-out", f"{d}/tls.crt"],
                   check=True, capture_output=True)
    return f"{d}/tls.crt", f"{d}/tls.key"


# --- inventory -------------------------------------------------------------------------------

@kopf.index("", "v1", "nodes")
def gpu_nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, NodeInfo]:
    return {name: node_info(dict(body))}


@kopf.index("", "v1", "pods")
def gpu_pods(body: kopf.Body, **_: Any) -> dict[str, int] | None:
    node, n = pod_gpu_requests(dict(body))
    return {node: n} if node and n else None


def current_classes(gpu_nodes: kopf.Index, gpu_pods: kopf.Index) -> dict:
    nodes = [info for key in gpu_nodes for info in gpu_nodes[key]]
    used = {node: sum(gpu_pods[node]) for node in gpu_pods}
    classes = build(nodes, used)
    for key, inv in classes.items():
        GPU_CLASSES.labels(key).set(inv.free_gpus)
    return classes


# --- MoEDeployment ---------------------------------------------------------------------------

# The live kopf indexes, remembered from the first handler call so that the resync loop (which
# kopf does not call with indexes) plans against the same inventory.
_INDEXES: dict[str, kopf.Index] = {}


# One reconcile at a time per object: the kopf handler (and its retries), the resync loop and the
# owned-workload trigger would otherwise interleave, and one of them, holding a body read before the
# other wrote status.gpuClass, would place the object again from scratch (placement is sticky only
# through that field) and flip its GPU class once its first pods took the free GPUs.
_LOCKS: dict[tuple[str, str], asyncio.Lock] = {}
_LOCK_USERS: dict[tuple[str, str], int] = {}   # reconciles holding or waiting for each lock


async def _reconcile_and_report(namespace: str, name: str, gpu_nodes: kopf.Index, gpu_pods: kopf.Index,
                                logger: Any, source: str) -> Outcome:
    """The one path every trigger takes: read the object, reconcile, write status, post Events, count,
    log. The object is read here, under its lock, never taken from the trigger (which may hold a
    body from before the previous reconcile's status)."""
    _INDEXES.update(nodes=gpu_nodes, pods=gpu_pods)
    key = (namespace, name)
    _LOCK_USERS[key] = _LOCK_USERS.get(key, 0) + 1
    try:
        async with _LOCKS.setdefault(key, asyncio.Lock()):
            moed = await asyncio.to_thread(kube().get_moed, namespace, name)
            if moed is None or moed["metadata"].get("deletionTimestamp"):   # gone or going: nothing to do
                return Outcome(status={})
            classes = current_classes(gpu_nodes, gpu_pods)
            outcome = await asyncio.to_thread(reconcile, moed, classes, kube(), CONFIG)
            await asyncio.to_thread(kube().patch_status, namespace, name, outcome.status)
    finally:
        _LOCK_USERS[key] -= 1
        if not _LOCK_USERS[key]:   # nobody holds or waits for it: a later reconcile makes a new one
            del _LOCK_USERS[key], _LOCKS[key]
    for type_, reason, message in outcome.events:
        (kopf.warn if type_ == "Warning" else kopf.info)(moed, reason=reason, message=message[:1000])
    st = outcome.status
    logger.debug("reconciled %s/%s (%s): gpuClass=%s backend=%s deferredFinalize=%s ready=%s/%s",
                 namespace, name, source, st.get("gpuClass"), st.get("runnerBackend"),
                 st.get("deferredFinalize"), st.get("readyReplicas"), st.get("replicas"))
    RECONCILES.labels(source if not outcome.retry_after else "retry").inc()
    return outcome


async def _reconcile(body: kopf.Body, gpu_nodes: kopf.Index, gpu_pods: kopf.Index, logger: Any) -> None:
    outcome = await _reconcile_and_report(body.metadata.namespace, body.metadata.name, gpu_nodes, gpu_pods, logger,
                                          "handler")
    st = outcome.status
    logger.info("reconciled: gpuClass=%s backend=%s deferredFinalize=%s ready=%s/%s",
                st.get("gpuClass"), st.get("runnerBackend"), st.get("deferredFinalize"),
                st.get("readyReplicas"), st.get("replicas"))
    if outcome.retry_after:
        raise kopf.TemporaryError("will retry: " + "; ".join(m for _, _, m in outcome.events)[:200] or "pending",
                                  delay=outcome.retry_after)


@kopf.on.resume(G, V, P)
@kopf.on.create(G, V, P)
@kopf.on.update(G, V, P, field="spec")
async def on_change(body: kopf.Body, gpu_nodes: kopf.Index, gpu_pods: kopf.Index, logger: Any, **_: Any) -> None:
    await _reconcile(body, gpu_nodes, gpu_pods, logger)


# One cluster-wide resync loop instead of per-object kopf timers: timers make kopf put a finalizer
# on every MoEDeployment, and a finalizer would block deletion whenever the operator is down.


async def _resync_loop(logger: Any) -> None:
    """Re-plan when the inventory changed, repair drift, refresh ready replicas (SSA no-op otherwise)."""
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        if "nodes" not in _INDEXES:
            continue  # no MoEDeployment handled yet: nothing to resync
        try:
            items = await asyncio.to_thread(kube().list_moeds, CONFIG.namespaces)
            for moed in items:
                if not moed["metadata"].get("deletionTimestamp"):
                    await _reconcile_and_report(moed["metadata"]["namespace"], moed["metadata"]["name"],
                                                _INDEXES["nodes"], _INDEXES["pods"], logger, "resync")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # keep resyncing; the next tick retries
            logger.warning("resync failed: %s: %s", type(e).__name__, e)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, logger: Any, **_: Any) -> None:
    memo["resync"] = asyncio.create_task(_resync_loop(logger))


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("resync")
    if task:
        task.cancel()


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": "moe-operator"})
async def owned_workload_changed(body: kopf.Body, type: str, gpu_nodes: kopf.Index, gpu_pods: kopf.Index,
                                 logger: Any, **_: Any) -> None:
    """An owned Deployment changed or vanished: refresh status and repair drift right away."""
    owner = next((o for o in body.metadata.get("ownerReferences", []) if o.get("kind") == "MoEDeployment"), None)
    if owner is None:
        return
    await _reconcile_and_report(body.metadata.namespace, owner["name"], gpu_nodes, gpu_pods, logger, "owned-workload")


# --- admission -------------------------------------------------------------------------------

def validate_spec(spec_dict: dict[str, Any]) -> str | None:
    """The planner's verdict on an explicit backend: None if some allowed GPU class can run it."""
    spec = MoEDeploymentSpec.model_validate(spec_dict)
    if spec.moe.runnerBackend == "auto" and spec.moe.deferredFinalize != "on":
        return None
    try:
        ckpt = inspect_spec(spec, local_models_dir=CONFIG.local_models_dir)
    except (InspectionFailed, InspectionPending):
        return None  # cannot judge without the checkpoint; the reconcile reports it
    families = spec.gpu.allowedArchitectures or list(FAMILIES)
    classes = [from_name(spec.gpu.product) if spec.gpu.product else from_name(f) for f in families]
    return impossible_everywhere(spec, ckpt, classes)


def admission(spec: kopf.Spec, **_: Any) -> None:
    msg = validate_spec(dict(spec))
    if msg:
        raise kopf.AdmissionError(f"moe.runnerBackend/deferredFinalize is impossible on every allowed GPU class: {msg}")


def enable_admission() -> None:
    """Registered only when a webhook server is configured (kopf refuses handlers without one)."""
    kopf.on.validate(G, V, P, id="explicit-backend-possible")(admission)
