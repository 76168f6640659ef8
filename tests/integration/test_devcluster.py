"""The local control plane is a real Kubernetes: real scheduler, real CRD validation (schema and
CEL), real garbage collector, simulated GPU nodes that kwok keeps Ready and whose pods it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_operator.devcluster import DevCluster, pools as P

from .operator_fixture import ROOT, kubectl_json, wait_for

pytestmark = pytest.mark.integration


def test_nodes_list_the_gpu_pools(kubectl):
    out = kubectl("get", "nodes", "-L", "nvidia.com/gpu.product", "-L", P.POOL_LABEL).stdout
    for pool, cls in P.GPU_CLASSES.items():
        lines = [ln for ln in out.splitlines() if ln.startswith(f"kwok-{pool}-")]
        assert len(lines) >= 2, f"pool {pool} missing from\n{out}"
        for ln in lines:
            assert " Ready " in ln, ln
            if cls.vendor == "nvidia":
                assert cls.product in ln.split(), ln
    nodes = kubectl_json(kubectl, "get", "nodes", "-l", f"{P.POOL_LABEL}=mi300x")["items"]
    assert nodes and all(n["status"]["allocatable"]["amd.com/gpu"] == "8" for n in nodes)


def _deployment(name, match_expressions, replicas):
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": match_expressions}]}}},
                    "containers": [{"name": "server", "image": "registry.invalid/moe-runtime:dev",
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                },
            },
        },
    }


def _running_pods_on(kubectl, namespace, app, replicas):
    def ready():
        pods = kubectl_json(kubectl, "-n", namespace, "get", "pods", "-l", f"app={app}")["items"]
        running = [p for p in pods if p["status"].get("phase") == "Running" and p["spec"].get("nodeName")]
        return running if len(running) == replicas else None

    pods = wait_for(ready, 90, f"{replicas} Running pods of {app}")
    return {p["spec"]["nodeName"] for p in pods}


def test_scheduler_places_pods_by_compute_capability(kubectl, namespace):
    nodes = kubectl_json(kubectl, "get", "nodes", "-l", P.POOL_LABEL)["items"]
    pool_of = {n["metadata"]["name"]: n["metadata"]["labels"][P.POOL_LABEL] for n in nodes}
    arch_of = {n["metadata"]["name"]: n["metadata"]["labels"]["kubernetes.io/arch"] for n in nodes}

    # compute capability 10.x: B200 (amd64) and GB200 (arm64) both qualify
    sm100 = _deployment("sm100", [{"key": "nvidia.com/gpu.compute.major", "operator": "In", "values": ["10"]}], 6)
    # ... and pinned to amd64 images: B200 only
    sm100_x86 = _deployment("sm100-amd64", [
        {"key": "nvidia.com/gpu.compute.major", "operator": "In", "values": ["10"]},
        {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}], 3)
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                    "items": [sm100, sm100_x86]}))

    placed = _running_pods_on(kubectl, namespace, "sm100", 6)
    assert {pool_of[n] for n in placed} <= {"b200", "gb200"}, placed
    placed_x86 = _running_pods_on(kubectl, namespace, "sm100-amd64", 3)
    assert {pool_of[n] for n in placed_x86} == {"b200"}, placed_x86
    assert {arch_of[n] for n in placed_x86} == {"amd64"}

    # kwok reports the containers running and the pods Ready
    pods = kubectl_json(kubectl, "-n", namespace, "get", "pods")["items"]
    for p in pods:
        assert p["status"]["phase"] == "Running"
        # simulated pods get loopback IPs (see devcluster.components.POD_CIDR)
        assert p["status"]["podIP"].startswith("127.") or os.environ.get("MOE_DEV_POD_CIDR")
        assert all(cs["ready"] and "running" in cs["state"] for cs in p["status"]["containerStatuses"])
    dep = kubectl_json(kubectl, "-n", namespace, "get", "deployment", "sm100")
    assert wait_for(lambda: kubectl_json(kubectl, "-n", namespace, "get", "deployment", "sm100")["status"]
                 .get("readyReplicas") == 6, 30, "deployment readyReplicas"), dep


def test_unschedulable_without_matching_pool(kubectl, namespace):
    """No pool has compute capability 8.x: the real scheduler must leave the pod Pending."""
    dep = _deployment("sm80", [{"key": "nvidia.com/gpu.compute.major", "operator": "In", "values": ["8"]}], 1)
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(dep))

    def unschedulable():
        pods = kubectl_json(kubectl, "-n", namespace, "get", "pods", "-l", "app=sm80")["items"]
        return pods and any(c.get("reason") == "Unschedulable" for c in pods[0]["status"].get("conditions", []))

    wait_for(unschedulable, 60, "PodScheduled=False/Unschedulable")


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.it.moe.serving.dev"},
    "spec": {
        "group": "it.moe.serving.dev", "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {"spec": {
                    "type": "object",
                    "required": ["minReplicas", "maxReplicas"],
                    "properties": {"minReplicas": {"type": "integer", "minimum": 0},
                                   "maxReplicas": {"type": "integer", "minimum": 1}},
                    "x-kubernetes-validations": [{"rule": "self.minReplicas <= self.maxReplicas",
                                                  "message": "minReplicas must not exceed maxReplicas"}],
                }},
            }},
        }],
    },
}


def _widget(name, lo, hi):
    return json.dumps({"apiVersion": "it.moe.serving.dev/v1", "kind": "Widget",
                       "metadata": {"name": name}, "spec": {"minReplicas": lo, "maxReplicas": hi}})


def test_crd_schema_and_cel_validation(kubectl, namespace):
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(CRD))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD['metadata']['name']}")

    bad = kubectl("-n", namespace, "create", "-f", "-", input=_widget("bad", 5, 2), check=False)
    assert bad.returncode != 0
    assert "minReplicas must not exceed maxReplicas" in bad.stderr, bad.stderr

    wrong_type = kubectl("-n", namespace, "create", "-f", "-", check=False,
                         input=_widget("typed", "two", 3))
    assert wrong_type.returncode != 0 and "spec.minReplicas" in wrong_type.stderr, wrong_type.stderr

    kubectl("-n", namespace, "create", "-f", "-", input=_widget("good", 1, 3))
    got = kubectl_json(kubectl, "-n", namespace, "get", "widget", "good")
    assert got["spec"] == {"minReplicas": 1, "maxReplicas": 3}


def test_garbage_collector_deletes_owned_objects(kubectl, namespace):
    kubectl("-n", namespace, "create", "configmap", "owner", "--from-literal=a=b")
    owner = kubectl_json(kubectl, "-n", namespace, "get", "configmap", "owner")
    child = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "child", "ownerReferences": [{
                 "apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                 "uid": owner["metadata"]["uid"], "blockOwnerDeletion": True}]},
             "data": {"x": "y"}}
    kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(child))
    kubectl("-n", namespace, "delete", "configmap", "owner")
    wait_for(lambda: kubectl("-n", namespace, "get", "configmap", "child", check=False).returncode != 0,
          90, "the garbage collector to delete the owned ConfigMap")


def test_add_pool_registers_ready_nodes(dev_cluster, kubectl):
    before = dev_cluster.node_counts().get("rtx-pro-6000", {"total": 0})["total"]
    names = dev_cluster.add_pool("rtx-pro-6000", before + 1)
    assert len(names) == before + 1
    node = kubectl_json(kubectl, "get", "node", names[-1])
    assert node["metadata"]["labels"]["nvidia.com/gpu.compute.major"] == "12"
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])


def _alive(pid: int) -> bool:
    """Running (a zombie has exited; only its exit status is left for its parent to collect)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.skipif(bool(os.environ.get("MOE_KUBECONFIG")), reason="needs to start its own cluster")
