"""A bundled MoEDeployment over two H200 nodes (issue 19) against the real kube-apiserver: planned with the
layout recorded, rendered as a LeaderWorkerSet that the released LWS CRD accepts (no LWS controller runs
locally, so no pods), leader and worker running `moe-runtime serve` with the rendezvous env wired."""

from __future__ import annotations

import json

import pytest

from .operator_fixture import condition, get_json, wait_for

pytestmark = pytest.mark.integration


def test_two_node_bundled_replica_is_a_leaderworkerset_the_api_server_accepts(kubectl, namespace, operator):
    name = "bundled-2node"
    doc = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
           "metadata": {"name": name, "namespace": namespace},
           "spec": {"model": {"uri": "file:///models/deepseek-v3-fp8"}, "parallelism": {"tp": 16, "ep": 16},
                    "gpusPerReplica": 16, "nodesPerReplica": 2,
                    "gpu": {"allowedArchitectures": ["sm90"], "product": "NVIDIA-H200"}}}
    kubectl("apply", "-f", "-", input=json.dumps(doc))  # the CEL rule admits bundled over 2 nodes

    def planned():
        o = get_json(kubectl, "moed", name, "-n", namespace)
        c = condition(o, "Planned")
        return o if c and c["status"] == "True" else None
    obj = wait_for(planned, 60, "Planned", operator.log_tail)
    plan = obj["status"]["plan"]
    assert plan["engine"]["name"] == "bundled"
    assert plan["layout"] == {"tp": 16, "gpusPerNode": 8, "nodes": 2}
    par = [d for d in plan["decisions"] if d["key"] == "parallel"]
    assert par and par[0]["value"] == "tp=16 ep=16 nodes=2" and "LeaderWorkerSet" in par[0]["reason"]

    lws = wait_for(lambda: get_json(kubectl, "leaderworkersets.leaderworkerset.x-k8s.io", name, "-n", namespace),
                   60, "LeaderWorkerSet", operator.log_tail)
    assert lws["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    tpl = lws["spec"]["leaderWorkerTemplate"]
    assert tpl["size"] == 2 and lws["spec"]["startupPolicy"] == "LeaderCreated"
    for role in ("leaderTemplate", "workerTemplate"):
        c = tpl[role]["spec"]["containers"][0]
        assert c["command"] == ["moe-runtime", "serve"]
        a = c["args"]
        assert a[a.index("--tp") + 1] == "8" and a[a.index("--ep") + 1] == "16" and "--dist-port" in a
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        env = {e["name"]: e for e in c["env"]}
        assert env["LWS_WORKER_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['leaderworkerset.sigs.k8s.io/worker-index']")
        assert env["LWS_GROUP_SIZE"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['leaderworkerset.sigs.k8s.io/size']")
    leader = tpl["leaderTemplate"]["spec"]["containers"][0]
    worker = tpl["workerTemplate"]["spec"]["containers"][0]
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready" and "readinessProbe" not in worker
    cm = get_json(kubectl, "configmap", f"{name}-plan", "-n", namespace)
    assert json.loads(cm["data"]["plan.json"])["layout"]["nodes"] == 2  # what serve checks against LWS_GROUP_SIZE
