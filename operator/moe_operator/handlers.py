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
from kopf._cogs.aiokits.aiotoggles import Toggle

from . import API_GROUP, API_VERSION, PLURAL
from . import model_cache, webhook
from . import revocation
from .inventory import NodeInfo, build, fingerprint, node_info, pod_gpu_requests
from .kube import Kube, _api_message
from . import condition_metrics
from .metrics import RECONCILES, set_free_gpus
from .reconcile import UNREACHABLE, Config, Outcome, reconcile, status_changed
from .resync import Mark, due
from .watch_cache import OwnedCache, owner_name
from .workqueue import WorkQueue

log = logging.getLogger("moe_operator")
RESYNC_SECONDS = float(os.environ.get("MOE_RESYNC_SECONDS", "10"))
# With every owned kind watched, an object whose inputs did not move is reconciled in full only this
# often (the safety net; drift and readiness come from watch events). A kind the API refuses to let
# us watch (RBAC) makes every sweep reconcile everything, as before the cache.
FULL_RESYNC_SECONDS = float(os.environ.get("MOE_FULL_RESYNC_SECONDS", "300"))
MODEL_CACHE_SWEEP_SECONDS = 60.0  # unused model caches are looked for this often (a LIST of PVCs)
# The owned kinds read from watches (label app.kubernetes.io/managed-by=moe-operator). The day-2
# kinds (PDB, HPA, ...) exist only for some specs and are read with a GET.
WATCHED_KINDS = ["Deployment", "LeaderWorkerSet", "Service", "ConfigMap", "PersistentVolumeClaim", "Job"]
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
    queue: WorkQueue | None = None  # reconciles of the sweep and of watch events (started with the sweep)
    marks: dict[tuple[str, str], Mark] = field(default_factory=dict)  # what each object's last reconcile saw
    sources: dict[tuple[str, str], str] = field(default_factory=dict)  # why a queued key was queued (metrics)
    model_cache_swept: float = 0.0
    nodes_seen: int = -1  # _inventory's node_version when the fingerprint was last taken
    # On while this replica leads (kopf does not pause it): the sweep, the work queue and the
    # revocation loop are plain tasks kopf's peering does not pause, so each round waits for this.
    # Standalone: always on. With --peering: on while a peering daemon runs (see lead_peering).
    leading: Toggle = field(default_factory=lambda: Toggle(True, name="leading"))
    peering_daemons: int = 0

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


class QuietLibraries(logging.Filter):
    """kopf's and the client libraries' own lines of an API outage, as Quiet does ours: one line
    per kind of message per QUIET_SECONDS, and no traceback when the cause is the connection (kopf
    logs each retry of each watch: dozens of identical lines, each with a traceback, said nothing
    more than the first). Installed on the root logger's handlers; our own lines pass untouched."""

    _OURS = ("moe_operator",)

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.clock = clock
        self.last: dict[str, float] = {}

    @staticmethod
    def kind(record: logging.LogRecord) -> str:
        import re

        msg = record.getMessage()
        head = re.split(r"[:(]| -> ", msg, maxsplit=1)[0]
        return re.sub(r"[0-9]+", "N", head)  # kopf logs one retry under several loggers: one kind

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.name.startswith(self._OURS):
            return True
        if record.exc_info and _connection_error(record.exc_info[1]):
            record.exc_info, record.exc_text = None, None
        k, now = self.kind(record), self.clock()
        if now - self.last.get(k, -1e18) < QUIET_SECONDS:
            return False
        self.last[k] = now
        return True


def _connection_error(e: BaseException | None) -> bool:
    """The API could not be reached or answered 5xx/429 (an outage), as opposed to a bug."""
    import aiohttp
    import urllib3

    while e is not None:
        if isinstance(e, (OSError, asyncio.TimeoutError, aiohttp.ClientConnectionError,
                          aiohttp.ServerDisconnectedError, urllib3.exceptions.HTTPError)):
            return True
        if type(e).__name__ in ("APIServerError", "APITooManyRequestsError"):
            return True
        e = e.__cause__ or e.__context__
    return False


