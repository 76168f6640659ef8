"""An informer-style cache of the objects the operator owns (issue 34 item 1).

One list + watch per kind (per watched namespace), filtered on the API server by the operator's
label, so the cache holds only our objects, never every ConfigMap of the cluster. Reads of owned
objects are served from it (no GET per object per sweep); every watch event is handed to
`on_event`, which is how a deleted or edited owned object is repaired within a second or two.

Kubernetes' client is blocking: each watch runs on a thread of its own. A kind whose list or watch
is refused (RBAC without list/watch, CRD not installed) is not cached: reads of it go to the API
(`get` answers a miss), and the cache tries again later. While a watch reconnects (an API outage,
a 410 Gone) its kind is not synced and reads go to the API too; the relist brings it back.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kubernetes import watch
from kubernetes.client.rest import ApiException

log = logging.getLogger("moe_operator.watch_cache")

SELECTOR = "app.kubernetes.io/managed-by=moe-operator"
WATCH_SECONDS = 300  # the API server ends a watch after this; it is resumed from its resourceVersion
RETRY_SECONDS = (1.0, 2.0, 5.0, 10.0)  # backoff of a failed list/watch (an outage over: back within 10 s)
REFUSED_RETRY_SECONDS = 60.0  # a kind whose list is refused (403, no CRD) is tried again after this

Key = tuple[str, str]  # (namespace, name)
# Watches failing now, across every cache of the process (kind -> cause): an outage fails them all
# the same way, so it is one log line when the first fails and one when the last is back.
_failing: dict[str, str] = {}
_failing_lock = threading.Lock()
# (kind, event type, object): ADDED / MODIFIED / DELETED as the API server says, and the same
# types for what a relist found changed or gone (a watch gap is not lost)
OnEvent = Callable[[str, str, dict[str, Any]], None]


@dataclass
class _Scope:
    """One list + watch: a kind in one namespace (None: all namespaces)."""

    kind: str
    namespace: str | None
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    synced: bool = False
    refused: str | None = None  # why the API refused to list it (not cached meanwhile)


def key_of(obj: dict[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def relist_changes(old: dict[Key, dict], new: dict[Key, dict]) -> list[tuple[str, dict]]:
    """What a relist tells that the watch may have missed (pure): objects gone, new or changed
    (by resourceVersion) since the last state seen."""
    out = [("DELETED", obj) for k, obj in old.items() if k not in new]
    for k, obj in new.items():
        before = old.get(k)
        if before is None:
            out.append(("ADDED", obj))
        elif (before.get("metadata") or {}).get("resourceVersion") != (obj.get("metadata") or {}).get("resourceVersion"):
            out.append(("MODIFIED", obj))
    return out


class OwnedCache:
    def __init__(self, resource: Callable[[str], Any], kinds: list[str], namespaces: list[str] | None,
                 on_event: OnEvent, selector: str = SELECTOR):
        """`resource(kind)`: the dynamic client's resource (Kube._resource)."""
        self.resource, self.selector, self.on_event = resource, selector, on_event
        self._lock = threading.Lock()
        self._scopes = {(k, ns): _Scope(k, ns) for k in kinds for ns in (namespaces or [None])}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failures: dict[str, str] = {}  # kind -> the last list/watch failure (for one log line per kind)

    # --- reads --------------------------------------------------------------------------------

    def _scope(self, kind: str, namespace: str) -> _Scope | None:
        return self._scopes.get((kind, namespace)) or self._scopes.get((kind, None))

    def get(self, kind: str, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        """(hit, object): hit False when the kind is not cached or not synced (ask the API).
        The object is a copy: callers may change it."""
        sc = self._scope(kind, namespace)
        with self._lock:
            if sc is None or not sc.synced:
                return False, None
            obj = sc.objects.get((namespace, name))
        return True, copy.deepcopy(obj) if obj is not None else None

    def synced(self, kind: str) -> bool:
        with self._lock:
            return all(sc.synced for (k, _), sc in self._scopes.items() if k == kind)

    def all(self, kind: str) -> list[dict[str, Any]]:
        """Every cached object of `kind` (not copies: read only)."""
        with self._lock:
            return [o for (k, _), sc in self._scopes.items() if k == kind for o in sc.objects.values()]

    def owned_by(self, kind: str, namespace: str, owner: str) -> list[dict[str, Any]]:
        """The cached objects of `kind` whose MoEDeployment owner is `owner` (not copies: read only)."""
        sc = self._scope(kind, namespace)
        with self._lock:
            objs = list(sc.objects.values()) if sc else []
        return [o for o in objs if (o.get("metadata") or {}).get("namespace") == namespace
                and owner_name(o) == owner]

    # --- writes we made (read-your-writes: the watch event comes a moment later) --------------

    def put(self, kind: str, obj: dict[str, Any]) -> None:
        sc = self._scope(kind, key_of(obj)[0])
        if sc is None:
            return
        with self._lock:
            old = sc.objects.get(key_of(obj))
            if old is None or _rv(obj) >= _rv(old):
                sc.objects[key_of(obj)] = obj

    def forget(self, kind: str, namespace: str, name: str) -> None:
        sc = self._scope(kind, namespace)
        if sc is not None:
            with self._lock:
                sc.objects.pop((namespace, name), None)

    # --- the watches --------------------------------------------------------------------------

    def start(self) -> None:
        for sc in self._scopes.values():
            t = threading.Thread(target=self._run, args=(sc,), daemon=True,
                                 name=f"moe-watch-{sc.kind}-{sc.namespace or 'all'}")
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()

    def wait_synced(self, timeout: float) -> bool:
        """True once every kind that can be listed is (refused kinds do not count)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(sc.synced or sc.refused for sc in self._scopes.values()):
                    return True
            time.sleep(0.05)
        return False

    def _run(self, sc: _Scope) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                rv = self._relist(sc)
                failures = 0
                while not self._stop.is_set():
                    rv = self._watch(sc, rv)
                    if rv is None:
                        break  # expired (410): relist
            except ApiException as e:
                with self._lock:
                    sc.synced = False
                if e.status in (403, 404):
                    with self._lock:
                        first = sc.refused is None
                        sc.refused = f"HTTP {e.status}"
                    if first:
                        log.warning("not caching %s (list/watch answered HTTP %s): reads of it go to the API; "
                                    "tried again every %.0fs", sc.kind, e.status, REFUSED_RETRY_SECONDS)
                    self._stop.wait(REFUSED_RETRY_SECONDS)
                    continue
                failures += 1
                self._failed(sc, f"HTTP {e.status}")
                self._stop.wait(RETRY_SECONDS[min(failures, len(RETRY_SECONDS)) - 1])
            except Exception as e:  # noqa: BLE001 - an outage (connection refused, timeouts): retry
                from kubernetes.dynamic.exceptions import ResourceNotFoundError

                with self._lock:
                    sc.synced = False
                if isinstance(e, ResourceNotFoundError) or type(e).__name__ == "ApplyError":
                    with self._lock:
                        sc.refused = "no such resource"
                    self._stop.wait(REFUSED_RETRY_SECONDS)
                    continue
                failures += 1
                self._failed(sc, f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0][:200])
                self._stop.wait(RETRY_SECONDS[min(failures, len(RETRY_SECONDS)) - 1])

    def _failed(self, sc: _Scope, why: str) -> None:
        """One line while any watch keeps failing (an outage fails every watch the same way)."""
        self.failures[sc.kind] = why
        with _failing_lock:
            first = not _failing
            _failing[sc.kind] = why
        if first:
            log.warning("watches of the operator's objects failed (%s: %s); their reads go to the API until they "
                        "are back, retried with backoff", sc.kind, why)

    def _relist(self, sc: _Scope) -> str:
        res = self.resource(sc.kind)
        listed = res.get(namespace=sc.namespace, label_selector=self.selector).to_dict()
        new = {key_of(o): _with_kind(o, sc.kind, listed) for o in listed.get("items") or []}
        with self._lock:
            changes = relist_changes(sc.objects, new) if sc.synced or sc.objects else []
            sc.objects, sc.synced, sc.refused = new, True, None
        if self.failures.pop(sc.kind, None) is not None:
            with _failing_lock:
                _failing.pop(sc.kind, None)
                last = not _failing
            if last:
                log.info("watches of the operator's objects: back")
        for type_, obj in changes:
            self._emit(sc.kind, type_, obj)
        return (listed.get("metadata") or {}).get("resourceVersion") or ""

    def _watch(self, sc: _Scope, rv: str) -> str | None:
        """Follow one watch until the server ends it; the resourceVersion to resume from, or None
        when it expired (410 Gone) and a relist is needed."""
        res = self.resource(sc.kind)
        w = watch.Watch()
        try:
            for ev in w.stream(res.get, namespace=sc.namespace, label_selector=self.selector, resource_version=rv,
                               allow_watch_bookmarks=True, timeout_seconds=WATCH_SECONDS, serialize=False,
                               _request_timeout=(5.0, WATCH_SECONDS + 30.0)):
                if self._stop.is_set():
                    return rv
                type_, obj = ev.get("type"), ev.get("raw_object") or {}
                if type_ == "ERROR":
                    if obj.get("code") == 410:
                        return None
                    raise RuntimeError(f"watch error: {obj.get('message') or obj}")
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                if type_ == "BOOKMARK":
                    continue
                obj = _with_kind(obj, sc.kind)
                with self._lock:
                    if type_ == "DELETED":
                        sc.objects.pop(key_of(obj), None)
                    else:
                        sc.objects[key_of(obj)] = obj
                self._emit(sc.kind, type_, obj)
        except ApiException as e:
            if e.status == 410:
                return None
            raise
        finally:
            w.stop()
        return rv

    def _emit(self, kind: str, type_: str, obj: dict[str, Any]) -> None:
        try:
            self.on_event(kind, type_, obj)
        except Exception:  # noqa: BLE001 - a bug in the callback must not stop the watch
            log.exception("owned-object event handler failed on %s %s/%s", kind, *key_of(obj))


def owner_name(obj: dict[str, Any]) -> str | None:
    """The MoEDeployment that owns `obj` (its ownerReference), or None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "MoEDeployment":
            return ref.get("name")
    return None


def _rv(obj: dict[str, Any]) -> int:
    """resourceVersion as a number, to keep the newer of a write we made and a watch event (etcd's
    revisions are integers; anything else counts as 0, i.e. the next event replaces it)."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def _with_kind(obj: dict[str, Any], kind: str, listed: dict[str, Any] | None = None) -> dict[str, Any]:
    """A list's items carry no kind/apiVersion; the drift check and the callers expect them."""
    obj.setdefault("kind", kind)
    if listed and "apiVersion" not in obj and listed.get("apiVersion"):
        obj["apiVersion"] = listed["apiVersion"]
    return obj
