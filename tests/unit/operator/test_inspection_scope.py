"""pvc:// inspection facts are keyed by (namespace, claim UID, path) (issue 27 item 7): a namespace
with no such claim, or another claim of the same name, never gets another namespace's facts."""

import pytest

from moe_operator import inspection
from moe_operator.api import MoEDeploymentSpec

FACTS = {"architecture": "DeepseekV3ForCausalLM", "format": "fp8", "formatSource": "config.json"}


@pytest.fixture(autouse=True)
def clean():
    inspection.reset()
    yield
    inspection.reset()


def test_pvc_facts_stay_with_the_claim_they_were_read_from():
    s = MoEDeploymentSpec.model_validate({"model": {"uri": "pvc://models/dsv3"}})
    jobs = []

    def job(uri):
        jobs.append(uri)
        return dict(FACTS)

    claims = {("a", "models"): "uid-a", ("c", "models"): "uid-c"}

    def scope(ns):
        return lambda claim: (ns, claims[(ns, claim)]) if (ns, claim) in claims else None

    assert inspection.inspect_spec(s, pvc_job=job, pvc_scope=scope("a")).format == "fp8"
    assert inspection.inspect_spec(s, pvc_job=job, pvc_scope=scope("a")).format == "fp8" and len(jobs) == 1
    with pytest.raises(inspection.InspectionFailed) as e:  # no such claim there: nothing served
        inspection.inspect_spec(s, pvc_job=job, pvc_scope=scope("b"))
    assert e.value.reason == "NotFound" and "'models'" in e.value.message
    inspection.inspect_spec(s, pvc_job=job, pvc_scope=scope("c"))  # its own claim: its own inspection
    assert len(jobs) == 2
    claims[("a", "models")] = "uid-a2"  # the claim was deleted and made anew: inspected again
    inspection.inspect_spec(s, pvc_job=job, pvc_scope=scope("a"))
    assert len(jobs) == 3
    assert inspection.cached("pvc://models/dsv3") is None  # the webhook has no namespace scope: nothing
    with pytest.raises(inspection.InspectionFailed):  # nor without the scope
        inspection.inspect_spec(s, pvc_job=job)
