"""InferencePool without its endpoint picker (issue 32 item 8) or without a ready endpoint:
day2.endpoint_picker_condition on each case, and what the rollup (conditions.py) makes of it. The
live-object shapes are the Gateway API Inference Extension's v1 InferencePool status
(api/v1/inferencepool_types.go, v1.0.1) and core/v1 Pods."""

import pytest

from moe_operator.api import MoEDeploymentSpec
from moe_operator.conditions import EPP_BLOCKING, rollup
from moe_operator.day2 import (POOL_LABEL, endpoint_picker_condition, inference_pool, objects, pool_selector,
                               ready_endpoints)
from moe_operator.reconcile import set_condition


def spec(**pool):
    return MoEDeploymentSpec.model_validate({"model": {"uri": "hf://org/m"}, "gateway": {"inferencePool": pool}})


def service(*ports):
    return {"kind": "Service", "metadata": {"name": "m-epp"}, "spec": {"ports": [{"port": p} for p in ports]}}


def pool_status(status, reason="ResolvedRefs", message=""):
    return {"status": {"parents": [{"parentRef": {"name": "gw"}, "conditions": [
        {"type": "Accepted", "status": "True", "reason": "SupportedByParent"},
        {"type": "ResolvedRefs", "status": status, "reason": reason, "message": message}]}]}}


def test_no_pool_no_condition():
    assert endpoint_picker_condition("m", spec(), None, None) is None
    # a member of another MoEDeployment's shared pool renders none; the pool's owner reports
    assert endpoint_picker_condition("m", spec(enabled=True, poolName="fleet"), None, None) is None
    assert endpoint_picker_condition("fleet", spec(enabled=True, poolName="fleet"), None, None)[0] == "False"


def test_missing_service_fail_close_blocks():
    status, reason, msg = endpoint_picker_condition("m", spec(enabled=True), None, None)
    assert (status, reason) == ("False", "EndpointPickerMissing") and reason in EPP_BLOCKING
    assert "'m-epp'" in msg and "FailClose" in msg and "fails every request" in msg
    # the same Service name and port the rendered pool names
    rendered = inference_pool("m", "ns", {}, {"a": "b"}, 8000, spec(enabled=True))
    ref = rendered["spec"]["endpointPickerRef"]
    assert ref["name"] in msg and str(ref["port"]["number"]) in msg


def test_missing_service_fail_open_only_says_so():
    s = spec(enabled=True, endpointPicker={"name": "picker", "port": 9100, "failureMode": "FailOpen"})
    status, reason, msg = endpoint_picker_condition("m", s, None, None)
    assert (status, reason) == ("False", "EndpointPickerMissingFailOpen") and reason not in EPP_BLOCKING
    assert "'picker'" in msg and "9100" in msg and "without it" in msg


@pytest.mark.parametrize("svc,pool,want", [
    (service(9002), None, ("True", "EndpointPickerFound")),
    (service(9002, 9003), pool_status("True"), ("True", "EndpointPickerFound")),
    (service(9003), None, ("False", "EndpointPickerPortMissing")),
    ({"spec": {}}, None, ("False", "EndpointPickerPortMissing")),
    (service(9002), pool_status("False", "InvalidExtensionRef", "no endpoints"), ("False", "EndpointPickerUnresolved")),
])
def test_service_port_and_gateway_view(svc, pool, want):
    got = endpoint_picker_condition("m", spec(enabled=True), svc, pool, ready=1)
    assert got[:2] == want, got
    if want[1] == "EndpointPickerUnresolved":
        assert "gw cannot use the endpoint picker: InvalidExtensionRef: no endpoints" in got[2]


def _ready_with(cond):
    conds = []
    for t, st, r in [("CheckpointInspected", "True", "Inspected"), ("Planned", "True", "Planned"),
                     ("Degraded", "False", "Applied"), ("Available", "True", "ReplicasReady"),
                     ("Progressing", "False", "Complete")]:
        conds = set_condition(conds, t, st, r, "", 1)
    if cond:
        conds = set_condition(conds, "InferencePoolReady", *cond, 1)
    return {c["type"]: c for c in rollup(conds, 1, now="2026-12-02T00:00:00Z")}


