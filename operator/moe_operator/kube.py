"""Kubernetes I/O for the operator: server-side apply, status patches, workload readiness, inspection Jobs."""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from . import API_GROUP, API_VERSION, PLURAL
from .day2 import OPTIONAL_CRDS
from . import inspect_job
from .render import FIELD_MANAGER, Owner

log = logging.getLogger("moe_operator.kube")

_API_VERSIONS = {"Deployment": "apps/v1", "Service": "v1", "ConfigMap": "v1",
                 "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1", "Job": "batch/v1",
                 "PersistentVolumeClaim": "v1",  # model caches (model_cache.py)
                 # day-2 objects (day2.py); the last two are optional CRDs (KEDA, Gateway API Inference Extension)
                 "PodDisruptionBudget": "policy/v1", "HorizontalPodAutoscaler": "autoscaling/v2",
                 "ScaledObject": "keda.sh/v1alpha1", "InferencePool": "inference.networking.k8s.io/v1",
                 # the InferencePool's endpoint picker (epp.py)
                 "ServiceAccount": "v1", "Role": "rbac.authorization.k8s.io/v1",
                 "RoleBinding": "rbac.authorization.k8s.io/v1",
                 "MoEDeployment": f"{API_GROUP}/{API_VERSION}"}  # its watch cache (watch_cache.py)


# The per-attempt token of a create (Kube.create): random, kept only in this process's memory.
CREATE_TOKEN = "moe.serving.dev/create-token"
MAX_TOKENS = 4  # tokens remembered per name (creates of it whose answer was lost)


@dataclass
class _Sent:
    """The creates this process sent for one (kind, namespace, name): their tokens and bodies until
    one is answered or found (then `uid`: the object that is ours, and no other)."""
    tokens: list[str] = field(default_factory=list)
    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)
    uid: str | None = None


def _as_sent(body: dict[str, Any], live: dict[str, Any]) -> bool:
    """The live object has the labels, annotations and owner references a create sent."""
    sent, got = body.get("metadata") or {}, live.get("metadata") or {}
    for part in ("labels", "annotations"):
        have = got.get(part) or {}
        if any(have.get(k) != v for k, v in (sent.get(part) or {}).items()):
            return False
    owners = lambda m: sorted((r.get("uid"), r.get("kind"), r.get("name"), bool(r.get("controller")))  # noqa: E731
                              for r in m.get("ownerReferences") or [])
    return owners(sent) == owners(got)


class ApplyError(Exception):
    def __init__(self, reason: str, message: str):
        self.reason, self.message = reason, message
        super().__init__(message)


# Every request of this client gets a (connect, read) timeout unless its caller gave one (issue 27
# item 6): the generated clients default to none, so one stalled connection held its thread for ever.
REQUEST_TIMEOUT = (5.0, float(os.environ.get("MOE_KUBE_TIMEOUT_SECONDS", "30")))