def install_quiet_libraries() -> QuietLibraries:
    f = QuietLibraries()
    for h in logging.getLogger().handlers:
        if not any(isinstance(x, QuietLibraries) for x in h.filters):
            h.addFilter(f)
    return f


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
    if settings.peering.mandatory and not settings.peering.standalone:
        memo["state"].leading = Toggle(False, name="leading")
        register_peering_daemon(settings)
    install_quiet_libraries()
    if CONFIG.admission:
        on_ca = None
        if CONFIG.admission_configuration and not CONFIG.admission_cert_dir:  # a renewed CA goes where the first did
            on_ca = functools.partial(memo["state"].kube.patch_webhook_ca, CONFIG.admission_configuration)
        server, ca = webhook.server(CONFIG.admission, CONFIG.admission_listen, CONFIG.admission_cert_dir, on_ca=on_ca)
        settings.admission.server = server
        if CONFIG.admission_configuration:
            # The chart owns the configuration (a Service reference, short timeout); without
            # cert-manager to inject the CA, the operator writes the CA it made.
            if not CONFIG.admission_cert_dir:
                memo["state"].kube.patch_webhook_ca(CONFIG.admission_configuration, ca)
        else:
            settings.admission.managed = webhook.CONFIGURATION_NAME  # dev: kopf creates it, by URL


# --- inventory -------------------------------------------------------------------------------

# The inventory is rebuilt from the indexes only when one of them changed: with thousands of nodes a
# build per reconcile (and per node heartbeat) was most of the operator's idle CPU.
_inventory = {"version": 0, "built": -1, "classes": {}, "nodes": {}, "pods": {}, "node_version": 0}


@kopf.index("", "v1", "nodes")
def gpu_nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, NodeInfo]:
    info = node_info(dict(body))
    if _inventory["nodes"].get(name) != info:
        _inventory["nodes"][name] = info
        _inventory["version"] += 1
        _inventory["node_version"] += 1
    return {name: info}


@kopf.index("", "v1", "pods")
def gpu_pods(body: kopf.Body, **_: Any) -> dict[str, int] | None:
    node, n = pod_gpu_requests(dict(body))
    seen = (node, n)
    if _inventory["pods"].get(body.metadata.uid) != seen:
        _inventory["pods"][body.metadata.uid] = seen
        _inventory["version"] += 1
    return {node: n} if node and n else None


@kopf.on.event("", "v1", "pods")
def pod_gone(body: kopf.Body, type: str | None = None, **_: Any) -> None:
    if type == "DELETED" and _inventory["pods"].pop(body.metadata.uid, None) is not None:
        _inventory["version"] += 1


def current_classes(gpu_nodes: kopf.Index, gpu_pods: kopf.Index) -> dict:
    cached = gpu_nodes is _inventory.get("index")
    if cached and _inventory["built"] == _inventory["version"]:
        return _inventory["classes"]
    version = _inventory["version"]
    nodes = [info for key in gpu_nodes for info in gpu_nodes[key]]
    used = {node: sum(gpu_pods[node]) for node in gpu_pods}
    classes = build(nodes, used)
    set_free_gpus((inv.gpu_class, inv.free_gpus) for inv in classes.values())
    if isinstance(gpu_nodes, kopf.Index):  # kopf's live index (tests pass plain dicts: never cached)
        _inventory.update(index=gpu_nodes, built=version, classes=classes)
    return classes


@kopf.on.event("", "v1", "nodes")
async def node_changed(memo: kopf.Memo, gpu_nodes: kopf.Index, gpu_pods: kopf.Index, name: str,
                       type: str | None = None, **_: Any) -> None:
    """GPU classes appeared, went or changed (labels, capacity): wake the sweep so every object
    re-plans within seconds instead of at the next periodic tick."""
    st = _state(memo)
    st.indexes.update(nodes=gpu_nodes, pods=gpu_pods)
    if type == "DELETED" and _inventory["nodes"].pop(name, None) is not None:
        _inventory["version"] += 1
        _inventory["node_version"] += 1
    if st.nodes_seen == _inventory["node_version"]:
        return  # a heartbeat: no node's GPU facts moved
    # The fingerprint is taken by the sweep loop once the burst settles (thousands of nodes
    # arriving at start-up would otherwise rebuild the inventory once per node).
    st.wakeup.set()


