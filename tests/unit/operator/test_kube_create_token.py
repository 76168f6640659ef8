"""A create whose answer is lost but which landed (issue 27's loose end): its retry answers 409, or
the next reconcile finds the object. It is the operator's only if it carries the random create token
this process sent (Kube.create/landed); a tenant's object with the same labels and annotations, with
no token, a wrong one, or ours copied onto a re-made object, is never adopted."""

import copy
import itertools

import pytest
import urllib3
from kubernetes.client.rest import ApiException
from kubernetes.dynamic.exceptions import NotFoundError, api_exception

from moe_operator import inspect_job, kube, model_cache
from moe_operator.render import Owner
from test_model_cache_job import _hf_spec

NS = "t"


class _Out:
    def __init__(self, d):
        self.d = d

    def to_dict(self):
        return copy.deepcopy(self.d)


def _timeout():
    return urllib3.exceptions.ReadTimeoutError(None, "/api", "Read timed out. (read timeout=30)")


class Api:
    """An API server in memory. `creates`: what each POST does, in turn: "ok"; "lost" (stored, then
    the client times out); "gone" (as "lost", and the read-back after it times out too); an int (stored, then that HTTP status: 500/504 after etcd wrote it).
    `get_failures`: how many GETs time out before they answer."""

    def __init__(self, creates=(), get_failures=0):
        self.objects, self.creates, self.get_failures = {}, list(creates), get_failures
        self.posts, self.uids = 0, (f"uid-{i}" for i in itertools.count(1))

    def put(self, obj):
        stored = copy.deepcopy(obj)
        stored["metadata"]["uid"] = next(self.uids)
        self.objects[(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])] = stored
        return stored


class Resource:
    def __init__(self, api, kind):
        self.api, self.kind = api, kind

    def create(self, body, namespace, field_manager):
        api = self.api
        api.posts += 1
        key = (self.kind, namespace, body["metadata"]["name"])
        if key in api.objects:
            raise api_exception(ApiException(status=409, reason="AlreadyExists"))
        what = api.creates.pop(0) if api.creates else "ok"
        stored = api.put({**body, "kind": self.kind})
        if what == "gone":
            api.get_failures += 1
        if what in ("lost", "gone"):
            raise _timeout()
        if isinstance(what, int):
            raise api_exception(ApiException(status=what, reason="Timeout"))
        return _Out(stored)

    def get(self, name, namespace, **_):
        if self.api.get_failures:
            self.api.get_failures -= 1
            raise _timeout()
        if (self.kind, namespace, name) not in self.api.objects:
            raise NotFoundError(ApiException(status=404, reason="NotFound"))
        return _Out(self.api.objects[(self.kind, namespace, name)])

    def patch(self, body, name, namespace, content_type, field_manager):
        meta = self.api.objects[(self.kind, namespace, name)]["metadata"]
        for part, values in body["metadata"].items():
            for k, v in values.items():
                if v is None:
                    (meta.get(part) or {}).pop(k, None)
                else:
                    meta.setdefault(part, {})[k] = v
        return _Out(self.api.objects[(self.kind, namespace, name)])


class K(kube.Kube):
    """The real Kube (create, landed, get, merge_patch_metadata) over the in-memory API."""

    def __init__(self, api):
        self.api, self.cache, self.moed_cache = api, None, None

    def _resource(self, kind):
        return Resource(self.api, kind)

    def list_moeds(self, namespaces=None, cached=False):
        return []

    def job_log_tail(self, namespace, job):
        return ""


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    monkeypatch.setattr(kube.time, "sleep", lambda s: None)
    monkeypatch.setattr(model_cache, "RECORD", model_cache.Record())


def _pvc(name="moe-model-x", **annotations):
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": NS, "labels": {"app.kubernetes.io/managed-by": "moe-operator",
                                                                  model_cache.CACHE_LABEL: "true"},
                         "annotations": {model_cache.A_MODEL: "org/m", **annotations}},
            "spec": {"accessModes": ["ReadWriteMany"]}}


def test_a_create_answered_504_after_it_landed_and_then_409_is_ours():
    """The POST is stored but answers 504; the read-back times out too, so the POST is sent again
    and answers 409: the object in the way carries this create's token, so it is ours."""
    api = Api(creates=[504], get_failures=1)
    made = K(api).create(_pvc())
    assert made is not None and made["metadata"]["uid"] == "uid-1" and api.posts == 2
    assert made["metadata"]["annotations"][kube.CREATE_TOKEN]


def test_a_create_that_timed_out_is_adopted_by_its_read_back_or_on_the_next_try():
    api = Api(creates=["lost"])
    assert K(api).create(_pvc())["metadata"]["uid"] == "uid-1" and api.posts == 1  # the read-back found it
    api = Api(creates=["lost"], get_failures=1)  # the read-back times out too: an outage, raised
    k = K(api)
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        k.create(_pvc())
    live = k.get("PersistentVolumeClaim", NS, "moe-model-x")
    assert k.landed(live, "PersistentVolumeClaim") == live  # the next reconcile finds it: ours
    assert K(api).landed(live, "PersistentVolumeClaim") is None  # another process never sent that token