def with_request_timeout(api_client: client.ApiClient, timeout: tuple[float, float] = REQUEST_TIMEOUT) -> client.ApiClient:
    """Give every request through `api_client` (typed, dynamic and discovery calls alike) a default
    timeout: all of them go through its one RESTClientObject.request."""
    rest = api_client.rest_client
    request = rest.request

    def timed(*args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        return request(*args, _request_timeout=_request_timeout or timeout, **kwargs)

    rest.request = timed
    return api_client


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None):
        self.api_client = with_request_timeout(api_client or client.ApiClient())
        # Discovery is resolved once per kind under this lock: the dynamic client's discovery cache
        # is not thread-safe (concurrent reconciles raised KeyError: 'resources' from it).
        self._discovery_lock = threading.Lock()
        self._resources: dict[str, Any] = {}
        self._missing_until: dict[str, float] = {}
        # Reads of owned kinds and of MoEDeployments from watches (watch_cache.OwnedCache), when
        # the handlers started them; None, or a kind not synced: a GET.
        self.cache = None
        self.moed_cache = None
        # Creates whose answer may have been lost, by (kind, namespace, name): create(), landed().
        self._sent_lock = threading.Lock()
        self._sent: dict[tuple[str, str, str], _Sent] = {}

    @cached_property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api_client)

    @cached_property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @cached_property
    def batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self.api_client)

    @cached_property
    def dynamic(self):
        from kubernetes.dynamic import DynamicClient

        return DynamicClient(self.api_client)

    # A CRD found missing is not looked up again for this long: every miss makes the dynamic
    # client re-read the whole discovery document, once per reconcile of every object.
    MISSING_CRD_RECHECK_SECONDS = 15.0

    def _resource(self, kind: str):
        if (res := self._resources.get(kind)) is not None:
            return res
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        with self._discovery_lock:
            if (res := self._resources.get(kind)) is not None:
                return res
            if self._missing_until.get(kind, 0.0) <= time.monotonic():
                try:
                    res = self._resources[kind] = self.dynamic.resources.get(api_version=_API_VERSIONS[kind], kind=kind)
                    return res
                except ResourceNotFoundError:
                    if kind != "LeaderWorkerSet" and kind not in OPTIONAL_CRDS:
                        raise
                    self._missing_until[kind] = time.monotonic() + self.MISSING_CRD_RECHECK_SECONDS
        if kind == "LeaderWorkerSet":
            raise ApplyError("LeaderWorkerSetMissing", "multi-node replicas need the LeaderWorkerSet CRD "
                             "(leaderworkerset.x-k8s.io/v1); install LWS (kubernetes-sigs/lws) first")
        raise ApplyError(*OPTIONAL_CRDS[kind])

    def pvc_uid(self, namespace: str, name: str) -> str | None:
        """The claim's UID (None: no such claim): what pvc:// inspection facts are scoped by."""
        try:
            return self.core.read_namespaced_persistent_volume_claim(name, namespace).metadata.uid
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply with our field manager (force: we own these fields)."""
        res = self._resource(obj["kind"])
        try:
            out = _retrying(lambda: res.server_side_apply(body=obj, namespace=obj["metadata"]["namespace"],
                                                          field_manager=FIELD_MANAGER, force_conflicts=True))
        except ApiException as e:
            raise ApplyError(_apply_reason(e), f"apply {obj['kind']}/{obj['metadata']['name']}: "
                             f"HTTP {e.status}: {_api_message(e)}") from None
        made = out.to_dict()
        if self.cache is not None:
            self.cache.put(obj["kind"], made)  # read-your-writes: the watch event follows
        return made

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create only (POST): the object, or None when one of that name already exists (409) that
        this process did not make. For what the operator adopts by UID (cache PVCs, fill and
        inspection Jobs): an apply would take over a same-named object a tenant made between our
        get and our write, whatever field manager it named; a create cannot.

        A create whose answer is lost (a client timeout, a 500/504 after etcd stored it) may have
        landed: its retry then answers 409 for our own object. So each create carries a random
        token (annotation CREATE_TOKEN) this process keeps in memory, and an object found in the
        way is ours only if it carries that very token, with the labels, annotations and owners we
        sent (landed()). A tenant's object made before the create cannot carry a token that did
        not exist yet; one made after it cannot exist (the name is taken)."""
        res = self._resource(obj["kind"])
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        token = secrets.token_hex(16)
        body = {**obj, "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), CREATE_TOKEN: token}}}
        sent = self._sent_creates()
        with self._sent_lock:
            entry = sent.get((obj["kind"], ns, name))
            if entry is None or entry.uid is not None:  # a new create of this name: earlier ones were answered
                entry = sent[(obj["kind"], ns, name)] = _Sent()
            entry.tokens = [*entry.tokens[-(MAX_TOKENS - 1):], token]
            entry.bodies[token] = body
        for i in range(APPLY_ATTEMPTS):
            try:
                made = res.create(body=body, namespace=ns, field_manager=FIELD_MANAGER).to_dict()
            except ApiException as e:
                if e.status == 409:
                    return self._found_in_the_way(obj["kind"], ns, name)
                if e.status not in CREATE_RETRIED_STATUSES:
                    raise ApplyError(_apply_reason(e), f"create {obj['kind']}/{name}: "
                                     f"HTTP {e.status}: {_api_message(e)}") from None
                if i == APPLY_ATTEMPTS - 1:
                    raise ApplyError(_apply_reason(e), f"create {obj['kind']}/{name}: HTTP {e.status}: "
                                     f"{_api_message(e)} (it may have landed: the next try adopts it by its "
                                     "create token)") from None
                failure: BaseException = e
            except (OSError, urllib3.exceptions.HTTPError) as e:  # no answer at all: it may have landed
                failure = e
            else:
                self._bind(obj["kind"], ns, name, (made.get("metadata") or {}).get("uid"))
                if self.cache is not None:
                    self.cache.put(obj["kind"], made)
                return made
            # The answer was lost or the server was busy: look before sending it again.
            try:
                live = self.get(obj["kind"], ns, name, cached=False)
            except (ApiException, OSError, urllib3.exceptions.HTTPError):
                live = None
            if live is not None:
                return self.landed(live, obj["kind"])
            if not isinstance(failure, ApiException):
                raise failure  # an outage: the caller's retry (the token stays known: landed())
            time.sleep(0.2 * 2 ** i)
        raise AssertionError("unreachable")

    def _sent_creates(self) -> dict[tuple[str, str, str], "_Sent"]:
        if "_sent" not in self.__dict__:  # (tests build a Kube without __init__)
            self.__dict__.setdefault("_sent_lock", threading.Lock())
            self.__dict__.setdefault("_sent", {})
        return self._sent

    def _bind(self, kind: str, ns: str, name: str, uid: str | None) -> None:
        sent = self._sent_creates()
        with self._sent_lock:
            entry = sent.get((kind, ns, name))
            if entry is not None and uid:
                entry.uid, entry.bodies = uid, {}

    def _found_in_the_way(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        try:
            live = self.get(kind, ns, name, cached=False)
        except (ApiException, OSError, urllib3.exceptions.HTTPError):
            return None  # not known now: the next reconcile finds it and asks landed()
        return self.landed(live, kind) if live is not None else None

    def landed(self, live: dict[str, Any], kind: str | None = None) -> dict[str, Any] | None:
        """`live` if it is the object an earlier create of this process sent whose answer was lost:
        it carries one of the tokens sent for that name, and the labels, annotations and owner
        references sent with it. The first such object seen is bound by its UID, so another one
        carrying a copied token (the first deleted and re-made by a tenant who read it) is not.
        None for anything else (a tenant's object, or a token this process never sent)."""
        meta = live.get("metadata") or {}
        key = (kind or live.get("kind") or "", meta.get("namespace") or "", meta.get("name") or "")
        token, uid = (meta.get("annotations") or {}).get(CREATE_TOKEN), meta.get("uid")
        if not token or not uid:
            return None
        sent = self._sent_creates()
        with self._sent_lock:
            entry = sent.get(key)
            if entry is None:
                return None
            if entry.uid is not None:
                return live if entry.uid == uid and token in entry.tokens else None
            body = entry.bodies.get(token)
            if body is None or not _as_sent(body, live):
                return None
            entry.uid, entry.bodies = uid, {}
        log.info("%s %s/%s: our create's answer was lost, but it landed (its create token): adopted, UID %s",
                 key[0], key[1], key[2], uid)
        if self.cache is not None:
            self.cache.put(key[0], live)
        return live

    def merge_patch(self, obj: dict[str, Any]) -> None:
        """JSON merge patch of the object's spec: lists are replaced whole, which removes items
        another field manager added (server-side apply keeps those)."""
        res = self._resource(obj["kind"])
        try:
            out = _retrying(lambda: res.patch(body={"spec": obj["spec"]}, name=obj["metadata"]["name"],
                                              namespace=obj["metadata"]["namespace"],
                                              content_type="application/merge-patch+json", field_manager=FIELD_MANAGER))
        except ApiException as e:
            raise ApplyError(_apply_reason(e), f"patch {obj['kind']}/{obj['metadata']['name']}: "
                             f"HTTP {e.status}: {_api_message(e)}") from None
        if self.cache is not None:
            self.cache.put(obj["kind"], out.to_dict())

    def get(self, kind: str, namespace: str, name: str, cached: bool = True) -> dict[str, Any] | None:
        """`cached` False: from the API, for an object the label-selected cache cannot see (not ours)."""
        from kubernetes.dynamic.exceptions import NotFoundError

        if cached and self.cache is not None:
            hit, obj = self.cache.get(kind, namespace, name)
            if hit:
                return obj
        try:
            return self._resource(kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def delete(self, kind: str, namespace: str, name: str) -> None:
        from kubernetes.dynamic.exceptions import NotFoundError

        try:
            self._resource(kind).delete(name=name, namespace=namespace, propagation_policy="Background")
        except NotFoundError:
            pass
        if self.cache is not None:
            self.cache.forget(kind, namespace, name)

    def get_moed(self, namespace: str, name: str, cached: bool = False) -> dict[str, Any] | None:
        """The MoEDeployment; `cached`: from the watch cache when it is synced (the sweep and
        owned-object events; kopf's handlers read afresh: their event may be newer than the cache)."""
        if cached and self.moed_cache is not None:
            hit, obj = self.moed_cache.get("MoEDeployment", namespace, name)
            if hit:
                return obj
        try:
            return self.custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list_moeds(self, namespaces: list[str] | None = None, cached: bool = False) -> list[dict[str, Any]]:
        if cached and self.moed_cache is not None and self.moed_cache.synced("MoEDeployment"):
            return self.moed_cache.all("MoEDeployment")
        if namespaces:
            return [o for ns in namespaces for o in
                    self.custom.list_namespaced_custom_object(API_GROUP, API_VERSION, ns, PLURAL)["items"]]
        return self.custom.list_cluster_custom_object(API_GROUP, API_VERSION, PLURAL)["items"]

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            out = self.custom.patch_namespaced_custom_object_status(API_GROUP, API_VERSION, namespace, PLURAL, name,
                                                                    {"status": status})
        except ApiException as e:
            if e.status != 404:
                raise
            return
        if self.moed_cache is not None and isinstance(out, dict):
            self.moed_cache.put("MoEDeployment", out)  # the sweep sees our own write as no change

    def patch_webhook_ca(self, name: str, ca: bytes) -> None:
        """Write our CA into every webhook of the chart's ValidatingWebhookConfiguration."""
        import base64

        api = client.AdmissionregistrationV1Api(self.api_client)
        vwc = api.read_validating_webhook_configuration(name)
        bundle = base64.b64encode(ca).decode()
        patch = {"webhooks": [{"name": w.name, "clientConfig": {"caBundle": bundle}} for w in vwc.webhooks or []]}
        api.patch_validating_webhook_configuration(name, patch)

    def _secret(self, namespace: str, name: str):
        try:
            return self.core.read_namespaced_secret(name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def secret_labels(self, namespace: str, name: str) -> dict[str, str] | None:
        """The Secret's labels (None: no such Secret); its data is not kept."""
        s = self._secret(namespace, name)
        return None if s is None else dict(s.metadata.labels or {})

    def post_event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about a MoEDeployment, posted directly (works from any task, unlike
        kopf's event queue, which exists only inside kopf's handler context)."""
        import datetime as dt
        import uuid

        meta = obj["metadata"]
        now = dt.datetime.now(dt.timezone.utc)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"{meta['name']}.{uuid.uuid4().hex[:12]}", namespace=meta["namespace"]),
            involved_object=client.V1ObjectReference(api_version=f"{API_GROUP}/{API_VERSION}", kind="MoEDeployment",
                                                     name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid"),
                                                     resource_version=meta.get("resourceVersion")),
            type=type_, reason=reason, message=message[:1000], count=1, first_timestamp=now, last_timestamp=now,
            source=client.V1EventSource(component=FIELD_MANAGER), reporting_component=FIELD_MANAGER,
            reporting_instance=FIELD_MANAGER)
        self.core.create_namespaced_event(meta["namespace"], body)

    def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        import base64

        s = self._secret(namespace, name)
        raw = (s.data or {}).get(key) if s is not None else None
        return base64.b64decode(raw).decode() if raw else None

    # --- inspection Job (pvc://, and file:// paths only nodes can see) -----------------------

    def inspection_job(self, namespace: str, owner: Owner, uri: str, image: str) -> dict[str, Any] | None:
        """Run (or look at) the inspection Job for `uri`. None while running, else the parsed result
        (read only from the Job the operator made, by UID: inspect_job.py)."""
        return inspect_job.result(self, namespace, owner, uri, image)

    # --- model caches (model_cache.py) ---------------------------------------------------------

    def merge_patch_metadata(self, kind: str, namespace: str, name: str, metadata: dict[str, Any]) -> None:
        """JSON merge patch of labels/annotations (None removes a key): several MoEDeployments mark
        one shared cache PVC without taking each other's marks away, as an apply would."""
        try:
            out = self._resource(kind).patch(body={"metadata": metadata}, name=name, namespace=namespace,
                                             content_type="application/merge-patch+json", field_manager=FIELD_MANAGER)
        except ApiException as e:
            raise ApplyError("ApplyFailed", f"patch {kind}/{name}: {_api_message(e)}") from None
        if self.cache is not None:
            self.cache.put(kind, out.to_dict())

    def list_labeled(self, kind: str, namespace: str | None, selector: str) -> list[dict[str, Any]]:
        """Objects of `kind` with these labels in one namespace (None: every namespace)."""
        return [o.to_dict() for o in self._resource(kind).get(namespace=namespace, label_selector=selector).items]

    def _job_pods(self, namespace: str, job: str):
        return self.core.list_namespaced_pod(namespace, label_selector=f"job-name={job}").items

    def job_termination_message(self, namespace: str, job: str) -> dict[str, Any] | None:
        """The JSON its pod's container left as termination message (current or last state), from
        the newest pod that left one (restartPolicy Never: one pod per attempt)."""
        pods = sorted(self._job_pods(namespace, job), key=_created, reverse=True)
        for pod in pods:
            for cs in pod.status.container_statuses or []:
                for state in (cs.state, cs.last_state):
                    term = state.terminated if state else None
                    if term and term.message:
                        try:
                            return json.loads(term.message.strip().splitlines()[-1])
                        except (json.JSONDecodeError, IndexError):
                            return {"error": term.message.strip()[-2000:]}
        return None

    def job_log_tail(self, namespace: str, job: str) -> str:
        """The last lines of a running Job pod's log (its progress lines); '' when there is none."""
        for pod in self._job_pods(namespace, job):
            if (pod.status.phase or "") != "Running":
                continue
            try:
                return self.core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=5) or ""
            except ApiException:
                return ""
        return ""


# Answers of an apply that say "again, shortly" rather than "this object is wrong": the API server
# under load (500 etcd timeouts, 504, 429 with Retry-After) and 409 (an optimistic-concurrency clash
# with another writer of the same object). 422 is never retried: the object itself was refused.
RETRIED_STATUSES = (409, 429, 500, 503, 504)
# A create's 409 means the name is taken: never retried (Kube.create answers None).
CREATE_RETRIED_STATUSES = tuple(s for s in RETRIED_STATUSES if s != 409)
APPLY_ATTEMPTS = 3


def _retrying(call: Any, attempts: int = APPLY_ATTEMPTS, sleep: Any = time.sleep,
              statuses: tuple[int, ...] = RETRIED_STATUSES) -> Any:
    for i in range(attempts):
        try:
            return call()
        except ApiException as e:
            if e.status not in statuses or i == attempts - 1:
                raise
            sleep(0.2 * 2 ** i)


def _apply_reason(e: ApiException) -> str:
    """The condition reason of a failed write: a refused object (422) is not a busy server."""
    return {422: "ApplyInvalid", 409: "ApplyConflict"}.get(e.status, "ApplyFailed" if e.status < 500
                                                                      else "ApiServerBusy")


def _created(obj) -> float:
    t = obj.metadata.creation_timestamp
    return t.timestamp() if t else 0.0


def _api_message(e: ApiException) -> str:
    try:
        return json.loads(e.body).get("message", str(e))
    except Exception:
        return f"HTTP {e.status}: {e.reason}"
