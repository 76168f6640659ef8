"""The dev cluster keeps thousands of kwok nodes Ready at no cost (issue 34 item 2): no node
heartbeat stage, no node Leases, grace periods that never time a node out, more stage workers."""

from __future__ import annotations

from pathlib import Path

import yaml

from moe_operator.devcluster import components as C
from moe_operator.devcluster.binaries import Binaries

# the shape of kwok-stages.yaml as deploy/local/build.sh writes it (kwokctl's defaults)
STAGES = "".join(f"---\n# from sigs.k8s.io/kwok@v0.8.0/{path}\napiVersion: kwok.x-k8s.io/v1alpha1\nkind: Stage\n"
                 f"metadata:\n  name: {name}\nspec:\n  resourceRef:\n    apiGroup: v1\n    kind: {kind}\n"
                 for path, name, kind in (
                     ("kustomize/stage/node/fast/node-initialize.yaml", "node-initialize", "Node"),
                     ("kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
                      "node-heartbeat-with-lease", "Node"),
                     ("kustomize/stage/pod/fast/pod-ready.yaml", "pod-ready", "Pod"),
                     ("kustomize/stage/pod/fast/pod-complete.yaml", "pod-complete", "Pod"),
                     ("kustomize/stage/pod/fast/pod-delete.yaml", "pod-delete", "Pod")))


def test_kwok_config_drops_the_node_heartbeat_and_raises_the_stage_workers():
    docs = [d for d in yaml.safe_load_all(C.kwok_config(STAGES)) if d]
    stages = [d["metadata"]["name"] for d in docs if d["kind"] == "Stage"]
    assert stages == ["node-initialize", "pod-ready", "pod-complete", "pod-delete"]
    (conf,) = [d for d in docs if d["kind"] == "KwokConfiguration"]
    assert conf["apiVersion"] == "config.kwok.x-k8s.io/v1alpha1"
    assert conf["options"]["nodePlayStageParallelism"] == conf["options"]["podPlayStageParallelism"] == C.KWOK_PARALLELISM
    # kwok does not default a KwokConfiguration read from --config: every option is written out
    assert conf["options"]["podsOnNodeSyncParallelism"] == 1 and conf["options"]["enableDebuggingHandlers"] is True
    assert set(conf["options"]) == set(C.KWOK_DEFAULT_OPTIONS)


def _argv(fn):
    lay = C.Layout(Path("/s"))
    return fn(Binaries(Path("/b")), lay, C.Ports(1, 2, 3, 4, 5, 6))


def test_no_leases_and_no_node_timeouts_and_the_scheduler_binds_fast():
    kwok = _argv(C.kwok)
    assert "--node-lease-duration-seconds=0" in kwok and "--config=/s/kwok.yaml" in kwok
    kcm = _argv(C.kube_controller_manager)
    assert "--node-monitor-grace-period=8760h" in kcm and "--node-startup-grace-period=8760h" in kcm
    # the node lifecycle controller stays (taints of a NotReady node); the TTL controller goes
    assert "--controllers=*,-ttl-controller" in kcm
    sched = _argv(C.kube_scheduler)
    assert "--kube-api-qps=200" in sched and "--kube-api-burst=400" in sched
