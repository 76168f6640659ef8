"""InferencePool without its endpoint picker (issue 32 item 8) through the running operator: the
pool is rendered, the picker's Service is missing, so InferencePoolReady=False
EndpointPickerMissing with a Warning Event, Ready=False and Stalled (FailClose: every request
through the gateway would fail); once a Service <name>-epp with port 9002 exists,
InferencePoolReady=True (saying how many ready endpoints the pool has) and Ready=True; scaled to
zero, the pool has no ready endpoint: InferencePoolReady=False NoReadyEndpoints (not Stalled, no
Warning Event), and True again once a pod is back."""

from __future__ import annotations

import json

import pytest
import yaml


from .operator_fixture import SAMPLES, condition, get_json, wait_for

pytestmark = pytest.mark.integration


def test_missing_picker_is_reported_then_found(kubectl, namespace, operator):
    from moe_operator import optional_crds

    if kubectl("get", "crd", optional_crds.INFERENCE_POOL.name, check=False).returncode != 0:
        optional_crds.install(kubectl, optional_crds.INFERENCE_POOL)
    doc = yaml.safe_load((SAMPLES / "gpt-oss-mxfp4-h100.yaml").read_text())
    doc["metadata"] = {"name": "pooled", "namespace": namespace}
    doc["spec"]["gateway"] = {"inferencePool": {"enabled": True, "endpointPicker": {"deploy": False}}}
    kubectl("apply", "-f", "-", input=json.dumps(doc))

    def cond(type_, status, reason=None):
        def check():
            o = get_json(kubectl, "moed", "pooled", "-n", namespace)
            c = condition(o, type_)
            return o if c and c["status"] == status and (reason is None or c["reason"] == reason) else None
        return check

    o = wait_for(cond("InferencePoolReady", "False", "EndpointPickerMissing"), 90, "EndpointPickerMissing",
                 operator.log_tail)
    assert "'pooled-epp'" in condition(o, "InferencePoolReady")["message"]
    o = wait_for(cond("Stalled", "True", "EndpointPickerMissing"), 30, "Stalled", operator.log_tail)
    assert condition(o, "Ready")["status"] == "False"
    def warned():
        events = get_json(kubectl, "events", "-n", namespace, "--field-selector",
                          "involvedObject.kind=MoEDeployment,involvedObject.name=pooled")["items"]
        return [e for e in events if e["reason"] == "EndpointPickerMissing" and e["type"] == "Warning"]
    assert len(wait_for(warned, 30, "a Warning Event EndpointPickerMissing", operator.log_tail)) == 1

    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "pooled-epp", "namespace": namespace},
           "spec": {"selector": {"app": "pooled-epp"}, "ports": [{"name": "grpc", "port": 9002}]}}
    kubectl("apply", "-f", "-", input=json.dumps(svc))
    o = wait_for(cond("InferencePoolReady", "True", "EndpointPickerFound"), 60, "EndpointPickerFound", operator.log_tail)
    wait_for(cond("Ready", "True"), 90, "Ready=True", operator.log_tail)
    replicas = doc["spec"]["replicas"]
    wait_for(lambda: condition(get_json(kubectl, "moed", "pooled", "-n", namespace), "InferencePoolReady")["message"]
             .startswith(f"{replicas} ready endpoints (pods "), 60, f"{replicas} ready endpoints", operator.log_tail)

    # no pod, no endpoint: the pool reports it, as a state of the rollout (neither Stalled nor an Event)
    kubectl("patch", "moed", "pooled", "-n", namespace, "--type", "merge", "-p", json.dumps({"spec": {"replicas": 0}}))
    o = wait_for(cond("InferencePoolReady", "False", "NoReadyEndpoints"), 90, "NoReadyEndpoints", operator.log_tail)
    assert "no ready endpoint" in condition(o, "InferencePoolReady")["message"]
    assert condition(o, "Stalled")["status"] == "False"
    assert not [e for e in get_json(kubectl, "events", "-n", namespace, "--field-selector",
                                    "involvedObject.kind=MoEDeployment,involvedObject.name=pooled")["items"]
                if e["reason"] == "NoReadyEndpoints"]
    kubectl("patch", "moed", "pooled", "-n", namespace, "--type", "merge", "-p", json.dumps({"spec": {"replicas": 1}}))
    o = wait_for(cond("InferencePoolReady", "True", "EndpointPickerFound"), 90, "a ready endpoint again",
                 operator.log_tail)
    assert condition(o, "InferencePoolReady")["message"].startswith("1 ready endpoint (pods ")
