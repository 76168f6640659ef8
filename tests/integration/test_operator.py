"""The operator against the real local control plane (etcd + kube-apiserver + scheduler + kwok nodes)."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from .operator_fixture import SAMPLES, condition, get_json, wait_for

pytestmark = pytest.mark.integration

# sample file -> (expected GPU class prefix, expected backend, deferred finalize, workload kind, pool label)
EXPECTED = {
    "deepseek-v4-fp4-h200.yaml": ("sm90/NVIDIA-H200", "flashinfer_mxfp4", False, "Deployment", "h200"),
    "deepseek-v4-fp4-b200.yaml": ("sm100/NVIDIA-B200", "flashinfer_mxfp4", False, "Deployment", "b200"),
    "deepseek-v3-nvfp4-b200.yaml": ("sm100/NVIDIA-B200", "flashinfer_trtllm", True, "Deployment", "b200"),
    "gpt-oss-mxfp4-h100.yaml": ("sm90/NVIDIA-H100-80GB-HBM3", "triton_kernel", False, "Deployment", "h100"),
    "qwen3-moe-fp8.yaml": ("sm", "auto", False, "Deployment", None),
    "explicit-backend-override.yaml": ("sm90/", "marlin", False, "Deployment", None),
    "deepseek-v3-fp8-multinode.yaml": ("sm90/NVIDIA-H200", "auto", False, "LeaderWorkerSet", None),
}


def apply_sample(kubectl, namespace: str, name: str) -> dict:
    doc = yaml.safe_load((SAMPLES / name).read_text())
    doc["metadata"]["namespace"] = namespace
    kubectl("apply", "-f", "-", input=json.dumps(doc))
    return doc


def wait_planned(kubectl, ns, name, operator, timeout=60):
    def planned():
        obj = get_json(kubectl, "moed", name, "-n", ns)
        c = condition(obj, "Planned")
        return obj if c and c["status"] == "True" else None
    return wait_for(planned, timeout, f"{ns}/{name} Planned", operator.log_tail)


@pytest.mark.parametrize("sample", sorted(EXPECTED))
def test_sample_is_planned_rendered_and_scheduled(sample, kubectl, namespace, operator):
    doc = apply_sample(kubectl, namespace, sample)
    name = doc["metadata"]["name"]
    gpu_prefix, backend, deferred, kind, pool = EXPECTED[sample]
    obj = wait_planned(kubectl, namespace, name, operator)
    st = obj["status"]
    assert st["gpuClass"].startswith(gpu_prefix), st["gpuClass"]
    assert st["runnerBackend"] == backend
    assert st["plan"]["moe"]["deferredFinalize"] is deferred
    assert st["plan"]["reasons"], "every plan explains itself"
    assert condition(obj, "CheckpointInspected")["status"] == "True"
    assert st["observedGeneration"] == obj["metadata"]["generation"]

    # The ConfigMap with the plan and the Service always exist, owned by the MoEDeployment.
    cm = get_json(kubectl, "configmap", f"{name}-plan", "-n", namespace)
    assert json.loads(cm["data"]["plan.json"])["moe"]["runnerBackend"] == backend
    svc = get_json(kubectl, "service", name, "-n", namespace)
    assert svc["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]

    if kind == "LeaderWorkerSet":
        # The LWS CRD validates what we render; no LWS controller runs locally, so no pods.
        lws = wait_for(lambda: get_json(kubectl, "leaderworkersets.leaderworkerset.x-k8s.io", name, "-n", namespace),
                       30, "LeaderWorkerSet", operator.log_tail)
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert lws["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
        assert leader["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert "--nnodes" in leader["args"]
        return

    dep = wait_for(lambda: get_json(kubectl, "deployment", name, "-n", namespace), 30, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    for k, v in st["plan"]["env"].items():
        assert env[k] == v
    args = c["args"]
    if backend != "auto" and doc["spec"].get("engine", {}).get("name", "bundled") == "sglang":
        assert args[args.index("--moe-runner-backend") + 1] == backend
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"]: e["values"] for e in terms[0]["matchExpressions"]}
    assert keys["nvidia.com/gpu.compute.major"] == [st["plan"]["gpu"]["family"].removeprefix("sm")[:-1]]
    assert keys["nvidia.com/gpu.product"] == [st["gpuClass"].split("/", 1)[1]]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == str(doc["spec"].get("parallelism", {}).get("tp", 1))

    # The real scheduler puts the pods on the right simulated pool and kwok runs them.
    replicas = doc["spec"].get("replicas", 1)

    def running():
        pods = get_json(kubectl, "pods", "-n", namespace, "-l", f"moe.serving.dev/deployment={name}")
        items = [p for p in pods["items"] if p["status"].get("phase") == "Running"]
        return items if len(items) == replicas else None
    pods = wait_for(running, 60, f"{replicas} Running pods of {name}", operator.log_tail)
    product = st["gpuClass"].split("/", 1)[1]
    for p in pods:
        node = get_json(kubectl, "node", p["spec"]["nodeName"])
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == product
        if pool:
            assert node["metadata"]["labels"]["moe.serving.dev/pool"] == pool

    def available():
        o = get_json(kubectl, "moed", name, "-n", namespace)
        return o if condition(o, "Available")["status"] == "True" and o["status"]["readyReplicas"] == replicas else None
    wait_for(available, 60, f"{name} Available", operator.log_tail)


def test_a_reconcile_holding_a_stale_body_keeps_the_placed_class(kubectl, kubeconfig, namespace, operator):
    """Placement is sticky. Every trigger (a kopf retry holding an old body, the resync racing the
    handler) reconciles through one path that reads the object itself; and the class comes from the
    live workload first, so even a status that lost gpuClass (a crash between apply and the status
    write) does not move it. Here the placed class is full, so placing from scratch would move it."""
    import asyncio
    import logging

    from kubernetes import config as kconfig

    from moe_operator import handlers
    from moe_operator.inventory import node_info
    from moe_operator.kube import Kube
    from moe_operator.policy import Policy
    from moe_operator.reconcile import Config

    from .operator_fixture import ALLOWED_HOST_PATHS, CHECKPOINTS

    doc = apply_sample(kubectl, namespace, "qwen3-moe-fp8.yaml")
    name = doc["metadata"]["name"]
    live = wait_planned(kubectl, namespace, name, operator)
    placed = live["status"]["gpuClass"]
    infos = [node_info(n) for n in get_json(kubectl, "nodes")["items"]]
    infos = [i for i in infos if i.gpu_class is not None]
    gpu_nodes = {"all": infos}
    gpu_pods = {i.name: [i.allocatable] for i in infos if i.gpu_class.key() == placed}   # placed class: full
    assert any(i.gpu_class.key() != placed for i in infos), "the sample allows another class"
    kube = Kube(kconfig.new_client_from_config(config_file=kubeconfig))
    events = []
    kube.post_event = lambda obj, type_, reason, message: events.append(reason)
    st = handlers.State(kube=kube, cfg=Config(local_models_dir=str(CHECKPOINTS),
                                              policy=Policy(allowed_host_paths=ALLOWED_HOST_PATHS)))
    operator.stop()   # nothing else may write status while this test takes it away
    try:
        out = asyncio.run(handlers._reconcile_and_report(st, namespace, name, gpu_nodes, gpu_pods,
                                                         logging.getLogger("test"), "test"))
        assert out.status["gpuClass"] == placed, f"moved from {placed}; events {events}"
        assert "Planned" not in events, "a re-placement announces a new plan"
        # a crash between apply and status: the status has no class, the live workload still does
        kubectl("patch", "moed", name, "-n", namespace, "--subresource=status", "--type=merge",
                "-p", '{"status":{"gpuClass":null}}')
        assert "gpuClass" not in get_json(kubectl, "moed", name, "-n", namespace)["status"]
        out = asyncio.run(handlers._reconcile_and_report(st, namespace, name, gpu_nodes, gpu_pods,
                                                         logging.getLogger("test"), "test"))
        assert out.status["gpuClass"] == placed, f"moved from {placed} after losing status.gpuClass"
        assert get_json(kubectl, "moed", name, "-n", namespace)["status"]["gpuClass"] == placed
    finally:
        operator.start()
    dep = get_json(kubectl, "deployment", name, "-n", namespace)
    assert dep["metadata"]["annotations"]["moe.serving.dev/gpu-class"] == placed
    terms = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"]: e["values"] for e in terms["nodeSelectorTerms"][0]["matchExpressions"]}
    assert keys["nvidia.com/gpu.compute.major"] == [placed.split("/")[0].removeprefix("sm")[:-1]]


def test_spec_update_rerenders_and_restart_changes_nothing(kubectl, namespace, operator):
    doc = apply_sample(kubectl, namespace, "explicit-backend-override.yaml")
    name = doc["metadata"]["name"]
    wait_planned(kubectl, namespace, name, operator)
    dep = wait_for(lambda: get_json(kubectl, "deployment", name, "-n", namespace), 30, "Deployment")
    old_hash = dep["metadata"]["annotations"]["moe.serving.dev/inputs-hash"]

    kubectl("patch", "moed", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"moe":{"runnerBackend":"auto"}}}')

    def rerendered():
        d = get_json(kubectl, "deployment", name, "-n", namespace)
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        return d if args[args.index("--moe-runner-backend") + 1] == "flashinfer_mxfp4" else None
    dep = wait_for(rerendered, 30, "re-render with flashinfer_mxfp4", operator.log_tail)
    new_hash = dep["metadata"]["annotations"]["moe.serving.dev/inputs-hash"]
    assert new_hash != old_hash
    obj = get_json(kubectl, "moed", name, "-n", namespace)
    assert obj["status"]["runnerBackend"] == "flashinfer_mxfp4"

    # Drift is repaired: someone edits the env of the workload by hand.
    wait_for(lambda: get_json(kubectl, "moed", name, "-n", namespace)["status"].get("inputsHash") == new_hash, 30, "status")
    kubectl("set", "env", f"deployment/{name}", "-n", namespace, "SGLANG_CACHE_DIR=/tmp/elsewhere")

    def repaired():
        d = get_json(kubectl, "deployment", name, "-n", namespace)
        env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        return d if env.get("SGLANG_CACHE_DIR") == "/var/cache/moe/sglang" else None
    dep = wait_for(repaired, 30, "drift repaired", operator.log_tail)

    # An operator restart changes nothing that is already right.
    time.sleep(3)
    before = get_json(kubectl, "deployment", name, "-n", namespace)["metadata"]["resourceVersion"]
    operator.stop()
    operator.start()
    time.sleep(8)  # resume handler + several resync ticks
    after = get_json(kubectl, "deployment", name, "-n", namespace)["metadata"]["resourceVersion"]
    assert before == after


def test_node_pool_appearing_replans(dev_cluster, kubectl, namespace, operator):
    dev_cluster.remove_pool("rtx-pro-6000")
    try:
        doc = apply_sample(kubectl, namespace, "deepseek-v3-nvfp4-b200.yaml")
        name = doc["metadata"]["name"]
        kubectl("patch", "moed", name, "-n", namespace, "--type=merge",
                "-p", '{"spec":{"gpu":{"allowedArchitectures":["sm120"]}}}')

        def not_feasible():
            c = condition(get_json(kubectl, "moed", name, "-n", namespace), "Planned")
            return c if c and c["status"] == "False" and c["reason"] == "NoFeasibleGpuClass" else None
        c = wait_for(not_feasible, 30, "NoFeasibleGpuClass", operator.log_tail)
        assert "sm120" in c["message"]
    finally:
        dev_cluster.add_pool("rtx-pro-6000", 2)
    obj = wait_planned(kubectl, namespace, name, operator)
    assert obj["status"]["gpuClass"] == "sm120/NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"
    assert obj["status"]["runnerBackend"] == "flashinfer_cutlass"


def test_impossible_explicit_backend_is_not_planned(kubectl, namespace, operator):
    doc = apply_sample(kubectl, namespace, "deepseek-v3-nvfp4-b200.yaml")
    name = doc["metadata"]["name"]
    kubectl("patch", "moed", name, "-n", namespace, "--type=merge",
            "-p", '{"spec":{"gpu":{"allowedArchitectures":["sm90"]},"moe":{"runnerBackend":"flashinfer_trtllm"}}}')

    def rejected():
        c = condition(get_json(kubectl, "moed", name, "-n", namespace), "Planned")
        return c if c and c["status"] == "False" else None
    c = wait_for(rejected, 30, "Planned=False", operator.log_tail)
    assert "SM100" in c["message"] and "flashinfer_trtllm" in c["message"]


def test_unreadable_checkpoint_sets_condition_with_cause(kubectl, namespace, operator, tmp_path):
    bad = tmp_path / "broken-ckpt"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"], oops}')
    doc = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
           "metadata": {"name": "broken", "namespace": namespace},
           "spec": {"model": {"uri": f"file://{bad}"}}}
    kubectl("apply", "-f", "-", input=json.dumps(doc))

    def failed():
        c = condition(get_json(kubectl, "moed", "broken", "-n", namespace), "CheckpointInspected")
        return c if c and c["status"] == "False" else None
    c = wait_for(failed, 30, "CheckpointInspected=False", operator.log_tail)
    assert c["reason"] == "Unreadable" and "config.json" in c["message"] and "invalid JSON" in c["message"]
    events = get_json(kubectl, "events", "-n", namespace, "--field-selector", "involvedObject.name=broken")
    assert any(e["reason"] == "CheckpointInspectionFailed" for e in events["items"])


@pytest.mark.parametrize("patch,message", [
    ({"parallelism": {"tp": 8, "ep": 3}}, "parallelism.ep must divide parallelism.tp"),
    ({"moe": {"a2aBackend": "deepep"}}, "moe.a2aBackend needs expert parallelism"),
    ({"moe": {"runnerBackend": "marlin"}}, "engine bundled supports moe.runnerBackend"),
    ({"nodesPerReplica": 9, "gpusPerReplica": 72, "parallelism": {"tp": 72}}, "bundled engine serves at most 8 nodes per replica"),
    ({"model": {"uri": "s3://bucket/model"}}, "spec.model.uri"),
    ({"engine": {"name": "sglang"}, "moe": {"runnerBackend": "flashinfer_b12x"}}, "not an sglang --moe-runner-backend"),
    ({"engine": {"name": "vllm"}, "moe": {"runnerBackend": "flashinfer_mxfp4"}}, "not a vLLM --moe-backend"),
])
def test_invalid_crs_are_refused_by_the_api_server(kubectl, namespace, crd, patch, message):
    spec = {"model": {"uri": "hf://deepseek-ai/DeepSeek-V3"}}
    for k, v in patch.items():
        spec[k] = {**spec.get(k, {}), **v} if isinstance(v, dict) else v
    doc = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
           "metadata": {"name": "invalid", "namespace": namespace}, "spec": spec}
    r = kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_deletion_leaves_nothing_behind(kubectl, namespace, operator):
    doc = apply_sample(kubectl, namespace, "gpt-oss-mxfp4-h100.yaml")
    name = doc["metadata"]["name"]
    wait_planned(kubectl, namespace, name, operator)
    wait_for(lambda: get_json(kubectl, "deployment", name, "-n", namespace), 30, "Deployment")
    kubectl("delete", "moed", name, "-n", namespace, "--wait=true", "--timeout=60s")

    def gone():
        left = [k for k in ("deployment", "service", "configmap") if get_json(kubectl, k, name if k != "configmap" else f"{name}-plan", "-n", namespace)]
        pods = get_json(kubectl, "pods", "-n", namespace, "-l", f"moe.serving.dev/deployment={name}")["items"]
        return not left and not pods
    wait_for(gone, 60, "garbage collection of owned objects", operator.log_tail)


def test_admission_webhook_rejects_backend_impossible_on_every_allowed_class(kubectl, kubeconfig, namespace, crd, tmp_path):
    """kopf serves the validating webhook; the API server calls it and refuses with the planner's message."""
    from .operator_fixture import start_webhook_operator

    op, _ = start_webhook_operator(kubeconfig, tmp_path / "admission.log")
    try:
        wait_for(lambda: get_json(kubectl, "validatingwebhookconfiguration", "validate.moe.serving.dev"), 30,
                 "managed ValidatingWebhookConfiguration", op.log_tail)
        doc = yaml.safe_load((SAMPLES / "deepseek-v3-nvfp4-b200.yaml").read_text())
        doc["metadata"] = {"name": "adm", "namespace": namespace}
        doc["spec"]["moe"] = {"runnerBackend": "flashinfer_trtllm"}
        doc["spec"]["gpu"] = {"allowedArchitectures": ["sm90", "sm120"]}

        def refused():
            r = kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
            return r.stderr if r.returncode != 0 and "denied the request" in r.stderr else None
        err = wait_for(refused, 30, "webhook refusal", op.log_tail)
        assert "impossible on every allowed GPU class" in err and "SM100" in err
        doc["spec"]["gpu"] = {"allowedArchitectures": ["sm90", "sm100"]}
        kubectl("apply", "-f", "-", input=json.dumps(doc))  # possible on B200: accepted
    finally:
        op.stop()
        # The managed webhook outlives the process; with no server behind it, it must go.
        kubectl("delete", "validatingwebhookconfiguration", "validate.moe.serving.dev", "--ignore-not-found")