def test_a_tenants_object_with_our_labels_is_never_adopted():
    for token in (None, "0" * 32):  # no token, a guessed one
        api = Api()
        tenant = _pvc()
        if token:
            tenant["metadata"]["annotations"][kube.CREATE_TOKEN] = token
        api.put(tenant)
        k = K(api)
        assert k.create(_pvc()) is None and api.posts == 1  # 409: not ours
        assert k.landed(k.get("PersistentVolumeClaim", NS, "moe-model-x"), "PersistentVolumeClaim") is None


def test_our_token_copied_onto_a_re_made_object_or_with_other_labels_is_refused():
    api = Api(creates=["lost"], get_failures=1)
    k = K(api)
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        k.create(_pvc())
    ours = api.objects[("PersistentVolumeClaim", NS, "moe-model-x")]
    token = ours["metadata"]["annotations"][kube.CREATE_TOKEN]
    # a tenant who read it changes a label the operator sent: not as sent, refused
    relabelled = copy.deepcopy(ours)
    relabelled["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "tenant"
    assert k.landed(relabelled, "PersistentVolumeClaim") is None
    assert k.landed(copy.deepcopy(ours), "PersistentVolumeClaim")["metadata"]["uid"] == ours["metadata"]["uid"]
    # ... then deletes ours and makes its own of the name with our token: another UID, refused
    del api.objects[("PersistentVolumeClaim", NS, "moe-model-x")]
    forged = api.put(_pvc(**{kube.CREATE_TOKEN: token}))
    assert forged["metadata"]["uid"] != ours["metadata"]["uid"]
    assert k.landed(forged, "PersistentVolumeClaim") is None
    # a token of a create that was answered is never accepted again
    k2 = K(Api())
    made = k2.create(_pvc("moe-model-y"))
    again = {**made, "metadata": {**made["metadata"], "uid": "other"}}
    assert k2.landed(again, "PersistentVolumeClaim") is None


def test_a_cache_whose_pvc_create_timed_out_is_the_operators_on_the_next_reconcile(monkeypatch):
    """model_cache.ensure: the PVC's POST lands but its answer and the read-back are lost (the
    reconcile fails); the next reconcile adopts it and creates the fill Job: not "did not make it"."""
    api, s = Api(creates=["gone"]), _hf_spec()
    k = K(api)
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        model_cache.ensure(k, NS, "alpha", s, None, "img:1")
    st = model_cache.ensure(k, NS, "alpha", s, None, "img:1")
    claim = model_cache.source(s).claim
    assert st.state == "Pending" and st.claimUid == api.objects[("PersistentVolumeClaim", NS, claim)]["metadata"]["uid"]
    assert model_cache.RECORD.claims[(NS, claim)] == st.claimUid and st.jobUid
    # the fill Job's answer is lost, its read-back finds it at once
    monkeypatch.setattr(model_cache, "RECORD", model_cache.Record())
    api2 = Api(creates=["ok", "lost"])
    first = model_cache.ensure(K(api2), NS, "alpha", s, None, "img:1")
    assert first.state == "Pending" and first.jobUid == api2.objects[("Job", NS, claim + "-fill")]["metadata"]["uid"]


def test_a_fill_job_lost_then_found_by_the_next_reconcile_is_trusted_a_tenants_is_not(monkeypatch):
    s = _hf_spec()
    claim = model_cache.source(s).claim
    api = Api(creates=["ok", "lost"])
    k = K(api)
    real_get = Resource.get

    def job_read_back_fails(self, name, namespace, **kw):  # only the Job's read-back times out
        if self.kind == "Job" and api.posts == 2 and not getattr(api, "failed_once", False):
            api.failed_once = True
            raise _timeout()
        return real_get(self, name, namespace, **kw)

    monkeypatch.setattr(Resource, "get", job_read_back_fails)
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        model_cache.ensure(k, NS, "alpha", s, None, "img:1")
    monkeypatch.setattr(Resource, "get", real_get)
    st = model_cache.ensure(k, NS, "alpha", s, None, "img:1")
    assert st.state == "Downloading", st.message
    assert st.jobUid == api.objects[("Job", NS, claim + "-fill")]["metadata"]["uid"]
    # a tenant's Job of the name (our labels, no token): Failed, as before
    monkeypatch.setattr(model_cache, "RECORD", model_cache.Record())
    api2 = Api()
    k2 = K(api2)
    fill = model_cache.fill_job(NS, s, "img:1")
    api2.put({**fill, "status": {"succeeded": 1}})
    st = model_cache.ensure(k2, NS, "alpha", s, None, "img:1")
    assert st.state == "Failed" and "did not make it" in st.message


def test_an_inspection_job_whose_create_timed_out_is_read_on_the_next_try():
    api = Api(creates=["lost"], get_failures=1)
    k = K(api)
    owner = Owner("m", NS, "moed-uid")
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        inspect_job.result(k, NS, owner, "pvc://models/x", "img:1")
    name = inspect_job.job_name("pvc://models/x")
    from types import SimpleNamespace as S

    k.core = S(list_namespaced_pod=lambda ns, label_selector: S(items=[]))
    assert inspect_job.result(k, NS, owner, "pvc://models/x", "img:1") is None  # running, ours: no error
    assert model_cache.RECORD.inspect_jobs[(NS, name)] == api.objects[("Job", NS, name)]["metadata"]["uid"]
    # another owner's ownerReferences on a Job carrying our token: not as sent
    other = copy.deepcopy(api.objects[("Job", NS, name)])
    other["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    assert K(api).landed(other, "Job") is None
