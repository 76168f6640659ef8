"""kopf handlers: the operator's edges. Decisions live in reconcile/placement/planner."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import kopf

from . import API_GROUP, API_VERSION, PLURAL
from . import model_cache, webhook
from . import revocation  # noqa: F401 - registers the token-revocation timer
from .inventory import NodeInfo, build, fingerprint, node_info, pod_gpu_requests
from .kube import Kube, _api_message
from .metrics import GPU_CLASSES, RECONCILES
from .reconcile import UNREACHABLE, Config, Outcome, reconcile, status_changed

log = logging.getLogger("moe_operator")
RESYNC_SECONDS = float(os.environ.get("MOE_RESYNC_SECONDS", "10"))
INVENTORY_SETTLE_SECONDS = 1.0  # a node change usually comes in a burst (labels, then status)
# Reconciles run on a pool of their own (not asyncio.to_thread's, which everything shares), this
# many at once; the sweep gives one object this long before it goes on without waiting for it.
WORKERS = int(os.environ.get("MOE_RECONCILE_WORKERS", "8"))
OBJECT_SECONDS = float(os.environ.get("MOE_OBJECT_SECONDS", "30"))
# /healthz fails when no sweep has finished for this long (the loop is stuck: a restart helps).
LIVENESS_STALL_SECONDS = float(os.environ.get("MOE_LIVENESS_STALL_SECONDS", str(max(120.0, 6 * RESYNC_SECONDS))))
QUIET_SECONDS = 60.0  # one log line per kind of failure per this long
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
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(WORKERS, thread_name_prefix="moe-io"))
    swept: float = field(default_factory=time.monotonic)  # when the sweep last finished
    quiet: "Quiet" = field(default_factory=lambda: Quiet(log))
    owned_seen: dict[tuple, tuple] = field(default_factory=dict)  # (kind, ns, name) -> owned_essence at the last event

    async def io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A blocking call on the operator's own bounded pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))


def _cause(e: BaseException) -> str:
    """One line naming a failure: an API error's status and the server's own message."""
    from kubernetes.client.rest import ApiException

    if isinstance(e, ApiException):
        return f"HTTP {e.status}: {_api_message(e)}"
    return f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0]


class Quiet:
    """One warning per kind of failure per QUIET_SECONDS (an API outage fails every object the same
    way: hundreds of identical lines and tracebacks said nothing more than one), and one line when
    it is over."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic):
        self.logger, self.clock = logger, clock
        self.last: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def failed(self, kind: str, message: str, retry: str) -> None:
        self.count[kind] = self.count.get(kind, 0) + 1
        now = self.clock()
        if now - self.last.get(kind, -1e18) >= QUIET_SECONDS:
            self.last[kind] = now
            self.logger.warning("%s: %s; %s (further failures of this kind are counted, not logged, for %.0fs)",
                                kind, message[:500], retry, QUIET_SECONDS)

    def ok(self, kind: str) -> None:
        if self.count.pop(kind, 0):
            self.last.pop(kind, None)
            self.logger.info("%s: recovered", kind)


class DigestDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's last-handled configuration as digests of spec and metadata (issue 34 item 4): the
    stock storage copies the whole spec into an annotation, so a large valid spec applied with
    `kubectl apply` (whose own annotation holds it once more) passes the API server's 256 KiB
    limit on annotations and kopf never records the object as handled. The handlers read the
    object afresh and use no diff, only whether spec changed: a digest says that."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        import hashlib
        import json

        essence = super().build(body=body, extra_fields=extra_fields)
        return {k: {"sha256": hashlib.sha256(json.dumps(v, sort_keys=True, separators=(",", ":")).encode()).hexdigest()}
                for k, v in essence.items()}  # type: ignore[return-value]


