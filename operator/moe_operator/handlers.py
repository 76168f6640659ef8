"""kopf handlers: the operator's edges. Decisions live in reconcile/placement/planner."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any

import kopf

from . import API_GROUP, API_VERSION, PLURAL
from . import model_cache, webhook
from .inventory import NodeInfo, build, fingerprint, node_info, pod_gpu_requests
from .kube import Kube
from .metrics import GPU_CLASSES, RECONCILES
from .reconcile import Config, Outcome, reconcile, status_changed

log = logging.getLogger("moe_operator")
RESYNC_SECONDS = float(os.environ.get("MOE_RESYNC_SECONDS", "10"))
INVENTORY_SETTLE_SECONDS = 1.0  # a node change usually comes in a burst (labels, then status)
G, V, P = API_GROUP, API_VERSION, PLURAL
CONFIG = Config()  # filled by run_cli before kopf starts


@dataclass
class State:
    """What the handlers share, kept in kopf's operator-level memo (per-object memos are shallow
    copies of it, so they all see this one object)."""

    kube: Kube
    cfg: Config
    indexes: dict[str, kopf.Index] = field(default_factory=dict)  # the live kopf indexes, for the sweep
    # One reconcile at a time per object: the handler (and its retries), the sweep and owned-object
    # events would otherwise interleave. Entries live while some reconcile holds or waits for them.
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    lock_users: dict[tuple[str, str], int] = field(default_factory=dict)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)  # the inventory changed: sweep now
    inventory: str | None = None  # fingerprint of the GPU classes at the last node event


def _state(memo: kopf.Memo) -> State:
    return memo["state"]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
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
    memo["state"] = State(kube=Kube(), cfg=CONFIG)
    if CONFIG.admission:
        server, ca = webhook.server(CONFIG.admission, CONFIG.admission_listen, CONFIG.admission_cert_dir)
        settings.admission.server = server
        if CONFIG.admission_configuration:
            # The chart owns the configuration (a Service reference, short timeout); without
            # cert-manager to inject the CA, the operator writes the CA it made.
            if not CONFIG.admission_cert_dir:
                memo["state"].kube.patch_webhook_ca(CONFIG.admission_configuration, ca)
        else:
            settings.admission.managed = webhook.CONFIGURATION_NAME  # dev: kopf creates it, by URL


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


@kopf.on.event("", "v1", "nodes")
async def node_changed(memo: kopf.Memo, gpu_nodes: kopf.Index, gpu_pods: kopf.Index, **_: Any) -> None:
    """GPU classes appeared, went or changed (labels, capacity): wake the sweep so every object
    re-plans within seconds instead of at the next periodic tick."""
    st = _state(memo)
    st.indexes.update(nodes=gpu_nodes, pods=gpu_pods)
    fp = fingerprint(current_classes(gpu_nodes, gpu_pods))
    if fp != st.inventory:
        st.inventory = fp
        st.wakeup.set()


# --- MoEDeployment ---------------------------------------------------------------------------

async def _reconcile_and_report(st: State, namespace: str, name: str, gpu_nodes: kopf.Index, gpu_pods: kopf.Index,
                                logger: Any, source: str) -> Outcome:
    """The one path every trigger takes: read the object, reconcile, write status if it changed,
    post Events, count, log. The object is read here, under its lock, never taken from the trigger
    (which may hold a body from before the previous reconcile's status)."""
    st.indexes.update(nodes=gpu_nodes, pods=gpu_pods)
    key = (namespace, name)
    st.lock_users[key] = st.lock_users.get(key, 0) + 1
    try:
        async with st.locks.setdefault(key, asyncio.Lock()):
            moed = await asyncio.to_thread(st.kube.get_moed, namespace, name)
            if moed is None or moed["metadata"].get("deletionTimestamp"):   # gone or going: nothing to do
                return Outcome(status={})
            classes = current_classes(gpu_nodes, gpu_pods)
            outcome = await asyncio.to_thread(reconcile, moed, classes, st.kube, st.cfg)
            if status_changed(moed.get("status") or {}, outcome.status):
                await asyncio.to_thread(st.kube.patch_status, namespace, name, outcome.status)
    finally:
        st.lock_users[key] -= 1
        if not st.lock_users[key]:   # nobody holds or waits for it: a later reconcile makes a new one
            del st.lock_users[key], st.locks[key]
    for type_, reason, message in outcome.events:
        try:
            await asyncio.to_thread(st.kube.post_event, moed, type_, reason, message)
        except Exception as e:  # an Event that cannot be posted must not stop the caller (the sweep)
            logger.warning("could not post Event %s on %s/%s: %s", reason, namespace, name, e)
    s = outcome.status
    logger.debug("reconciled %s/%s (%s): gpuClass=%s backend=%s deferredFinalize=%s ready=%s/%s",
                 namespace, name, source, s.get("gpuClass"), s.get("runnerBackend"),
                 s.get("deferredFinalize"), s.get("readyReplicas"), s.get("replicas"))
    RECONCILES.labels(source if not outcome.retry_after else "retry").inc()
    return outcome


@kopf.on.resume(G, V, P)
@kopf.on.create(G, V, P)
@kopf.on.update(G, V, P, field="spec")
async def on_change(body: kopf.Body, memo: kopf.Memo, gpu_nodes: kopf.Index, gpu_pods: kopf.Index, logger: Any,
                    **_: Any) -> None:
    outcome = await _reconcile_and_report(_state(memo), body.metadata.namespace, body.metadata.name, gpu_nodes,
                                          gpu_pods, logger, "handler")
    s = outcome.status
    logger.info("reconciled: gpuClass=%s backend=%s deferredFinalize=%s ready=%s/%s",
                s.get("gpuClass"), s.get("runnerBackend"), s.get("deferredFinalize"),
                s.get("readyReplicas"), s.get("replicas"))
    if outcome.retry_after:
        raise kopf.TemporaryError("will retry: " + "; ".join(m for _, _, m in outcome.events)[:200] or "pending",
                                  delay=outcome.retry_after)


# One cluster-wide sweep instead of per-object kopf timers: timers make kopf put a finalizer on
# every MoEDeployment, and a finalizer would block deletion whenever the operator is down.

async def sweep(st: State, logger: Any) -> int:
    """Reconcile every MoEDeployment once; one object's failure never stops the others."""
    items = await asyncio.to_thread(st.kube.list_moeds, st.cfg.namespaces)
    failed = 0
    for moed in items:
        meta = moed["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        try:
            await _reconcile_and_report(st, meta["namespace"], meta["name"], st.indexes["nodes"], st.indexes["pods"],
                                        logger, "resync")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the next object and the next tick go on
            failed += 1
            logger.warning("resync of %s/%s failed: %s: %s", meta["namespace"], meta["name"], type(e).__name__, e)
    try:  # model caches whose last user is gone: released, deleted after the grace period
        for claim in await asyncio.to_thread(model_cache.sweep, st.kube, items, st.cfg.namespaces,
                                             st.cfg.model_cache_grace_seconds):
            logger.info("deleted model cache %s (unused for %ss)", claim, st.cfg.model_cache_grace_seconds)
    except Exception as e:  # noqa: BLE001 - the next tick retries
        failed += 1
        logger.warning("model cache sweep failed: %s: %s", type(e).__name__, e)
    return failed


async def _resync_loop(st: State, logger: Any) -> None:
    """Re-plan when the inventory changed, repair drift, refresh ready replicas; a tick on which
    nothing changed costs a GET per owned object."""
    while True:
        try:
            await asyncio.wait_for(st.wakeup.wait(), RESYNC_SECONDS)
            await asyncio.sleep(INVENTORY_SETTLE_SECONDS)
        except asyncio.TimeoutError:
            pass
        st.wakeup.clear()
        if "nodes" not in st.indexes:
            continue  # no handler has run yet: the indexes are not known
        try:
            await sweep(st, logger)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # listing failed (API outage): the next tick retries
            logger.warning("resync failed: %s: %s", type(e).__name__, e)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, logger: Any, **_: Any) -> None:
    memo["resync"] = asyncio.create_task(_resync_loop(_state(memo), logger))


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("resync")
    if task:
        task.cancel()


# Owned workloads: a change or a deletion repairs drift and refreshes readiness right away. Owned
# Services and ConfigMaps are repaired by the sweep (seconds later): watching every ConfigMap and
# Service of the cluster would cost more than it saves.
_OWNED = {"labels": {"app.kubernetes.io/managed-by": "moe-operator"}}


@kopf.on.event("apps", "v1", "deployments", **_OWNED)
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", **_OWNED)
async def owned_object_changed(body: kopf.Body, memo: kopf.Memo, gpu_nodes: kopf.Index, gpu_pods: kopf.Index,
                               logger: Any, **_: Any) -> None:
    owner = next((o for o in body.metadata.get("ownerReferences", []) if o.get("kind") == "MoEDeployment"), None)
    if owner is None:
        return
    await _reconcile_and_report(_state(memo), body.metadata.namespace, owner["name"], gpu_nodes, gpu_pods, logger,
                                "owned-object")


# --- admission -------------------------------------------------------------------------------

def enable_admission() -> None:
    """Registered only when a webhook server is configured (kopf refuses handlers without one).
    CREATE and UPDATE only: a DELETE never waits for the operator. ignore_failures makes the
    API server admit when the operator cannot answer (failurePolicy Ignore), so an operator
    outage blocks no write; the schema's CEL rules still hold then."""
    kopf.on.validate(G, V, P, id=webhook.HANDLER_ID, operations=["CREATE", "UPDATE"],
                     ignore_failures=True)(webhook.admission_handler(CONFIG))
