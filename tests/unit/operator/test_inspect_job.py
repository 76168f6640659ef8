"""The pvc:// inspection Job's result is trusted only from the Job the operator made (its UID in the
ledger) and only from pods that Job controls (issue 27 item 3's class, for inspection)."""

import json
from types import SimpleNamespace as NS

from moe_operator import cache_ledger, inspect_job, model_cache
from moe_operator.render import Owner

URI = "pvc://models/dsv3"
OWNER = Owner("m", "ns", "moed-uid")


class Kube:
    def __init__(self):
        self.objects, self.pods, self.deleted = {}, [], []
        self.core = NS(list_namespaced_pod=lambda ns, label_selector: NS(items=[
            p for p in self.pods if p.metadata.labels.get("job-name") == label_selector.split("=", 1)[1]]))

    def get(self, kind, ns, name):
        return self.objects.get((kind, ns, name))

    def apply(self, obj):
        stored = json.loads(json.dumps(obj))
        stored["metadata"]["uid"] = f"uid-{len(self.objects)}"
        self.objects[(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])] = stored
        return stored

    def create(self, obj):
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        return None if key in self.objects else self.apply(obj)

    def landed(self, obj, kind=None):
        return None  # this fake's creates are always answered (test_kube_create_token.py: lost answers)

    def delete(self, kind, ns, name):
        self.deleted.append((kind, ns, name))
        self.objects.pop((kind, ns, name), None)


def pod(job, uid, message, controller=True):
    term = NS(message=json.dumps(message))
    return NS(metadata=NS(labels={"job-name": job}, owner_references=[NS(uid=uid, controller=controller)]),
              status=NS(conditions=[], container_statuses=[NS(state=NS(terminated=term))]))


def _fresh(monkeypatch):
    monkeypatch.setattr(model_cache, "RECORD", cache_ledger.Record(store=("moe-system", cache_ledger.NAME)))


def test_the_operators_own_job_is_read_from_the_pod_it_controls_even_after_a_restart(monkeypatch):
    _fresh(monkeypatch)
    kube = Kube()
    assert inspect_job.result(kube, "ns", OWNER, URI, "img:1") is None  # started
    name = inspect_job.job_name(URI)
    job = kube.get("Job", "ns", name)
    job["status"] = {"succeeded": 1}
    uid = job["metadata"]["uid"]
    kube.pods = [pod(name, "someone-else", {"architecture": "forged"}),  # a pod with the label, not the Job's
                 pod(name, uid, {"architecture": "DeepseekV3ForCausalLM"})]
    _fresh(monkeypatch)  # a restarted operator reads the ledger
    assert inspect_job.result(kube, "ns", OWNER, URI, "img:1") == {"architecture": "DeepseekV3ForCausalLM"}
    assert ("Job", "ns", name) in kube.deleted and model_cache.RECORD.inspect_jobs == {}


def test_a_job_of_that_name_the_operator_did_not_make_is_reported_and_left_alone(monkeypatch):
    _fresh(monkeypatch)
    kube = Kube()
    name = inspect_job.job_name(URI)
    kube.objects[("Job", "ns", name)] = {"metadata": {"name": name, "uid": "tenant"}, "status": {"succeeded": 1}}
    kube.pods = [pod(name, "tenant", {"architecture": "forged"})]
    got = inspect_job.result(kube, "ns", OWNER, URI, "img:1")
    assert "did not make it" in got["error"] and not kube.deleted