def test_pvc_checkpoint_is_inspected_by_a_job(kubectl, namespace, operator):
    """pvc:// runs `moe-runtime inspect` in a Job with the claim mounted read-only and reads the
    pod's termination message. kwok completes Job pods without a message, so the operator must say so."""
    missing = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
               "metadata": {"name": "no-claim", "namespace": namespace},
               "spec": {"model": {"uri": "pvc://nosuchclaim/x"}}}
    kubectl("apply", "-f", "-", input=json.dumps(missing))

    def no_claim():
        cnd = condition(get_json(kubectl, "moed", "no-claim", "-n", namespace), "CheckpointInspected")
        return cnd if cnd and cnd["status"] == "False" else None
    cnd = wait_for(no_claim, 30, "CheckpointInspected=False for a missing claim", operator.log_tail)
    assert "PersistentVolumeClaim 'nosuchclaim' not found" in cnd["message"]

    # A statically bound claim, so the inspection pod can be scheduled.
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"models-{namespace}"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                   "hostPath": {"path": "/models"},
                   "claimRef": {"namespace": namespace, "name": "models"}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": namespace},
           "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": f"models-{namespace}",
                    "resources": {"requests": {"storage": "1Gi"}}}}
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]}))
    doc = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
           "metadata": {"name": "from-pvc", "namespace": namespace},
           "spec": {"model": {"uri": "pvc://models/deepseek/v3"}}}
    kubectl("apply", "-f", "-", input=json.dumps(doc))

    def job():
        jobs = get_json(kubectl, "jobs", "-n", namespace, "-l", "moe.serving.dev/role=inspect")["items"]
        return jobs[0] if jobs else None
    j = wait_for(job, 30, "inspection Job", operator.log_tail)
    c = j["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:3] == ["moe-runtime", "inspect", "/models/models/deepseek/v3"]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    vol = j["spec"]["template"]["spec"]["volumes"][0]
    assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}

    def failed():
        cnd = condition(get_json(kubectl, "moed", "from-pvc", "-n", namespace), "CheckpointInspected")
        return cnd if cnd and cnd["status"] == "False" else None
    cnd = wait_for(failed, 60, "CheckpointInspected=False from the Job result", operator.log_tail)
    assert "without a termination message" in cnd["message"]
    kubectl("delete", "pv", f"models-{namespace}", "--wait=false")


