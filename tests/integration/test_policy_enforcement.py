"""A policy that tightens under a running workload (policy.onViolation, --on-policy-violation),
through the real API server and real operator restarts. The policy is the operator's flags (the
chart's policy values become them), so an admin tightening it restarts the operator with new ones:
here a workload deployed from an allowed registry, then the registry taken off the list.
- keep (the default): the workload runs on as it was; the object reports PolicyViolation and a
  change to it is not rendered.
- scaleToZero: the workload is scaled to 0 with a PolicyEnforced Event and stays there; once the
  spec is allowed again it is rendered and scaled back.
The operator runs as the chart's ServiceAccount (cluster-wide RBAC of the default values)."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from .operator_fixture import SAMPLES, OperatorProcess, chart_service_account_kubeconfig, condition, forbidden_lines, \
    get_json, wait_for

pytestmark = pytest.mark.integration
ALLOWED, OTHER = "docker.io/lmsysorg", "ghcr.io/moe-operator"
IMAGE = "docker.io/lmsysorg/sglang:v0.5.2-cu126"


@pytest.fixture(scope="module")
def operators(crd, dev_cluster, kubectl, tmp_path_factory):
    """start(*flags) -> a running operator with the demo models and these policy flags; stop() the
    previous one first. None of their requests may have been refused by the chart's RBAC."""
    d = tmp_path_factory.mktemp("operator-policy")
    kc = chart_service_account_kubeconfig(dev_cluster, kubectl, d / "sa.kubeconfig")
    started: list[OperatorProcess] = []

    def start(*flags: str) -> OperatorProcess:
        for op in started:
            op.stop()
        op = OperatorProcess(str(kc), d / f"operator-{len(started)}.log", extra=list(flags))
        op.start()
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
    for op in started:
        refused = forbidden_lines(op.log_path.read_text(errors="replace"))
        assert not refused, f"{op.log_path.name}: requests refused with the chart's RBAC:\n" + "\n".join(refused[:10])


def deploy(kubectl, ns, name, op) -> dict:
    doc = yaml.safe_load((SAMPLES / "deepseek-v4-fp4-h200.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": ns}
    doc["spec"]["engine"]["image"] = IMAGE
    kubectl("apply", "-f", "-", input=json.dumps(doc))

    def running():
        dep = get_json(kubectl, "deployment", name, "-n", ns)
        st = (dep or {}).get("status") or {}
        return dep if dep["spec"]["replicas"] == 1 and st.get("readyReplicas") == 1 else None
    dep = wait_for(running, 90, f"{name} running from {IMAGE}", op.log_tail)
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
    wait_for(lambda: ((get_json(kubectl, "moed", name, "-n", ns) or {}).get("status") or {}).get("workload"), 30,
             "status.workload", op.log_tail)
    return dep


def violation(kubectl, ns, name, generation=None):
    def check():
        obj = get_json(kubectl, "moed", name, "-n", ns)
        c = condition(obj, "Planned")
        if c and c["reason"] == "PolicyViolation" and (generation is None or
                                                       obj["status"].get("observedGeneration") == generation):
            return c
        return None
    return check


def events(kubectl, ns, name, reason) -> list[dict]:
    items = get_json(kubectl, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    return [e for e in items if e["reason"] == reason]


def test_keep_leaves_the_workload_running_and_refuses_changes(operators, kubectl, namespace):
    op = operators("--allow-image-registry", ALLOWED)
    before = deploy(kubectl, namespace, "kept", op)

    op = operators("--allow-image-registry", OTHER)  # tightened; onViolation: keep (the default)
    c = wait_for(violation(kubectl, namespace, "kept"), 60, "Planned=False PolicyViolation", op.log_tail)
    assert c["status"] == "False" and IMAGE in c["message"]
    time.sleep(8)  # four resync and enforcement ticks (MOE_RESYNC_SECONDS=2)
    dep = get_json(kubectl, "deployment", "kept", "-n", namespace)
    assert dep["spec"] == before["spec"] and dep["status"].get("readyReplicas") == 1
    assert not events(kubectl, namespace, "kept", "PolicyEnforced")

    # a change is refused: not rendered, the workload stays as it was
    kubectl("patch", "moed", "kept", "-n", namespace, "--type=merge", "-p", '{"spec":{"replicas":2}}')
    gen = get_json(kubectl, "moed", "kept", "-n", namespace)["metadata"]["generation"]
    wait_for(violation(kubectl, namespace, "kept", gen), 30, "PolicyViolation for the change", op.log_tail)
    time.sleep(4)
    dep = get_json(kubectl, "deployment", "kept", "-n", namespace)
    assert dep["spec"] == before["spec"], "a change the policy refuses was rendered"


def test_scale_to_zero_scales_the_workload_down_with_an_event_until_the_spec_is_allowed(operators, kubectl,
                                                                                        namespace):
    op = operators("--allow-image-registry", ALLOWED)
    deploy(kubectl, namespace, "enforced", op)

    op = operators("--allow-image-registry", OTHER, "--on-policy-violation", "scaleToZero")
    dep = wait_for(lambda: (d := get_json(kubectl, "deployment", "enforced", "-n", namespace))
                   and d["spec"]["replicas"] == 0 and d, 60, "scaled to 0", op.log_tail)
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE  # scaled, not re-rendered
    ev = wait_for(lambda: events(kubectl, namespace, "enforced", "PolicyEnforced"), 30, "PolicyEnforced Event",
                  op.log_tail)
    assert ev[0]["type"] == "Warning" and IMAGE in ev[0]["message"] and "scaled to 0 replicas" in ev[0]["message"]
    c = condition(get_json(kubectl, "moed", "enforced", "-n", namespace), "Planned")
    assert c["status"] == "False" and c["reason"] == "PolicyViolation"
    wait_for(lambda: not (get_json(kubectl, "deployment", "enforced", "-n", namespace)["status"].get("replicas") or 0),
             60, "its pods gone", op.log_tail)
    time.sleep(6)  # three more ticks: nothing scales it back, one Event only
    assert get_json(kubectl, "deployment", "enforced", "-n", namespace)["spec"]["replicas"] == 0
    assert len(events(kubectl, namespace, "enforced", "PolicyEnforced")) == 1

    # the spec allowed again (the default image): rendered and scaled back
    kubectl("patch", "moed", "enforced", "-n", namespace, "--type=json",
            "-p", json.dumps([{"op": "remove", "path": "/spec/engine/image"}]))
    dep = wait_for(lambda: (d := get_json(kubectl, "deployment", "enforced", "-n", namespace))
                   and d["spec"]["replicas"] == 1 and d, 60, "scaled back to 1", op.log_tail)
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] != IMAGE
    c = condition(get_json(kubectl, "moed", "enforced", "-n", namespace), "Planned")
    assert c["status"] == "True", c
