"""The model cache record survives an operator restart (cache_ledger.py): a restarted operator
reuses the cache PVC it made, and collects an unused one on the clock it started before the
restart; a ledger it cannot read leaves every cache alone."""

import datetime as dt
import json

from moe_operator import cache_ledger, model_cache
from test_model_cache_job import GcKube, _hf_spec

STORE = ("moe-system", cache_ledger.NAME)


def _restart(monkeypatch):
    """A new operator process: an empty in-memory record that reads the stored one."""
    rec = cache_ledger.Record(store=STORE)
    monkeypatch.setattr(model_cache, "RECORD", rec)
    return rec


def _stored(kube):
    return json.loads(kube.get("ConfigMap", *STORE)["data"][cache_ledger.KEY])


def test_a_restarted_operator_reuses_its_cache_and_its_job(monkeypatch):
    kube, s = GcKube(), _hf_spec()
    _restart(monkeypatch)
    first = model_cache.ensure(kube, "ns", "alpha", s, None, "img:1")
    assert first.state == "Pending" and first.claimUid and first.jobUid
    assert _stored(kube)["claims"] == {f"ns/{first.claimName}": first.claimUid}
    assert _stored(kube)["jobs"] == {first.claimUid: first.jobUid}
    _restart(monkeypatch)  # no MoEDeployment status names the cache (FakeKube lists none)
    again = model_cache.ensure(kube, "ns", "beta", s, None, "img:1")
    assert again.state != "Failed", again.message
    assert (again.claimUid, again.jobUid) == (first.claimUid, first.jobUid)


def test_the_unused_clock_and_the_collection_survive_restarts(monkeypatch):
    kube, s = GcKube(), _hf_spec()
    _restart(monkeypatch)
    made = model_cache.ensure(kube, "ns", "alpha", s, None, "img:1")
    model_cache.release(kube, "ns", "alpha")
    t0 = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
    _restart(monkeypatch)
    assert model_cache.collect(kube, "ns", 60, now=t0) == []
    assert _stored(kube)["unusedSince"] == {made.claimUid: "2030-01-01T00:00:00Z"}
    _restart(monkeypatch)  # the grace period runs from t0, not from this process's start
    assert model_cache.collect(kube, "ns", 60, now=t0 + dt.timedelta(seconds=61)) == [made.claimName]
    assert kube.get("PersistentVolumeClaim", "ns", made.claimName) is None
    assert kube.get("Job", "ns", made.claimName + "-fill") is None
    assert _stored(kube)["claims"] == {} and _stored(kube)["jobs"] == {}


def test_a_claim_deleted_by_hand_leaves_the_record(monkeypatch):
    kube, s = GcKube(), _hf_spec()
    _restart(monkeypatch)
    made = model_cache.ensure(kube, "ns", "alpha", s, None, "img:1")
    kube.delete("PersistentVolumeClaim", "ns", made.claimName)
    model_cache.collect(kube, "ns", 60)
    assert _stored(kube)["claims"] == {}


def test_an_unreadable_ledger_means_no_cache_is_the_operators(monkeypatch, caplog):
    kube, s = GcKube(), _hf_spec()
    claim = model_cache.source(s).claim
    kube.apply({"kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": "ns",
                                                               "labels": {model_cache.CACHE_LABEL: "true"}}})
    kube.apply({"kind": "ConfigMap", "metadata": {"name": STORE[1], "namespace": STORE[0]},
                "data": {cache_ledger.KEY: "{not json"}})
    _restart(monkeypatch)
    st = model_cache.ensure(kube, "ns", "alpha", s, None, "img:1")
    assert st.state == "Failed" and "did not make it" in st.message
    assert model_cache.collect(kube, "ns", 0) == []
    assert kube.get("PersistentVolumeClaim", "ns", claim) is not None
    assert "unreadable" in caplog.text


def test_the_ledger_lives_in_the_operators_namespace_only(monkeypatch):
    monkeypatch.setenv("MOE_OPERATOR_NAMESPACE", "moe-system")
    assert cache_ledger.location() == STORE
    monkeypatch.setenv("MOE_OPERATOR_NAMESPACE", "")
    assert cache_ledger.location() is None  # a local run: memory only, nothing written
    rec = cache_ledger.Record()
    kube = GcKube()
    rec.claims[("ns", "c")] = "u"
    rec.save(kube)
    assert kube.objects == {}


class _Refusing(GcKube):
    def __init__(self, status):
        super().__init__()
        self.status = status

    def get(self, kind, ns, name):
        if kind == "ConfigMap":
            e = RuntimeError("forbidden" if self.status == 403 else "connection refused")
            e.status = self.status
            raise e
        return super().get(kind, ns, name)


def test_a_ledger_the_rbac_forbids_falls_back_to_memory_and_an_outage_is_retried(monkeypatch, caplog):
    import pytest

    kube, s = _Refusing(403), _hf_spec()
    rec = _restart(monkeypatch)
    assert model_cache.ensure(kube, "ns", "alpha", s, None, "img:1").state == "Pending"
    assert rec.store is None and "cannot be read" in caplog.text
    kube, rec = _Refusing(503), _restart(monkeypatch)
    with pytest.raises(RuntimeError):  # not loaded: nothing stored is overwritten by a partial record
        model_cache.ensure(kube, "ns", "alpha", s, None, "img:1")
    assert not rec.loaded and ("ConfigMap", *STORE) not in kube.objects