def test_a_large_valid_spec_applied_with_kubectl_is_handled(kubectl, namespace, operator):
    """kubectl's last-applied annotation plus kopf's record of the handled configuration used to
    pass the 256 KiB limit on annotations (issue 34 item 4): kopf's record is a digest now."""
    doc = apply_sample(kubectl, namespace, "qwen3-moe-fp8.yaml")
    name = doc["metadata"]["name"]
    doc["metadata"]["annotations"] = {"example.com/notes": "n" * 90_000}
    doc["spec"]["env"] = [{"name": f"APP_SETTING_{i}", "value": "v" * 900} for i in range(40)]  # ~37 KB
    r = kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
    assert r.returncode == 0, r.stderr

    def handled():
        obj = get_json(kubectl, "moed", name, "-n", namespace)
        ann = obj["metadata"].get("annotations") or {}
        rec = ann.get("moe.serving.dev/last-handled-configuration")
        c = condition(obj, "Planned")
        env = obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
        return rec if rec and env and c and c["status"] == "True" else None
    rec = wait_for(handled, 60, f"{namespace}/{name} handled", operator.log_tail)
    assert len(rec) < 1000 and "sha256" in rec


def test_a_gpu_label_flap_moves_no_running_workload(dev_cluster, kubectl, namespace, operator):
    """GPU Feature Discovery restarting removes a node's GPU labels for seconds (issue 34 item 3):
    running pods keep their class through the settle period (PlacementHeld meanwhile), and once
    the labels are back nothing has moved or rolled."""
    from moe_operator.devcluster.pools import POOL_LABEL

    doc = apply_sample(kubectl, namespace, "deepseek-v3-nvfp4-b200.yaml")
    name = doc["metadata"]["name"]
    kubectl("patch", "moed", name, "-n", namespace, "--type=merge",
            "-p", '{"spec":{"gpu":{"allowedArchitectures":["sm120"]}}}')

    def running():
        dep = get_json(kubectl, "deployment", name, "-n", namespace)
        moed = get_json(kubectl, "moed", name, "-n", namespace)
        ok = dep and (dep.get("status") or {}).get("readyReplicas") and moed["status"].get("gpuClass", "").startswith("sm120")
        return dep if ok else None
    dep = wait_for(running, 60, "a ready Deployment on sm120", operator.log_tail)
    gen, cls = dep["metadata"]["generation"], get_json(kubectl, "moed", name, "-n", namespace)["status"]["gpuClass"]
    nodes = get_json(kubectl, "nodes", "-l", f"{POOL_LABEL}=rtx-pro-6000")["items"]
    gfd = {k: v for k, v in nodes[0]["metadata"]["labels"].items() if k.startswith("nvidia.com/")}
    kubectl("label", "nodes", "-l", f"{POOL_LABEL}=rtx-pro-6000", *[f"{k}-" for k in gfd])
    try:
        def held():
            c = condition(get_json(kubectl, "moed", name, "-n", namespace), "PlacementHeld")
            return c if c and c["status"] == "True" else None
        c = wait_for(held, 15, "PlacementHeld", operator.log_tail)
        assert cls in c["message"] and "settle" in c["message"]
        time.sleep(3)
    finally:
        kubectl("label", "--overwrite", "nodes", "-l", f"{POOL_LABEL}=rtx-pro-6000", *[f"{k}={v}" for k, v in gfd.items()])

    def settled():
        c = condition(get_json(kubectl, "moed", name, "-n", namespace), "PlacementHeld")
        return c if c and c["status"] == "False" else None
    wait_for(settled, 20, "PlacementHeld=False", operator.log_tail)
    obj = get_json(kubectl, "moed", name, "-n", namespace)
    assert obj["status"]["gpuClass"] == cls
    assert get_json(kubectl, "deployment", name, "-n", namespace)["metadata"]["generation"] == gen
