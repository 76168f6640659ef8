"""The InferencePool's endpoint picker deployed by the running operator (issue 32 item 8), against
the real API server with the chart's RBAC: ServiceAccount, Role, RoleBinding, Deployment and
Service <name>-epp are created and owned by the MoEDeployment (the API server's RBAC escalation
prevention accepts the Role only because the chart grants the operator what it grants), the
workload Deployment stays apart, InferencePoolReady turns True once the picker's Service exists,
and `deploy: false` prunes the picker by its own names while the workload stays.

No picker runs: kwok fakes the pods, nothing pulls the image."""

from __future__ import annotations

import json

import pytest
import yaml


from .operator_fixture import SAMPLES, condition, get_json, wait_for

pytestmark = pytest.mark.integration

PICKER_KINDS = ("Deployment", "ServiceAccount", "Role", "RoleBinding", "Service")


def test_picker_deployed_owned_and_pruned(kubectl, namespace, operator):
    from moe_operator import optional_crds

    if kubectl("get", "crd", optional_crds.INFERENCE_POOL.name, check=False).returncode != 0:
        optional_crds.install(kubectl, optional_crds.INFERENCE_POOL)
    doc = yaml.safe_load((SAMPLES / "gpt-oss-mxfp4-h100.yaml").read_text())
    doc["metadata"] = {"name": "picked", "namespace": namespace}
    doc["spec"]["gateway"] = {"inferencePool": {"enabled": True}}
    kubectl("apply", "-f", "-", input=json.dumps(doc))
    uid = get_json(kubectl, "moed", "picked", "-n", namespace)["metadata"]["uid"]

    def picker():
        got = {}
        for kind in PICKER_KINDS:
            r = kubectl("get", kind.lower(), "picked-epp", "-n", namespace, "-o", "json", check=False)
            if r.returncode != 0:
                return None
            got[kind] = json.loads(r.stdout)
        return got

    objs = wait_for(picker, 90, "the picker's five objects", operator.log_tail)
    for kind, o in objs.items():
        refs = o["metadata"].get("ownerReferences") or []
        assert [(r["kind"], r["name"], r["uid"], r.get("controller")) for r in refs] == \
            [("MoEDeployment", "picked", uid, True)], kind
    role = objs["Role"]["rules"]
    assert {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
            "verbs": ["get", "watch", "list"]} in role
    assert objs["RoleBinding"]["roleRef"]["name"] == "picked-epp"
    dep = objs["Deployment"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "picked-epp"
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == "picked" and args[args.index("--pool-namespace") + 1] == namespace
    assert 9002 in [p["port"] for p in objs["Service"]["spec"]["ports"]]
    # the workload is its own Deployment; neither selector picks the other's pods
    workload = wait_for(lambda: get_json(kubectl, "deployment", "picked", "-n", namespace), 60, "the workload")
    wsel = workload["spec"]["selector"]["matchLabels"]
    plabels = dep["spec"]["template"]["metadata"]["labels"]
    assert any(plabels.get(k) != v for k, v in wsel.items())
    assert any(workload["spec"]["template"]["metadata"]["labels"].get(k) != v
               for k, v in dep["spec"]["selector"]["matchLabels"].items())

    def pool_ready():
        o = get_json(kubectl, "moed", "picked", "-n", namespace)
        c = condition(o, "InferencePoolReady")
        return o if c and c["status"] == "True" and c["reason"] == "EndpointPickerFound" else None
    wait_for(pool_ready, 60, "InferencePoolReady=True EndpointPickerFound", operator.log_tail)
    o = get_json(kubectl, "moed", "picked", "-n", namespace)
    assert "EndpointPicker/picked-epp" in o["status"]["optionalObjects"]

    # deploy: false -> the picker goes by its own names, the workload and the pool stay
    kubectl("patch", "moed", "picked", "-n", namespace, "--type", "merge", "-p",
            json.dumps({"spec": {"gateway": {"inferencePool": {"endpointPicker": {"deploy": False}}}}}))

    def gone():
        return all(kubectl("get", k.lower(), "picked-epp", "-n", namespace, check=False).returncode != 0
                   for k in PICKER_KINDS)
    wait_for(gone, 60, "the picker's objects deleted", operator.log_tail)
    assert get_json(kubectl, "deployment", "picked", "-n", namespace)["metadata"]["uid"] == workload["metadata"]["uid"]
    assert get_json(kubectl, "service", "picked", "-n", namespace)
    assert get_json(kubectl, "inferencepool", "picked", "-n", namespace)
    # no picker now, FailClose: reported as missing
    wait_for(lambda: (condition(get_json(kubectl, "moed", "picked", "-n", namespace), "InferencePoolReady") or {})
             .get("reason") == "EndpointPickerMissing", 60, "EndpointPickerMissing", operator.log_tail)


def test_a_picker_deployed_by_hand_is_left_alone(kubectl, namespace, operator):
    from moe_operator import optional_crds

    if kubectl("get", "crd", optional_crds.INFERENCE_POOL.name, check=False).returncode != 0:
        optional_crds.install(kubectl, optional_crds.INFERENCE_POOL)
    # what the missing-picker condition used to advise: a picker of one's own behind <name>-epp:9002
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "handmade-epp", "namespace": namespace},
           "spec": {"selector": {"app": "my-epp"}, "ports": [{"name": "grpc", "port": 9002}]}}
    kubectl("apply", "-f", "-", input=json.dumps(svc))
    doc = yaml.safe_load((SAMPLES / "gpt-oss-mxfp4-h100.yaml").read_text())
    doc["metadata"] = {"name": "handmade", "namespace": namespace}
    doc["spec"]["gateway"] = {"inferencePool": {"enabled": True}}  # deploy defaults to true
    kubectl("apply", "-f", "-", input=json.dumps(doc))

    def cond(type_, status, reason):
        def check():
            o = get_json(kubectl, "moed", "handmade", "-n", namespace)
            c = condition(o, type_)
            return c if c and c["status"] == status and c["reason"] == reason else None
        return check

    c = wait_for(cond("Degraded", "True", "EndpointPickerNotOwned"), 90, "Degraded EndpointPickerNotOwned",
                 operator.log_tail)
    assert "Service handmade-epp exists" in c["message"] and "endpointPicker.deploy" in c["message"]
    wait_for(cond("InferencePoolReady", "True", "EndpointPickerFound"), 60, "the hand-made picker found",
             operator.log_tail)
    live = get_json(kubectl, "service", "handmade-epp", "-n", namespace)
    assert live["spec"]["selector"] == {"app": "my-epp"} and not live["metadata"].get("ownerReferences")
    for kind in PICKER_KINDS[:-1]:  # none of the picker is made beside it
        assert get_json(kubectl, kind.lower(), "handmade-epp", "-n", namespace) is None, kind
    # using it as the user's own: Degraded clears, the Service stays
    kubectl("patch", "moed", "handmade", "-n", namespace, "--type", "merge", "-p",
            json.dumps({"spec": {"gateway": {"inferencePool": {"endpointPicker": {"deploy": False}}}}}))
    wait_for(cond("Degraded", "False", "Applied"), 60, "Degraded=False", operator.log_tail)
    assert get_json(kubectl, "service", "handmade-epp", "-n", namespace)["spec"]["selector"] == {"app": "my-epp"}
