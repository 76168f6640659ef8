"""Ready / Reason through the real API server (issue 32 item 2): the conditions conditions.rollup
writes are accepted by the CRD's status schema, `kubectl get moed` prints READY and REASON from
them (the API server evaluates the printer columns), `kubectl wait --for=condition=Ready` follows
them, and kstatus and Argo CD's health check (tests/health_rules.py) judge the stored object.

No operator runs here: status is written through the status subresource as the operator writes
it, so each state is exact; test_operator.py and test_day2.py run the operator itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import health_rules  # noqa: E402

from moe_operator.conditions import rollup  # noqa: E402
from moe_operator.reconcile import set_condition  # noqa: E402

pytestmark = pytest.mark.integration


def conds(gen, *items):
    out = []
    for type_, status, reason in items:
        out = set_condition(out, type_, status, reason, f"{type_} {reason}", gen)
    return rollup(out, gen)


REFUSED = (("Planned", "False", "PolicyViolation"), ("Available", "False", "NotPlanned"))
READY = (("CheckpointInspected", "True", "Inspected"), ("Planned", "True", "Planned"), ("Degraded", "False", "Applied"),
         ("Available", "True", "ReplicasReady"), ("Progressing", "False", "Complete"))


def write_status(kubectl, ns, name, status):
    kubectl("patch", "moed", name, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status}))


def columns(kubectl, ns, name) -> dict[str, str]:
    head, row = kubectl("get", "moed", name, "-n", ns, "-o", "wide").stdout.splitlines()[:2]
    starts = [i for i, ch in enumerate(head) if ch != " " and (i == 0 or head[i - 1] == " ")]
    cells = [row[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
    return dict(zip(head.split(), cells))


def stored(kubectl, ns, name) -> dict:
    return json.loads(kubectl("get", "moed", name, "-n", ns, "-o", "json").stdout)


def test_ready_and_reason_columns_kstatus_and_argocd(kubectl, namespace, crd):
    exe = health_rules.build()
    obj = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
           "metadata": {"name": "m", "namespace": namespace}, "spec": {"model": {"uri": "hf://org/m"}}}
    kubectl("apply", "-f", "-", input=json.dumps(obj))
    fresh = stored(kubectl, namespace, "m")
    gen = fresh["metadata"]["generation"]
    # before the operator writes anything: the CRD's status default, so kstatus waits (not Current)
    assert fresh["status"] == {"observedGeneration": 0}
    (j,) = health_rules.judge(exe, [fresh])
    assert (j["kstatus"], j["argo"]) == ("InProgress", "Progressing"), j

    write_status(kubectl, namespace, "m", {"observedGeneration": gen, "conditions": conds(gen, *REFUSED)})
    cols = columns(kubectl, namespace, "m")
    assert (cols["READY"], cols["REASON"]) == ("False", "PolicyViolation"), cols
    (j,) = health_rules.judge(exe, [stored(kubectl, namespace, "m")])
    assert (j["kstatus"], j["argo"]) == ("Failed", "Degraded"), j
    assert kubectl("wait", "--for=condition=Ready", "moed/m", "-n", namespace, "--timeout=2s", check=False).returncode != 0

    write_status(kubectl, namespace, "m", {"observedGeneration": gen, "conditions": conds(gen, *READY), "readyReplicas": 1})
    cols = columns(kubectl, namespace, "m")
    assert (cols["READY"], cols["REASON"], cols["SERVING"]) == ("True", "ReplicasReady", "1"), cols
    (j,) = health_rules.judge(exe, [stored(kubectl, namespace, "m")])
    assert (j["kstatus"], j["argo"]) == ("Current", "Healthy"), j
    kubectl("wait", "--for=condition=Ready", "moed/m", "-n", namespace, "--timeout=10s")

    # a spec change the operator has not seen: generation moves, status stays
    kubectl("patch", "moed", "m", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": {"replicas": 2}}))
    now = stored(kubectl, namespace, "m")
    assert now["metadata"]["generation"] == gen + 1
    (j,) = health_rules.judge(exe, [now])
    assert (j["kstatus"], j["argo"]) == ("InProgress", "Progressing") and "generation" in j["kstatusMessage"], j
