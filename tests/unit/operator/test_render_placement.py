"""Pure operator parts: inventory from node objects, placement, rendering, admission verdicts."""

import yaml

from moe_operator.api import MoEDeploymentSpec
from moe_core.checkpoint import inspect_dir
from moe_operator.inventory import build, fingerprint, node_info, pod_gpu_requests
from moe_operator.placement import place
from moe_operator.render import Owner, inputs_hash, render
from moe_operator.sample_checkpoints import write_sample


def node(name, product, major, minor, gpus=8, ready=True, arch="amd64"):
    return {"metadata": {"name": name, "labels": {
        "nvidia.com/gpu.product": product, "nvidia.com/gpu.compute.major": str(major),
        "nvidia.com/gpu.compute.minor": str(minor), "nvidia.com/gpu.count": str(gpus), "kubernetes.io/arch": arch}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "capacity": {"nvidia.com/gpu": str(gpus)},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def classes(used=None):
    nodes = [node("h200-0", "NVIDIA-H200", 9, 0), node("h200-1", "NVIDIA-H200", 9, 0),
             node("h100-0", "NVIDIA-H100-80GB-HBM3", 9, 0),
             node("b200-0", "NVIDIA-B200", 10, 0), node("rtx-0", "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", 12, 0),
             node("down-0", "NVIDIA-B200", 10, 0, ready=False)]
    return build([node_info(n) for n in nodes], used or {})


def spec(**kw):
    base = {"model": {"uri": "file:///models/x"}, "engine": {"name": "sglang"}, "parallelism": {"tp": 8}}
    base.update(kw)
    return MoEDeploymentSpec.model_validate(base)


def test_inventory_free_gpus_and_fingerprint():
    c = classes({"h200-0": 8})
    assert set(c) == {"sm90/NVIDIA-H200", "sm90/NVIDIA-H100-80GB-HBM3", "sm100/NVIDIA-B200",
                      "sm120/NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"}
    assert c["sm90/NVIDIA-H200"].free_gpus == 8 and c["sm90/NVIDIA-H200"].total_gpus == 16
    assert c["sm100/NVIDIA-B200"].nodes == ["b200-0"]  # the NotReady node is not capacity
    assert fingerprint(c) == fingerprint(classes({"h200-1": 4}))  # GPU churn does not re-plan
    assert fingerprint(c) != fingerprint({k: v for k, v in c.items() if "B200" not in k})


def test_pod_gpu_requests():
    pod = {"spec": {"nodeName": "n", "containers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}]}, "status": {}}
    assert pod_gpu_requests(pod) == ("n", 4)
    pod["status"]["phase"] = "Succeeded"
    assert pod_gpu_requests(pod) == (None, 0)


def test_placement_prefers_most_free_capacity_and_explains_rejections(tmp_path):
    ck = inspect_dir(write_sample("deepseek-v3-nvfp4", tmp_path / "c"))
    p = place(spec(), ck, classes())
    assert p.ok and p.inventory.gpu_class.family == "sm90"  # 2 free H200 nodes beat 1 B200
    sticky = place(spec(), ck, classes(), current="sm100/NVIDIA-B200")
    assert sticky.inventory.gpu_class.family == "sm100"  # a class that still fits is kept
    p = place(spec(gpu={"allowedArchitectures": ["sm100", "sm120"]}), ck, classes())
    assert p.plan.moe.runnerBackend == "flashinfer_trtllm" and p.plan.moe.deferredFinalize
    p = place(spec(gpu={"allowedArchitectures": ["sm90"]}, moe={"runnerBackend": "flashinfer_trtllm"}), ck, classes())
    assert not p.ok and "SM100" in p.explain() and "not in gpu.allowedArchitectures" in p.explain()
    p = place(spec(parallelism={"tp": 16}, gpusPerReplica=16), ck, classes())
    assert not p.ok and "GPUs per node" in p.explain()


def test_render_deployment_env_user_wins_and_hash_ignores_prose(tmp_path):
    ck = inspect_dir(write_sample("deepseek-v4-flash-fp4", tmp_path / "c"))
    s = spec(env=[{"name": "FOO", "value": "bar"}])  # SGLANG_CACHE_DIR is the operator's (issue 27: fixed path)
    p = place(s, ck, classes()).plan
    objs = render(Owner("m", "ns", "uid-1"), s, p, classes()["sm90/NVIDIA-H200"].gpu_class)
    kinds = [o["kind"] for o in objs]
    assert kinds == ["ConfigMap", "Service", "Deployment"]
    dep = objs[-1]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SGLANG_CACHE_DIR"] == "/var/cache/moe/sglang" and env["FOO"] == "bar"
    assert c["args"][c["args"].index("--moe-runner-backend") + 1] == "flashinfer_mxfp4"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "uid-1" for o in objs)
    g = classes()["sm90/NVIDIA-H200"].gpu_class
    p2 = p.model_copy(update={"reasons": ["different words"]})
    assert inputs_hash(s, p, g, "img") == inputs_hash(s, p2, g, "img")
    p3 = p.model_copy(update={"args": p.args + ["--x"]})
    assert inputs_hash(s, p, g, "img") != inputs_hash(s, p3, g, "img")


def test_render_multinode_is_leaderworkerset(tmp_path):
    ck = inspect_dir(write_sample("deepseek-v3-fp8", tmp_path / "c"))
    s = spec(parallelism={"tp": 16}, gpusPerReplica=16, nodesPerReplica=2)
    p = place(s, ck, classes()).plan
    objs = render(Owner("m", "ns", "u"), s, p, classes()["sm90/NVIDIA-H200"].gpu_class)
    lws = objs[-1]
    assert lws["kind"] == "LeaderWorkerSet" and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert "--node-rank" in worker["args"] and "$(LWS_WORKER_INDEX)" in worker["args"]
    assert objs[1]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_render_bundled_and_gb200_image_variant(tmp_path):
    ck = inspect_dir(write_sample("deepseek-v3-nvfp4", tmp_path / "c"))
    s = MoEDeploymentSpec.model_validate({"model": {"uri": "hf://nvidia/DeepSeek-V3-FP4@main"}})
    cl = build([node_info(node("gb-0", "NVIDIA-GB200", 10, 0, gpus=4, arch="arm64"))], {})
    p = place(s, ck, cl).plan
    dep = render(Owner("m", "ns", "u"), s, p, cl["sm100/NVIDIA-GB200"].gpu_class)[-1]
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"].endswith("-cu13-flashinfer-arm64")
    assert pod["initContainers"][0]["args"][:2] == ["download", "nvidia/DeepSeek-V3-FP4"]
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert {"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64"]} in terms["matchExpressions"]


def test_admission_verdict(tmp_path):
    from moe_operator.policy import Policy
    from moe_operator.reconcile import Config
    from moe_operator.webhook import verdict

    write_sample("deepseek-v3-nvfp4", tmp_path / "deepseek-v3-nvfp4")
    cfg = Config(local_models_dir=str(tmp_path), policy=Policy(allowed_host_paths=("/models",)))
    ok = {"model": {"uri": "file:///models/deepseek-v3-nvfp4"}, "engine": {"name": "sglang"}, "parallelism": {"tp": 8},
          "moe": {"runnerBackend": "flashinfer_trtllm"}}
    assert verdict(ok, cfg) is None  # B200 exists among all families
    assert "not under an allowed host path" in verdict(ok, Config(local_models_dir=str(tmp_path),
                                                                  policy=Policy(allowed_host_paths=("/data",))))
    assert "host paths are not allowed" in verdict(ok, Config(local_models_dir=str(tmp_path)))
    assert verdict({"model": "not an object"}, cfg).startswith("invalid spec: model")
    bad = {**ok, "gpu": {"allowedArchitectures": ["sm90", "sm120"]}}
    msg = verdict(bad, cfg)
    assert msg and "sm90" in msg and "sm120" in msg and "SM100" in msg


def test_samples_render(tmp_path):
    from pathlib import Path
    root = Path(__file__).resolve().parents[3] / "deploy" / "samples"
    for f in sorted((root / "demo").glob("*.yaml")):  # the file:// samples (hf:// ones have no local checkpoint)
        doc = yaml.safe_load(f.read_text())
        s = MoEDeploymentSpec.model_validate(doc["spec"])
        name = s.model.uri.rsplit("/", 1)[1]
        ck = inspect_dir(root / "checkpoints" / name)
        p = place(s, ck, classes())
        assert p.ok, (f.name, p.explain())
