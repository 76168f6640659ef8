"""Writes under load (issue 34 item 2) and kopf's own outage lines (item 5)."""

import logging

import pytest
from kubernetes.client.rest import ApiException

from moe_operator import handlers, kube


def _fail(statuses):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= len(statuses):
            raise ApiException(status=statuses[len(calls) - 1], reason="x")
        return "ok"
    return call, calls


def test_a_busy_or_conflicting_api_server_is_retried_a_refused_object_is_not():
    call, calls = _fail([500, 409])
    assert kube._retrying(call, sleep=lambda s: None) == "ok" and len(calls) == 3
    call, calls = _fail([422])
    with pytest.raises(ApiException):
        kube._retrying(call, sleep=lambda s: None)
    assert len(calls) == 1
    call, calls = _fail([504, 504, 504])
    with pytest.raises(ApiException):
        kube._retrying(call, sleep=lambda s: None)
    assert len(calls) == kube.APPLY_ATTEMPTS


class _Created:
    def __init__(self, d):
        self.d = d

    def to_dict(self):
        return self.d


class _Resource:
    """The dynamic client's resource: create answers as told (an ApiException status, or made)."""

    def __init__(self, answers, existing=None):
        self.answers, self.calls, self.existing = list(answers), [], existing

    def create(self, body, namespace, field_manager):
        self.calls.append((namespace, field_manager))
        a = self.answers.pop(0)
        if isinstance(a, int):
            raise ApiException(status=a, reason="x")
        return _Created({**body, "metadata": {**body["metadata"], "uid": "u1"}})

    def get(self, name, namespace):  # the read-back after a 409 or a lost answer
        from kubernetes.dynamic.exceptions import NotFoundError

        if self.existing is None:
            raise NotFoundError(ApiException(status=404, reason="NotFound"))
        return _Created(self.existing)


def _kube_with(res):
    k = kube.Kube.__new__(kube.Kube)
    k.cache = None
    k._resource = lambda kind: res
    return k


def test_create_is_ours_or_none_when_the_name_is_taken(monkeypatch):
    """What the operator adopts by UID is created, never applied: a same-named object made by a tenant
    between our get and our write answers 409, and no field-manager name they choose changes that."""
    monkeypatch.setattr(kube.time, "sleep", lambda s: None)
    pvc = {"kind": "PersistentVolumeClaim", "metadata": {"name": "moe-model-x", "namespace": "t"}}
    res = _Resource([503, "made"])
    assert _kube_with(res).create(pvc)["metadata"]["uid"] == "u1" and len(res.calls) == 2  # busy: retried
    res = _Resource([409], existing={"kind": "PersistentVolumeClaim", "metadata": {  # a tenant's: no token of ours
        "name": "moe-model-x", "namespace": "t", "uid": "tenant"}})
    assert _kube_with(res).create(pvc) is None and len(res.calls) == 1  # taken: never retried, never adopted
    with pytest.raises(kube.ApplyError, match="HTTP 422"):
        _kube_with(_Resource([422])).create(pvc)


def test_the_condition_reason_says_which_failure_it_was():
    assert kube._apply_reason(ApiException(status=422)) == "ApplyInvalid"
    assert kube._apply_reason(ApiException(status=409)) == "ApplyConflict"
    assert kube._apply_reason(ApiException(status=500)) == "ApiServerBusy"
    assert kube._apply_reason(ApiException(status=403)) == "ApplyFailed"


def _record(name, msg, level=logging.ERROR, exc=None):
    r = logging.LogRecord(name, level, __file__, 1, msg, (), (type(exc), exc, None) if exc else None)
    return r


def test_kopf_retry_lines_of_an_outage_are_one_per_kind_without_tracebacks():
    now = [0.0]
    f = handlers.QuietLibraries(clock=lambda: now[0])
    w = "kopf._cogs.clients.watching"
    first = _record(w, "Request attempt #1/6 failed; will retry: GET https://h:1/api/v1/pods -> x",
                    exc=ConnectionRefusedError(111, "refused"))
    assert f.filter(first) and first.exc_info is None  # the cause is the connection: no traceback
    assert not f.filter(_record(w, "Request attempt #2/6 failed; will retry: GET https://h:1/api/v1/pods -> x"))
    assert f.filter(_record(w, "Stopping the watch-stream for pods"))  # another kind of line
    bug = _record("kopf.objects", "Handler failed", exc=KeyError("resources"))
    assert f.filter(bug) and bug.exc_info is not None  # a bug keeps its traceback
    assert f.filter(_record("moe_operator", "ours"))  # our own lines are Quiet's business
    assert f.filter(_record("moe_operator", "ours"))
    now[0] += handlers.QUIET_SECONDS + 1
    assert f.filter(_record(w, "Request attempt #1/6 failed; will retry: GET https://h:1/api/v1/pods -> x"))
