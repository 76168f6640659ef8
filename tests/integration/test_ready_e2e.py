"""Ready / Reconciling / Stalled written by the running operator (issue 32 item 2), judged by
kstatus and Argo CD's health check (tests/health_rules.py): a sample becomes Ready (kstatus
Current, Argo Healthy), then a spec no GPU class can run is Stalled (Failed, Degraded), with the
READY and REASON columns `kubectl get moed` prints.

Skipped until reconcile.py writes the rollup (conditions.rollup; the call site is helper S34's
file): then it runs as is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import health_rules  # noqa: E402


from .operator_fixture import condition, get_json, wait_for  # noqa: E402
from .test_operator import apply_sample  # noqa: E402

pytestmark = pytest.mark.integration


def columns(kubectl, ns, name) -> dict[str, str]:
    head, row = kubectl("get", "moed", name, "-n", ns).stdout.splitlines()[:2]
    return dict(zip(head.split(), row.split()))


def test_ready_then_stalled_as_the_operator_writes_them(kubectl, namespace, operator):
    exe = health_rules.build()
    name = apply_sample(kubectl, namespace, "deepseek-v3-nvfp4-b200.yaml")["metadata"]["name"]

    def at(type_, status):
        def check():
            o = get_json(kubectl, "moed", name, "-n", namespace)
            c = condition(o, type_)
            return o if c and c["status"] == status and o["status"].get("observedGeneration") == \
                o["metadata"]["generation"] else None
        return check

    o = wait_for(at("Ready", "True"), 90, "Ready=True", operator.log_tail)
    assert condition(o, "Stalled")["status"] == "False" and condition(o, "Reconciling")["status"] == "False"
    cols = columns(kubectl, namespace, name)
    assert (cols["READY"], cols["REASON"]) == ("True", "ReplicasReady"), cols
    (j,) = health_rules.judge(exe, [o])
    assert (j["kstatus"], j["argo"]) == ("Current", "Healthy"), j

    kubectl("patch", "moed", name, "-n", namespace, "--type=merge",
            "-p", '{"spec":{"gpu":{"allowedArchitectures":["sm90"]},"moe":{"runnerBackend":"flashinfer_trtllm"}}}')
    o = wait_for(at("Stalled", "True"), 60, "Stalled=True", operator.log_tail)
    assert condition(o, "Ready")["status"] == "False" and condition(o, "Stalled")["reason"] == "NoFeasibleGpuClass"
    cols = columns(kubectl, namespace, name)
    assert (cols["READY"], cols["REASON"]) == ("False", "NoFeasibleGpuClass"), cols
    (j,) = health_rules.judge(exe, [o])
    assert (j["kstatus"], j["argo"]) == ("Failed", "Degraded"), j