def refresh_inventory(st: State) -> bool:
    """Take the inventory's fingerprint if a node's facts moved; whether the GPU classes changed."""
    if st.nodes_seen == _inventory["node_version"] or "nodes" not in st.indexes:
        return False
    st.nodes_seen = _inventory["node_version"]
    fp = fingerprint(current_classes(st.indexes["nodes"], st.indexes["pods"]))
    changed, st.inventory = fp != st.inventory, fp
    return changed


# --- MoEDeployment ---------------------------------------------------------------------------

async def _reconcile_and_report(st: State, namespace: str, name: str, gpu_nodes: kopf.Index, gpu_pods: kopf.Index,
                                logger: Any, source: str, skip_if_busy: bool = False,
                                cached: bool = False) -> Outcome | None:
    """The one path every trigger takes: read the object, reconcile, write status if it changed,
    post Events, count, log. The object is read here, under its lock, never taken from the trigger
    (which may hold a body from before the previous reconcile's status). With `skip_if_busy` (the
    sweep) an object whose lock is held is skipped (None): its holder reconciles it anyway. `cached`
    reads the object from the watch cache (the sweep, watch events: our own status writes are in it
    at once; kopf's handlers read afresh, their event may be newer than the cache)."""
    st.indexes.update(nodes=gpu_nodes, pods=gpu_pods)
    key = (namespace, name)
    if skip_if_busy and key in st.locks and st.locks[key].locked():
        return None
    st.lock_users[key] = st.lock_users.get(key, 0) + 1
    try:
        async with st.locks.setdefault(key, asyncio.Lock()):
            moed = await st.io(st.kube.get_moed, namespace, name, cached)
            if moed is None or moed["metadata"].get("deletionTimestamp"):   # gone or going: nothing to do
                condition_metrics.forget(namespace, name)
                return Outcome(status={})
            classes = current_classes(gpu_nodes, gpu_pods)
            # the mark names the classes this reconcile planned on, not st.inventory: a node pool
            # that arrives while it runs moves st.inventory, and the sweep must then run it again
            planned_on = fingerprint(classes)
            outcome = await st.io(reconcile, moed, classes, st.kube, st.cfg)
            rv = moed["metadata"].get("resourceVersion")
            condition_metrics.observe(namespace, name, outcome.status.get("conditions")
                                      or (moed.get("status") or {}).get("conditions") or [])
            if status_changed(moed.get("status") or {}, outcome.status):
                await st.io(st.kube.patch_status, namespace, name, outcome.status)
                _, after = st.kube.moed_cache.get("MoEDeployment", namespace, name) if st.kube.moed_cache \
                    else (False, None)
                rv = ((after or {}).get("metadata") or {}).get("resourceVersion")  # our own write: no change
            now = time.monotonic()
            st.marks[key] = Mark(rv, planned_on, now, now + outcome.retry_after if outcome.retry_after else None)
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
# every MoEDeployment, and a finalizer would block deletion whenever the operator is down. The sweep
# and the watch events only queue keys; WORKERS workers reconcile them (issue 34 item 2).

def enqueue(st: State, key: tuple[str, str], source: str, after: float = 0.0) -> None:
    if st.queue is None:
        return
    st.sources.setdefault(key, source)
    st.queue.add(key, after)


async def work(st: State, key: tuple[str, str], logger: Any) -> float | None:
    """One queued key: reconciled at most OBJECT_SECONDS in this worker (past that the worker goes
    on; the reconcile keeps its lock and finishes on its own). Returns when to do it again."""
    ns, name = key
    source = st.sources.pop(key, "resync")
    if key in st.locks and st.locks[key].locked():
        return 1.0  # a kopf handler has it now: look again shortly
    task = asyncio.ensure_future(_reconcile_and_report(st, ns, name, st.indexes["nodes"], st.indexes["pods"],
                                                       logger, source, skip_if_busy=True, cached=True))
    try:
        outcome = await asyncio.wait_for(asyncio.shield(task), OBJECT_SECONDS)
    except asyncio.TimeoutError:
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its failure is not lost unseen
        logger.warning("reconcile of %s/%s takes over %.0fs; its worker goes on without it", ns, name, OBJECT_SECONDS)
        return RESYNC_SECONDS
    except UNREACHABLE as e:
        st.quiet.failed("Kubernetes API unreachable", _cause(e), f"retried in {RESYNC_SECONDS:.0f}s")
        return RESYNC_SECONDS
    except Exception as e:  # noqa: BLE001 - the other keys and the next round go on
        st.quiet.failed(f"reconcile {type(e).__name__}", f"{ns}/{name}: {_cause(e)}", f"retried in {RESYNC_SECONDS:.0f}s")
        return RESYNC_SECONDS
    st.quiet.ok("Kubernetes API unreachable")
    if outcome is None:
        return 1.0  # busy after all
    return outcome.retry_after


