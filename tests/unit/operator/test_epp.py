"""The endpoint picker the operator deploys (issue 32 item 8): epp.py's objects, when day2 renders
them, how they stay apart from the workload (selectors, pruning by kind under the MoEDeployment's
name), and that the operator holds every right the picker's Role grants (else the API server's RBAC
escalation prevention refuses the Role). The release facts are the Gateway API Inference
Extension's v1.0.1 chart (config/charts/inferencepool/templates/)."""

import pytest
from pydantic import ValidationError

from moe_operator import day2, epp, permissions
from moe_operator.api import MoEDeploymentSpec


def spec(engine="bundled", **pool):
    return MoEDeploymentSpec.model_validate({"model": {"uri": "hf://org/m"}, "engine": {"name": engine},
                                             "gateway": {"inferencePool": pool}})


def by_kind(objs):
    return {o["kind"]: o for o in objs}


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def test_default_pool_deploys_the_picker():
    objs = day2.endpoint_picker("m", "ns", spec(enabled=True))
    assert [o["kind"] for o in objs] == ["Service", "ServiceAccount", "Role", "RoleBinding", "Deployment"]
    assert {o["metadata"]["name"] for o in objs} == {"m-epp"} and {o["metadata"]["namespace"] for o in objs} == {"ns"}
    k = by_kind(objs)
    pod = k["Deployment"]["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert c["image"] == "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
    assert pod["spec"]["serviceAccountName"] == "m-epp"
    assert k["RoleBinding"]["roleRef"]["name"] == "m-epp" and k["RoleBinding"]["subjects"][0]["name"] == "m-epp"
    a = c["args"]
    assert a[a.index("--pool-name") + 1] == "m" and a[a.index("--pool-namespace") + 1] == "ns"
    assert a[a.index("--grpc-port") + 1] == "9002" and "--ha-enable-leader-election" not in a
    assert "kind: EndpointPickerConfig" in a[a.index("--config-text") + 1]
    assert k["Deployment"]["spec"]["strategy"] == {"type": "Recreate"} and k["Deployment"]["spec"]["replicas"] == 1
    assert c["readinessProbe"]["grpc"] == {"port": 9003, "service": "inference-extension"}
    # the Service the pool names, on the port endpoint_picker_condition looks for
    pool = day2.inference_pool("m", "ns", {}, {"a": "b"}, 8000, spec(enabled=True))
    ref = pool["spec"]["endpointPickerRef"]
    svc = k["Service"]
    assert (ref["name"], ref["port"]["number"]) == (svc["metadata"]["name"], svc["spec"]["ports"][0]["port"])
    assert matches(svc["spec"]["selector"], pod["metadata"]["labels"])
    assert day2.endpoint_picker_condition("m", spec(enabled=True), svc, None)[:2] == ("True", "EndpointPickerFound")
    assert k["Role"]["rules"] == epp.RULES


@pytest.mark.parametrize("engine,queue,kv,lora_off", [
    ("bundled", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", True),
    ("vllm", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", False),
    ("sglang", "sglang:num_queue_reqs", "sglang:token_usage", True)])
def test_engine_metric_names(engine, queue, kv, lora_off):
    a = by_kind(day2.endpoint_picker("m", "ns", spec(engine, enabled=True)))["Deployment"]
    a = a["spec"]["template"]["spec"]["containers"][0]["args"]
    assert a[a.index("--total-queued-requests-metric") + 1] == queue
    assert a[a.index("--kv-cache-usage-percentage-metric") + 1] == kv
    assert (("--lora-info-metric" in a) and a[a.index("--lora-info-metric") + 1] == "") == lora_off


def test_replicas_elect_a_leader():
    k = by_kind(day2.endpoint_picker("m", "ns", spec(enabled=True, endpointPicker={"replicas": 2})))
    c = k["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert k["Deployment"]["spec"]["replicas"] == 2 and "--ha-enable-leader-election" in c["args"]
    assert c["readinessProbe"]["grpc"]["service"] == "readiness" and c["livenessProbe"]["grpc"]["service"] == "liveness"
    assert k["Role"]["rules"] == epp.RULES + epp.LEADER_RULES


def test_port_image_and_name():
    s = spec(enabled=True, endpointPicker={"port": 9003, "image": "reg.example/epp:v1.0.1", "deploy": True,
                                           "name": "picker"})
    k = by_kind(day2.endpoint_picker("m", "ns", s))
    c = k["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert {o["metadata"]["name"] for o in k.values()} == {"picker"} and c["image"] == "reg.example/epp:v1.0.1"
    assert c["args"][c["args"].index("--grpc-health-port") + 1] == "9004"  # 9003 is the gRPC port now
    assert [p["containerPort"] for p in c["ports"]] == [9003, 9004, 9090]
    assert k["Service"]["spec"]["ports"][0]["port"] == 9003
    with pytest.raises(ValidationError, match="image"):
        spec(enabled=True, endpointPicker={"image": "Not An Image"})
    with pytest.raises(ValidationError, match="replicas"):
        spec(enabled=True, endpointPicker={"replicas": 0})


@pytest.mark.parametrize("pool", [
    {},  # no pool
    {"enabled": False, "endpointPicker": {"deploy": True}},
    {"enabled": True, "endpointPicker": {"deploy": False}},
    {"enabled": True, "endpointPicker": {"name": "mine"}},  # a picker of the user's own: not deployed
    {"enabled": True, "poolName": "fleet"},  # a member of another MoEDeployment's pool: the pool's owner deploys
])
def test_not_deployed(pool):
    assert day2.endpoint_picker("m", "ns", spec(**pool)) == []


def test_shared_pool_owner_deploys():
    assert by_kind(day2.endpoint_picker("fleet", "ns", spec(enabled=True, poolName="fleet")))["Deployment"]


def test_picker_pods_stay_out_of_the_workload_selectors():
    objs = day2.endpoint_picker("m", "ns", spec(enabled=True))
    labels = by_kind(objs)["Deployment"]["spec"]["template"]["metadata"]["labels"]
    workload_selector = {"app.kubernetes.io/instance": "m", "moe.serving.dev/deployment": "m"}  # render.py's
    for sel in (workload_selector, day2.serving_selector("m", False), day2.serving_selector("m", True),
                {day2.POOL_LABEL: "m"}):
        assert not matches(sel, labels), sel
    assert labels["app.kubernetes.io/managed-by"] == "moe-operator"  # the watch cache's selector
    # and the picker's own selector picks none of the workload's pods
    assert not matches(by_kind(objs)["Service"]["spec"]["selector"], {**workload_selector, "moe.serving.dev/role": "single"})


def test_pruning_by_kind_never_reaches_the_workload():
    objs = [{"kind": "Deployment", "metadata": {"name": "m", "labels": {}}},
            {"kind": "InferencePool", "metadata": {"name": "m", "labels": {}}}] + \
        day2.endpoint_picker("m", "ns", spec(enabled=True))
    optional = day2.optional_kinds(objs)
    assert optional == ["InferencePool", "EndpointPicker/m-epp"]  # no Deployment, no Service
    assert all(not day2.is_optional(o) for o in objs[:1]) and all(day2.is_optional(o) for o in objs[1:])
    # deploy turned off: the picker goes by its own names, the workload stays
    gone = day2.stale_objects("m", optional, ["InferencePool"])
    assert gone == [(k, "m-epp") for k in epp.KINDS] and ("Deployment", "m") not in gone
    # the pool turned off: the pool under the MoEDeployment's name, the picker under its own
    assert day2.stale_objects("m", optional, []) == [("InferencePool", "m")] + gone
    # the Service renamed: the old picker goes
    assert day2.stale_objects("m", optional, ["InferencePool", "EndpointPicker/picker"]) == gone
    assert day2.stale_objects("m", optional, optional) == []


def test_operator_holds_what_the_role_grants():
    for rule in epp.RULES + epp.LEADER_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                held = permissions.NAMESPACED.get((group, resource), (frozenset(), ""))[0]
                assert set(rule["verbs"]) <= held, (group, resource)
    for group, resource in (("", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
                            ("rbac.authorization.k8s.io", "rolebindings"), ("apps", "deployments"), ("", "services")):
        assert {"get", "create", "patch", "delete"} <= permissions.NAMESPACED[(group, resource)][0]


def test_a_picker_name_taken_by_someone_else_is_left_alone():
    obj = by_kind(day2.endpoint_picker("m", "ns", spec(enabled=True)))["Service"]
    ours = {"metadata": {"ownerReferences": [{"kind": "MoEDeployment", "name": "m", "uid": "u1", "controller": True}]}}
    assert day2.picker_not_owned(obj, None, "u1") is None and day2.picker_not_owned(obj, ours, "u1") is None
    hand_made = {"metadata": {"name": "m-epp"}}  # deployed by hand behind <name>-epp
    why = day2.picker_not_owned(obj, hand_made, "u1")
    assert "Service m-epp exists and is not owned by it" in why and "endpointPicker.deploy" in why
    other = {"metadata": {"ownerReferences": [{"kind": "MoEDeployment", "name": "m-epp", "uid": "u2", "controller": True}]}}
    assert "controlled by MoEDeployment m-epp" in day2.picker_not_owned(obj, other, "u1")
    # the workload is never checked this way
    assert day2.picker_not_owned({"kind": "Deployment", "metadata": {"name": "m", "labels": {}}}, hand_made, "u1") is None
    # pruning: only what it controls, or what is named like the MoEDeployment (day2's own kinds)
    assert day2.prunable("m-epp", "m", ours, "u1") and not day2.prunable("m-epp", "m", hand_made, "u1")
    assert not day2.prunable("m-epp", "m", other, "u1") and not day2.prunable("m-epp", "m", None, "u1")
    assert day2.prunable("m", "m", None, "u1")