def _state(memo: kopf.Memo) -> State:
    return memo["state"]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = "moe.serving.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="moe.serving.dev")
    settings.persistence.diffbase_storage = DigestDiffBaseStorage(prefix="moe.serving.dev", key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 8
    settings.networking.error_backoffs = [1, 2, 5, 10, 30]
    settings.networking.request_timeout = 30  # kopf's own API calls (patches, events); not the watches
    settings.networking.connect_timeout = 5
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
                                logger: Any, source: str, skip_if_busy: bool = False) -> Outcome | None:
    """The one path every trigger takes: read the object, reconcile, write status if it changed,
    post Events, count, log. The object is read here, under its lock, never taken from the trigger
    (which may hold a body from before the previous reconcile's status). With `skip_if_busy` (the
    sweep) an object whose lock is held is skipped (None): its holder reconciles it anyway."""
    st.indexes.update(nodes=gpu_nodes, pods=gpu_pods)
    key = (namespace, name)
    if skip_if_busy and key in st.locks and st.locks[key].locked():
        return None
    st.lock_users[key] = st.lock_users.get(key, 0) + 1
    try:
        async with st.locks.setdefault(key, asyncio.Lock()):
            moed = await st.io(st.kube.get_moed, namespace, name)
            if moed is None or moed["metadata"].get("deletionTimestamp"):   # gone or going: nothing to do
                return Outcome(status={})
            classes = current_classes(gpu_nodes, gpu_pods)
            outcome = await st.io(reconcile, moed, classes, st.kube, st.cfg)
            if status_changed(moed.get("status") or {}, outcome.status):
                await st.io(st.kube.patch_status, namespace, name, outcome.status)
    finally:
        st.lock_users[key] -= 1
        if not st.lock_users[key]:   # nobody holds or waits for it: a later reconcile makes a new one
            del st.lock_users[key], st.locks[key]
    for type_, reason, message in outcome.events:
        try:
            await st.io(st.kube.post_event, moed, type_, reason, message)
        except Exception as e:  # an Event that cannot be posted must not stop the caller (the sweep)
            st.quiet.failed("posting Events", f"{reason} on {namespace}/{name}: {_cause(e)}",
                            "not retried")
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
    st = _state(memo)
    try:
        outcome = await _reconcile_and_report(st, body.metadata.namespace, body.metadata.name, gpu_nodes,
                                              gpu_pods, logger, "handler")
    except UNREACHABLE as e:  # an API outage: one line per kind (Quiet), kopf retries without a traceback
        st.quiet.failed("Kubernetes API unreachable", _cause(e), "retried in 10s")
        raise kopf.TemporaryError(f"Kubernetes API unreachable ({type(e).__name__})", delay=10) from None
    st.quiet.ok("Kubernetes API unreachable")
    s = outcome.status if outcome else {}
    logger.info("reconciled: gpuClass=%s backend=%s deferredFinalize=%s ready=%s/%s",
                s.get("gpuClass"), s.get("runnerBackend"), s.get("deferredFinalize"),
                s.get("readyReplicas"), s.get("replicas"))
    if outcome and outcome.retry_after:
        raise kopf.TemporaryError("will retry: " + "; ".join(m for _, _, m in outcome.events)[:200] or "pending",
                                  delay=outcome.retry_after)


# One cluster-wide sweep instead of per-object kopf timers: timers make kopf put a finalizer on
# every MoEDeployment, and a finalizer would block deletion whenever the operator is down.

async def _bounded(st: State, moed: dict[str, Any], slots: asyncio.Semaphore, logger: Any) -> str | None:
    """One object of the sweep in a worker slot for at most OBJECT_SECONDS: past that the sweep goes
    on (the reconcile keeps its lock and finishes on its own). The kind of failure, or None."""
    meta = moed["metadata"]
    async with slots:
        task = asyncio.ensure_future(_reconcile_and_report(st, meta["namespace"], meta["name"], st.indexes["nodes"],
                                                           st.indexes["pods"], logger, "resync", skip_if_busy=True))
        try:
            await asyncio.wait_for(asyncio.shield(task), OBJECT_SECONDS)
        except asyncio.TimeoutError:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its failure is not lost unseen
            logger.warning("resync of %s/%s takes over %.0fs; the sweep goes on without it",
                           meta["namespace"], meta["name"], OBJECT_SECONDS)
            return "slow"
        except asyncio.CancelledError:
            raise
        except UNREACHABLE as e:
            st.quiet.failed("Kubernetes API unreachable", _cause(e), f"retried in {RESYNC_SECONDS:.0f}s")
            return "unreachable"
        except Exception as e:  # noqa: BLE001 - the next object and the next tick go on
            st.quiet.failed(f"resync {type(e).__name__}", f"{meta['namespace']}/{meta['name']}: {_cause(e)}",
                            f"retried in {RESYNC_SECONDS:.0f}s")
            return type(e).__name__
    return None