def test_cli_up_is_idempotent_and_down_leaves_no_process(tmp_path, dev_cluster):
    """Through the CLI, as a user runs it: `up` in one process, `status`/`down` in others."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")])}
    cli = [sys.executable, "-m", "moe_operator.cli", "dev-cluster", "--state-dir", str(tmp_path / "dc")]

    def run(*args, check=True):
        p = subprocess.run(cli + list(args), env=env, capture_output=True, text=True, timeout=300)
        assert not check or p.returncode == 0, p.stderr[-3000:]
        return p

    kubeconfig = run("up", "--pools", "h200=1").stdout.strip().splitlines()[-1]
    dc = DevCluster(tmp_path / "dc")
    assert Path(kubeconfig) == dc.kubeconfig
    pids = dc.pids()
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}
    assert all(_alive(pid) for pid in pids.values())

    again = run("up")  # healthy cluster: reused, same processes
    assert "reusing running cluster" in again.stderr
    assert dc.pids() == pids
    status = json.loads(run("status", "--json").stdout)
    assert status["running"] and status["nodes"]["h200"] == {"total": 1, "ready": 1}
    assert run("env").stdout.strip() == f"export KUBECONFIG={kubeconfig}"

    # a dead component makes the cluster unhealthy: `up` stops the rest and starts afresh
    os.kill(pids["kwok"], 9)
    wait_for(lambda: not _alive(pids["kwok"]), 10, "kwok to die")
    restarted = run("up", "--pools", "h200=1")
    assert "stale or unhealthy" in restarted.stderr, restarted.stderr
    wait_for(lambda: not any(_alive(pid) for pid in pids.values()), 30, f"old processes {pids} to exit")
    pids = dc.pids()
    assert all(_alive(pid) for pid in pids.values())

    run("down")
    wait_for(lambda: not any(_alive(pid) for pid in pids.values()), 30, f"processes {pids} to exit")
    assert run("status", check=False).returncode != 0
    assert dc.pids() == {}
    # the session cluster was not touched
    assert all(_alive(pid) for pid in dev_cluster.pids().values())


def test_pinned_tools_talk_to_the_server(dev_cluster):
    version = json.loads(dev_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    assert version["clientVersion"]["major"] == version["serverVersion"]["major"]
    assert "v3." in dev_cluster.helm("version", "--short").stdout
    assert dev_cluster.helm("list", "-A").returncode == 0


@pytest.mark.skipif(bool(os.environ.get("MOE_KUBECONFIG")), reason="needs to start its own cluster")
def test_up_retries_when_a_port_is_taken(tmp_path, monkeypatch):
    """A port picked free can be taken before the component binds it: `up` must retry."""
    import socket

    from moe_operator.devcluster import cluster as C

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real = C._distinct_ports
    calls = []

    def first_one_taken():
        ports = real()
        if not calls:
            ports.etcd_client = taken
        calls.append(ports)
        return ports

    monkeypatch.setattr(C, "_distinct_ports", first_one_taken)
    dc = DevCluster(tmp_path / "dc")
    try:
        dc.up(pools={"h100": 1})
        assert len(calls) == 2 and dc.status()["running"]
        assert dc.node_counts() == {"h100": {"total": 1, "ready": 1}}
        dc.remove_pool("h100")
        wait_for(lambda: dc.node_counts() == {}, 30, "the h100 nodes to be deleted")
    finally:
        dc.down()
        squatter.close()
    assert not any(_alive(pid) for pid in [p for p in dc.pids().values()])


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("MOE_KUBECONFIG")), reason="needs to start its own cluster")
def test_scale_hundreds_of_nodes_and_pods(tmp_path):
    """The launcher serves scale tests: 300 GPU nodes register and go Ready, and the real
    scheduler places 300 single-GPU pods onto the 10.x pools only."""
    dc = DevCluster(tmp_path / "dc")
    try:
        t0 = time.monotonic()
        dc.up(pools=P.parse_pools("all=50"))
        assert sum(c["ready"] for c in dc.node_counts().values()) == 300
        up_s = time.monotonic() - t0
        kubectl = dc.kubectl
        kubectl("create", "namespace", "scale")
        dep = _deployment("wide", [{"key": "nvidia.com/gpu.compute.major", "operator": "In", "values": ["10"]}], 300)
        kubectl("-n", "scale", "apply", "-f", "-", input=json.dumps(dep))
        nodes = kubectl_json(kubectl, "get", "nodes", "-l", P.POOL_LABEL)["items"]
        pool_of = {n["metadata"]["name"]: n["metadata"]["labels"][P.POOL_LABEL] for n in nodes}

        def all_running():
            pods = kubectl_json(kubectl, "-n", "scale", "get", "pods")["items"]
            running = [p for p in pods if p["status"].get("phase") == "Running"]
            return running if len(running) == 300 else None

        t1 = time.monotonic()
        pods = wait_for(all_running, 180, "300 Running pods")
        # 50 b200 nodes x 8 GPUs + 50 gb200 x 4 = 600 GPUs for 300 single-GPU pods
        assert {pool_of[p["spec"]["nodeName"]] for p in pods} <= {"b200", "gb200"}
        print(f"300 nodes up in {up_s:.1f}s, 300 pods Running in {time.monotonic() - t1:.1f}s")
    finally:
        dc.down()