def test_rollup_of_each_outcome():
    missing = _ready_with(endpoint_picker_condition("m", spec(enabled=True), None, None))
    assert missing["Ready"]["status"] == "False" and missing["Stalled"]["reason"] == "EndpointPickerMissing"
    fail_open = spec(enabled=True, endpointPicker={"name": "p", "failureMode": "FailOpen"})
    assert _ready_with(endpoint_picker_condition("m", fail_open, None, None))["Ready"]["status"] == "True"
    found = _ready_with(endpoint_picker_condition("m", spec(enabled=True), service(9002), None, ready=2))
    assert found["Ready"]["status"] == "True" and found["Stalled"]["status"] == "False"
    # no ready endpoint yet: work in progress (pods starting, scaled to zero), neither Stalled nor blocking
    empty = _ready_with(endpoint_picker_condition("m", spec(enabled=True), service(9002), None, ready=0))
    assert empty["InferencePoolReady"]["reason"] == "NoReadyEndpoints" and empty["Stalled"]["status"] == "False"


# ------------------------------------------------------------------------------ ready endpoints
def pod(ready=True, ip="10.0.0.1", deleting=False, **labels):
    meta = {"name": "p", "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_ready_endpoints_counts_what_the_picker_routes_to():
    assert ready_endpoints([]) == 0
    assert ready_endpoints([pod(), pod(), pod(ready=False)]) == 2
    assert ready_endpoints([pod(ip=""), pod(deleting=True), {"metadata": {}, "status": {}}]) == 0


@pytest.mark.parametrize("ready,want", [(None, ("True", "EndpointPickerFound")), (0, ("False", "NoReadyEndpoints")),
                                        (1, ("True", "EndpointPickerFound")), (3, ("True", "EndpointPickerFound"))])
def test_true_only_with_a_ready_endpoint(ready, want):
    got = endpoint_picker_condition("m", spec(enabled=True), service(9002), None, ready=ready)
    assert got[:2] == want, got
    if ready is None:
        assert "not counted" in got[2]
    elif ready == 0:
        assert "no ready endpoint" in got[2] and "moe.serving.dev/deployment=m" in got[2]
        assert "m-epp:9002" in got[2]  # the picker is fine: it is the pods that are missing
    else:
        assert got[2].startswith(f"{ready} ready endpoint{'s' if ready > 1 else ''} (pods ")


def test_a_missing_picker_is_reported_before_the_endpoints():
    assert endpoint_picker_condition("m", spec(enabled=True), None, None, ready=0)[1] == "EndpointPickerMissing"
    assert endpoint_picker_condition("m", spec(enabled=True), service(9003), None, ready=5)[1] == "EndpointPickerPortMissing"


def test_the_pods_counted_are_the_ones_the_rendered_pool_selects():
    """pool_selector is the rendered pool's spec.selector: this object's serving pods (LWS leaders
    for multi-node), or every member of a shared pool."""
    for s, name in [(spec(enabled=True), "m"), (spec(enabled=True, poolName="fleet"), "fleet")]:
        for multi in (False, True):
            s2 = s.model_copy(update={"nodesPerReplica": 2 if multi else 1})
            objs = objects(name, "ns", {}, {"x": "y"}, 8000, s2)
            (rendered,) = [o for o in objs if o["kind"] == "InferencePool"]
            assert rendered["spec"]["selector"]["matchLabels"] == pool_selector(name, s2)
    assert pool_selector("fleet", spec(enabled=True, poolName="fleet")) == {POOL_LABEL: "fleet"}
    assert pool_selector("m", spec(enabled=True))["moe.serving.dev/role"] == "single"
    msg = endpoint_picker_condition("fleet", spec(enabled=True, poolName="fleet"), service(9002), None, ready=0)[2]
    assert f"{POOL_LABEL}=fleet" in msg
