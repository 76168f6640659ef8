"""drift.py compares the pod spec, each container and the Service spec whole (issue 27 item 8)."""

from __future__ import annotations

from moe_operator.drift import differences, removals


def dep(pod: dict) -> dict:
    return {"kind": "Deployment", "spec": {"replicas": 1, "template": {"spec": pod}}}


RENDERED = {"automountServiceAccountToken": False, "containers": [{"name": "engine", "image": "i:1"}]}


def test_keys_the_operator_does_not_render_are_drift_defaults_are_not():
    live = {**RENDERED, "dnsPolicy": "ClusterFirst", "schedulerName": "default-scheduler", "restartPolicy": "Always",
            "serviceAccountName": "default", "securityContext": {}, "hostNetwork": False,
            "containers": [{"name": "engine", "image": "i:1", "terminationMessagePath": "/dev/termination-log",
                            "imagePullPolicy": "IfNotPresent", "resources": {}}]}
    assert differences(dep(RENDERED), dep(live)) == []
    live.update(hostNetwork=True, hostPID=True, serviceAccountName="admin")
    live["containers"][0]["lifecycle"] = {"postStart": {"exec": {"command": ["id"]}}}
    d = " ".join(differences(dep(RENDERED), dep(live)))
    for key in ("hostNetwork", "hostPID", "serviceAccountName", "containers[0].lifecycle"):
        assert key in d, d
    assert removals(dep(RENDERED), dep(live)) == {"spec": {"template": {"spec": {
        "hostNetwork": None, "hostPID": None, "serviceAccountName": None}}}}


def test_the_service_spec_is_compared_whole_other_maps_by_rendered_keys():
    svc = {"kind": "Service", "metadata": {"labels": {"a": "b"}}, "spec": {"type": "ClusterIP", "ports": []}}
    live = {"kind": "Service", "metadata": {"labels": {"a": "b", "other": "x"}},
            "spec": {"type": "ClusterIP", "ports": [], "clusterIP": "10.0.0.1", "sessionAffinity": "None"}}
    assert differences(svc, live) == []  # metadata: other controllers' labels are theirs
    live["spec"]["externalIPs"] = ["203.0.113.7"]
    assert differences(svc, live) == [".spec.externalIPs: not rendered, live has ['203.0.113.7']"]