async def sweep(st: State, logger: Any) -> int:
    """Reconcile every MoEDeployment once, WORKERS at a time; one object's failure or slowness
    never stops or holds the others."""
    items = await st.io(st.kube.list_moeds, st.cfg.namespaces)
    slots = asyncio.Semaphore(WORKERS)
    kinds = await asyncio.gather(*(_bounded(st, m, slots, logger) for m in items
                                   if not m["metadata"].get("deletionTimestamp")))
    failed = sum(1 for k in kinds if k)
    if "unreachable" not in kinds:
        st.quiet.ok("Kubernetes API unreachable")
    try:  # model caches whose last user is gone: released, deleted after the grace period
        for claim in await st.io(model_cache.sweep, st.kube, items, st.cfg.namespaces,
                                 st.cfg.model_cache_grace_seconds):
            logger.info("deleted model cache %s (unused for %ss)", claim, st.cfg.model_cache_grace_seconds)
    except Exception as e:  # noqa: BLE001 - the next tick retries
        failed += 1
        st.quiet.failed("model cache sweep", _cause(e), f"retried in {RESYNC_SECONDS:.0f}s")
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
            st.swept = time.monotonic()
            continue  # no handler has run yet: the indexes are not known
        try:
            await sweep(st, logger)
            st.quiet.ok("listing MoEDeployments")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # listing failed (API outage): the next tick retries
            st.quiet.failed("listing MoEDeployments", _cause(e), f"retried in {RESYNC_SECONDS:.0f}s")
        st.swept = time.monotonic()  # the loop goes round: an outage is no reason to restart the pod


def sweep_health(st: State, now: float | None = None) -> dict[str, float]:
    """The liveness answer: the sweep's last round, or an error when it is stuck."""
    age = (time.monotonic() if now is None else now) - st.swept
    if age > LIVENESS_STALL_SECONDS:
        raise RuntimeError(f"the resync sweep has not finished a round for {age:.0f}s")
    return {"lastSweepSecondsAgo": round(age, 1)}


@kopf.on.probe(id="sweep")
def sweep_progress(memo: kopf.Memo, **_: Any) -> dict[str, float]:
    """/healthz answers 500 when this raises: liveness follows the sweep, not only the event loop."""
    return sweep_health(_state(memo))


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
                               logger: Any, type: str | None = None, **_: Any) -> None:
    owner = next((o for o in body.metadata.get("ownerReferences", []) if o.get("kind") == "MoEDeployment"), None)
    if owner is None:
        return
    st = _state(memo)
    key = (body.get("kind"), body.metadata.namespace, body.metadata.name)
    seen = owned_essence(dict(body))
    if type == "DELETED":
        st.owned_seen.pop(key, None)
    elif st.owned_seen.get(key) == seen:
        return  # a status-only event (the controller's own bookkeeping): nothing the reconcile reads moved
    else:
        st.owned_seen[key] = seen
    try:
        await _reconcile_and_report(st, body.metadata.namespace, owner["name"], gpu_nodes, gpu_pods, logger,
                                    "owned-object")
    except UNREACHABLE as e:  # the sweep repairs it once the API answers again
        st.quiet.failed("Kubernetes API unreachable", _cause(e), f"retried in {RESYNC_SECONDS:.0f}s")


def owned_essence(obj: dict[str, Any]) -> tuple:
    """What a reconcile reads of an owned workload (issue 34 item 1): its spec (generation),
    labels and annotations, and the replica counts of readiness. An event changing none of these
    (the controller's conditions, observedGeneration, availableReplicas) reconciles nothing."""
    meta, st = obj.get("metadata") or {}, obj.get("status") or {}
    return (meta.get("generation"), repr(sorted((meta.get("labels") or {}).items())),
            repr(sorted((meta.get("annotations") or {}).items())), meta.get("deletionTimestamp"),
            st.get("readyReplicas"), st.get("updatedReplicas"), st.get("replicas"))


# --- admission -------------------------------------------------------------------------------

def enable_admission() -> None:
    """Registered only when a webhook server is configured (kopf refuses handlers without one).
    CREATE and UPDATE only: a DELETE never waits for the operator. ignore_failures makes the
    API server admit when the operator cannot answer (failurePolicy Ignore), so an operator
    outage blocks no write; the schema's CEL rules still hold then."""
    kopf.on.validate(G, V, P, id=webhook.HANDLER_ID, operations=["CREATE", "UPDATE"],
                     ignore_failures=True)(webhook.admission_handler(CONFIG))