def _all_watched(st: State) -> bool:
    cache = st.kube.cache
    return cache is not None and all(cache.synced(k) for k in WATCHED_KINDS)


async def sweep(st: State, logger: Any) -> int:
    """Queue every MoEDeployment whose inputs moved since its last reconcile (all of them when some
    owned kind is not watched, or every FULL_RESYNC_SECONDS); never waits for the reconciles.
    Returns how many were queued."""
    items = await st.io(st.kube.list_moeds, st.cfg.namespaces, True)
    now, full = time.monotonic(), FULL_RESYNC_SECONDS if _all_watched(st) else 0.0
    live = set()
    for m in items:
        meta = m["metadata"]
        key = (meta["namespace"], meta["name"])
        live.add(key)
        if meta.get("deletionTimestamp"):
            continue
        if due(st.marks.get(key), meta.get("resourceVersion"), st.inventory, now, full):
            enqueue(st, key, "resync")
    gone = [k for k in st.marks if k not in live]
    for key in gone:
        del st.marks[key]
    # a MoEDeployment went (no finalizer sees it go): release its caches now, not at the next slow sweep;
    # while a cache of ours waits out its grace period, look every tick so it goes when the period ends
    if gone or model_cache.RECORD.unused_since or \
            now - st.model_cache_swept >= (MODEL_CACHE_SWEEP_SECONDS if _all_watched(st) else 0.0):
        st.model_cache_swept = now
        try:  # model caches whose last user is gone: released, deleted after the grace period
            for claim in await st.io(model_cache.sweep, st.kube, items, st.cfg.namespaces,
                                     st.cfg.model_cache_grace_seconds):
                logger.info("deleted model cache %s (unused for %ss)", claim, st.cfg.model_cache_grace_seconds)
            st.quiet.ok("model cache sweep")
        except Exception as e:  # noqa: BLE001 - the next tick retries
            st.quiet.failed("model cache sweep", _cause(e), f"retried in {RESYNC_SECONDS:.0f}s")
    return len(st.queue) if st.queue is not None else 0


# --- leadership (kopf peering) ----------------------------------------------------------------
# kopf pauses its own watches, handlers and daemons on a standby replica, but not the plain tasks
# started below. kopf keeps its pause state (a ToggleSet) to itself; what it does expose is that
# a daemon runs only while the operator is not paused: daemon_killer stops every daemon on pause
# and the re-listing after resume spawns them again. So a daemon on this release's own peering
# object (it exists whenever --peering works) says "this replica leads".

def register_peering_daemon(settings: kopf.OperatorSettings) -> None:
    """Called from the startup handler: kopf's resource observer starts after startup, so a
    handler registered here is watched. ClusterKopfPeering when cluster-wide, else KopfPeering
    (one per watched namespace). No finalizer: a peering object must stay deletable without us."""
    import dataclasses
    from kopf._core.intents import registries

    plural = "clusterkopfpeerings" if settings.peering.clusterwide else "kopfpeerings"
    peering_name = settings.peering.name
    kopf.daemon(group="kopf.dev", version="v1", plural=plural, id="lead-peering", when=lambda name=None, **_: name == peering_name,
                cancellation_timeout=5)(lead_peering)
    spawning = registries.get_default_registry()._spawning
    spawning._handlers[-1] = dataclasses.replace(spawning._handlers[-1], requires_finalizer=False)


