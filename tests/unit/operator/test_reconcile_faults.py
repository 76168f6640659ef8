"""Every failure reaches the object's status (issue 34 item 5): a missing LeaderWorkerSet CRD is a
Degraded condition with the cause (it escaped as a traceback before status was written); an API
outage is raised to the caller, which logs it once per kind and retries."""

import pytest
import urllib3
import yaml

from moe_operator.kube import ApplyError
from moe_operator.policy import Policy
from moe_operator.reconcile import Config, reconcile
from moe_operator.sample_checkpoints import write_sample
from test_render_placement import classes

SAMPLE = "deploy/samples/demo/deepseek-v3-fp8-multinode.yaml"


class NoLwsKube:
    """What Kube does on a cluster without the LWS CRD: the LeaderWorkerSet lookup raises."""

    def __init__(self):
        self.applied = []

    def get(self, kind, ns, name):
        if kind == "LeaderWorkerSet":
            raise ApplyError("LeaderWorkerSetMissing", "multi-node replicas need the LeaderWorkerSet CRD")
        return None

    def apply(self, obj):
        self.applied.append(obj["kind"])


def cfg(tmp_path):
    return Config(inspect_in_cluster=False, policy=Policy(allowed_host_paths=(str(tmp_path),)))


def body(uri):
    doc = yaml.safe_load(open(SAMPLE))
    doc["spec"]["model"]["uri"] = uri
    return {"metadata": {"namespace": "ns", "name": "m", "uid": "u", "generation": 3}, "spec": doc["spec"]}


def test_a_missing_lws_crd_is_a_condition_with_the_cause(tmp_path):
    d = write_sample("deepseek-v3-fp8", tmp_path / "deepseek-v3-fp8")
    out = reconcile(body(f"file://{d}"), classes(), NoLwsKube(), cfg(tmp_path))
    degraded = next(c for c in out.status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "LeaderWorkerSetMissing"
    assert "LeaderWorkerSet CRD" in degraded["message"] and out.status["observedGeneration"] == 3
    assert ("Warning", "LeaderWorkerSetMissing", degraded["message"]) in out.events and out.retry_after


class DownKube(NoLwsKube):
    def get(self, kind, ns, name):
        raise urllib3.exceptions.MaxRetryError(None, "/apis", "connection refused")


def test_an_unreachable_api_server_is_raised_to_the_caller(tmp_path):
    d = write_sample("deepseek-v3-fp8", tmp_path / "deepseek-v3-fp8")
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        reconcile(body(f"file://{d}"), classes(), DownKube(), cfg(tmp_path))