async def lead_peering(stopped: Any, memo: kopf.Memo, **_: Any) -> None:
    """Runs while kopf has this replica active; `stopped` is set when kopf pauses or exits."""
    st = _state(memo)
    st.peering_daemons += 1
    try:
        if st.leading.is_off():
            st.swept = time.monotonic()  # liveness counts from now, not from before the pause
        await st.leading.turn_to(True)
        log.info("leading: the sweep, work queue and token revocation run here")
        await stopped.wait()
    finally:
        st.peering_daemons -= 1
        if st.peering_daemons == 0:
            await st.leading.turn_to(False)
            log.info("standing by (kopf paused this replica): no sweep, work queue or revocation rounds")


async def _resync_loop(st: State, logger: Any) -> None:
    """Re-plan when the inventory changed, repair what a watch missed, retry what asked to be."""
    while True:
        try:
            await asyncio.wait_for(st.wakeup.wait(), RESYNC_SECONDS)
            await asyncio.sleep(INVENTORY_SETTLE_SECONDS)
        except asyncio.TimeoutError:
            pass
        await st.leading.wait_for(True)  # a standby sweeps nothing; a round begun may finish
        st.wakeup.clear()
        if "nodes" not in st.indexes:
            st.swept = time.monotonic()
            continue  # no handler has run yet: the indexes are not known
        try:
            refresh_inventory(st)
            await sweep(st, logger)
            st.quiet.ok("listing MoEDeployments")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # listing failed (API outage): the next tick retries
            st.quiet.failed("listing MoEDeployments", _cause(e), f"retried in {RESYNC_SECONDS:.0f}s")
        st.swept = time.monotonic()  # the loop goes round: an outage is no reason to restart the pod


def sweep_health(st: State, now: float | None = None) -> dict[str, float]:
    """The liveness answer: the sweep's last round, or an error when it is stuck."""
    if st.leading.is_off():
        return {"standingBy": 1.0}  # a standby sweeps nothing on purpose: not stuck
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
    st = _state(memo)
    loop = asyncio.get_running_loop()
    async def lead_then_work(key: Any) -> float | None:
        await st.leading.wait_for(True)  # a standby applies nothing; the key waits in the queue
        return await work(st, key, logger)

    st.queue = WorkQueue(WORKERS, lead_then_work)
    st.queue.start()
    namespaces = st.cfg.namespaces or None
    st.kube.cache = OwnedCache(st.kube._resource, WATCHED_KINDS, namespaces,
                               lambda kind, type_, obj: loop.call_soon_threadsafe(owned_event, st, kind, type_, obj))
    st.kube.moed_cache = OwnedCache(st.kube._resource, ["MoEDeployment"], namespaces, lambda *_: None, selector=None)
    st.kube.cache.start()
    st.kube.moed_cache.start()
    memo["resync"] = asyncio.create_task(_resync_loop(st, logger))
    # token revocation and policy enforcement: one loop for every object, not a kopf timer per object
    memo["revocation"] = asyncio.create_task(revocation.run(st))


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    for task in (memo.get("resync"), memo.get("revocation")):
        if task:
            task.cancel()
    st = _state(memo)
    for cache in (st.kube.cache, st.kube.moed_cache):
        if cache is not None:
            cache.stop()
    if st.queue is not None:
        await st.queue.stop()


# Owned objects (issue 34 item 1): every event of the watch cache (label-selected on the API server)
# queues its owner, so a deleted or edited Service, ConfigMap or workload is repaired within seconds
# and readiness is refreshed; a workload event that changes nothing a reconcile reads is dropped.

def owned_event(st: State, kind: str, type_: str, obj: dict[str, Any]) -> None:
    owner = owner_name(obj)
    if owner is None:
        return
    meta = obj.get("metadata") or {}
    if kind in ("Deployment", "LeaderWorkerSet"):
        key = (kind, meta.get("namespace"), meta.get("name"))
        seen = owned_essence(obj)
        if type_ == "DELETED":
            st.owned_seen.pop(key, None)
        elif st.owned_seen.get(key) == seen:
            return  # a status-only event (the controller's own bookkeeping): nothing the reconcile reads moved
        else:
            st.owned_seen[key] = seen
    enqueue(st, (meta.get("namespace"), owner), "owned-object")


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
