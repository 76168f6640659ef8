"""Day-2 rendering (issue 22), pure: rollout policy from free capacity, PDB, HPA/KEDA, InferencePool."""

import pytest
from pydantic import ValidationError

from moe_core.checkpoint import inspect_dir
from moe_operator import day2, epp
from moe_operator.api import MoEDeploymentSpec
from moe_operator.inventory import build, node_info
from moe_operator.placement import place
from moe_operator.render import Owner, render
from moe_operator.sample_checkpoints import write_sample



def node(name, product, major, minor, gpus=8):
    return {"metadata": {"name": name, "labels": {
        "nvidia.com/gpu.product": product, "nvidia.com/gpu.compute.major": str(major),
        "nvidia.com/gpu.compute.minor": str(minor), "nvidia.com/gpu.count": str(gpus), "kubernetes.io/arch": "amd64"}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "capacity": {"nvidia.com/gpu": str(gpus)},
                   "conditions": [{"type": "Ready", "status": "True"}]}}


def spec(**kw):
    base = {"model": {"uri": "file:///models/x"}, "engine": {"name": "sglang"}, "parallelism": {"tp": 8}}
    base.update(kw)
    return MoEDeploymentSpec.model_validate(base)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return inspect_dir(write_sample("deepseek-v3-nvfp4", tmp_path_factory.mktemp("c")))


def rendered(ckpt, used=None, **kw):
    s = spec(gpu={"product": "NVIDIA-H200"}, **kw)
    classes = build([node_info(node(f"h200-{i}", "NVIDIA-H200", 9, 0)) for i in range(2)], used or {})
    p = place(s, ckpt, classes)
    assert p.ok, p.explain()
    spare = day2.spare_gpu_sets(p.inventory.free_per_node, s.gpus_per_node(), s.nodesPerReplica)
    rollout = day2.rollout_policy(s, p.inventory.gpu_class.key(), spare)
    objs = render(Owner("m", "ns", "uid-1"), s, p.plan, p.inventory.gpu_class, rollout=rollout)
    return {o["kind"]: o for o in objs if not epp.is_picker(o)}, rollout  # the workload's, not the picker's


def test_rollout_surges_onto_a_spare_gpu_set(ckpt):
    objs, rollout = rendered(ckpt, used={"h200-0": 8})  # one H200 node taken, the other free
    assert objs["Deployment"]["spec"]["strategy"] == {"type": "RollingUpdate",
                                                      "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert rollout.spare_sets == 1 and "surging" in rollout.message


def test_rollout_on_a_full_class_replaces_one_replica_at_a_time(ckpt):
    objs, rollout = rendered(ckpt, used={"h200-0": 8, "h200-1": 4}, replicas=2)
    assert objs["Deployment"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert rollout.message == ("no free capacity of class sm90/NVIDIA-H200: rolling one replica at a time "
                               "(maxSurge 0, maxUnavailable 1)")


def test_rollout_explicit_values_win_and_never_both_zero(ckpt):
    objs, rollout = rendered(ckpt, rollout={"maxSurge": 2, "maxUnavailable": 1})
    assert objs["Deployment"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 2, "maxUnavailable": 1}
    r = day2.rollout_policy(spec(rollout={"maxUnavailable": 0}), "sm90/X", 0)
    assert (r.max_surge, r.max_unavailable) == (1, 0) and "waits for a free GPU set" in r.message
    r = day2.rollout_policy(spec(rollout={"maxSurge": 0}), "sm90/X", 3)
    assert (r.max_surge, r.max_unavailable) == (0, 1)
    with pytest.raises(ValidationError):  # the CRD's CEL says the same at admission
        spec(rollout={"maxSurge": 0, "maxUnavailable": -1})


def test_leaderworkerset_gets_its_rolling_settings(ckpt):
    s = spec(nodesPerReplica=2, parallelism={"tp": 16}, gpu={"product": "NVIDIA-H200"})
    classes = build([node_info(node(f"h200-{i}", "NVIDIA-H200", 9, 0)) for i in range(4)], {})
    p = place(s, ckpt, classes)
    assert p.ok, p.explain()
    assert day2.spare_gpu_sets(p.inventory.free_per_node, 8, 2) == 2
    objs = {o["kind"]: o for o in render(Owner("m", "ns", "u"), s, p.plan, p.inventory.gpu_class,
                                           rollout=day2.rollout_policy(s, "sm90/NVIDIA-H200", 0))}
    assert objs["LeaderWorkerSet"]["spec"]["rolloutStrategy"] == {
        "type": "RollingUpdate", "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1}}


def test_pdb_only_with_more_than_one_replica(ckpt):
    objs, _ = rendered(ckpt)
    assert "PodDisruptionBudget" not in objs
    objs, _ = rendered(ckpt, replicas=3)
    pdb = objs["PodDisruptionBudget"]
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"]["matchLabels"] == objs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    objs, _ = rendered(ckpt, replicas=3, rollout={"minAvailable": 1})
    assert objs["PodDisruptionBudget"]["spec"]["minAvailable"] == 1
    # multi-node: pods unavailable, so one drained pod (one group down) blocks the next
    s = spec(replicas=3, nodesPerReplica=2, parallelism={"tp": 16})
    pdb = day2.pod_disruption_budget("m", "ns", {}, {"a": "b"}, s)
    assert pdb["spec"] == {"selector": {"matchLabels": {"a": "b"}}, "maxUnavailable": 1}


def test_hpa_on_the_engines_queue_metric(ckpt):
    objs, _ = rendered(ckpt, autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 6})
    hpa = objs["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment", "name": "m"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    m = hpa["spec"]["metrics"][0]["pods"]
    assert m["metric"]["name"] == "sglang_num_queue_reqs" and m["target"] == {"type": "AverageValue", "averageValue": "4"}
    objs, _ = rendered(ckpt, engine={"name": "vllm"}, moe={"runnerBackend": "auto"},
                       autoscaling={"enabled": True, "metric": "kv", "target": 75})
    m = objs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]
    assert m["metric"]["name"] == "vllm_kv_cache_usage_perc" and m["target"]["averageValue"] == "750m"
    objs, _ = rendered(ckpt)
    assert "HorizontalPodAutoscaler" not in objs and "ScaledObject" not in objs


def test_keda_scaled_object_and_scale_to_zero_rules(ckpt):
    objs, _ = rendered(ckpt, autoscaling={"enabled": True, "provider": "keda", "minReplicas": 0, "maxReplicas": 3,
                                          "prometheusAddress": "http://prometheus.monitoring:9090"})
    so = objs["ScaledObject"]
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["spec"]["minReplicaCount"] == 0
    assert so["spec"]["scaleTargetRef"]["kind"] == "MoEDeployment"
    t = so["spec"]["triggers"][0]
    assert t["type"] == "prometheus" and t["metricType"] == "AverageValue"
    assert t["metadata"]["query"] == 'sum(sglang:num_queue_reqs{namespace="ns",pod=~"m-[a-z0-9]+-[a-z0-9]{5}"})'
    assert t["metadata"]["threshold"] == "4"
    assert spec().autoscaling.minReplicas == 1  # scale to zero is off by default
    with pytest.raises(ValidationError):  # bounded strings; the CEL rules are checked at admission (integration)
        spec(autoscaling={"prometheusAddress": "prom:9090"})


def test_inference_pool_selects_exactly_the_serving_pods(ckpt):
    objs, _ = rendered(ckpt, gateway={"inferencePool": {"enabled": True}})
    pool = objs["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    sel = pool["spec"]["selector"]["matchLabels"]
    pod_labels = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert sel.items() <= pod_labels.items()
    assert sel["moe.serving.dev/deployment"] == "m" and sel["app.kubernetes.io/instance"] == "m"
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "m-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    objs, _ = rendered(ckpt, gateway={"inferencePool": {"enabled": True, "endpointPicker": {"name": "epp", "port": 9100}}})
    assert objs["InferencePool"]["spec"]["endpointPickerRef"]["name"] == "epp"
    # a LeaderWorkerSet's workers serve no HTTP: only leaders are in the pool
    assert day2.serving_selector("m", True)["moe.serving.dev/role"] == "leader"


def test_engine_images_follow_the_cpu_arch():
    from moe_core.gpu import from_name

    from moe_operator.images import engine_image

    gb200 = from_name("sm100").model_copy(update={"arch": "arm64", "product": "NVIDIA-GB200"})
    h200 = from_name("sm90")
    assert gb200.arch == "arm64" and h200.arch == "amd64"
    assert engine_image("vllm", "0.33.0", gb200) == "vllm/vllm-openai:v0.33.0-aarch64"
    assert engine_image("vllm", "0.33.0", h200) == "vllm/vllm-openai:v0.33.0"
    # sglang's version tag is the multi-arch manifest (its arm64 image is the Grace-Blackwell build)
    assert engine_image("sglang", "0.5.23", gb200) == engine_image("sglang", "0.5.23", h200) == "lmsysorg/sglang:v0.5.23"


def test_plan_policy_pin_holds_a_plan_change_the_spec_did_not_cause(ckpt):
    s = spec(gpu={"product": "NVIDIA-H200"})
    assert s.planPolicy == "pin"
    classes = build([node_info(node("h200-0", "NVIDIA-H200", 9, 0))], {})
    new = place(s, ckpt, classes).plan
    older = new.model_copy(update={"args": [*new.args, "--old-rule"], "env": {**new.env, "OLD": "1"}})
    status = {"plan": older.model_dump(mode="json"), "planGeneration": 3, "gpuClass": "sm90/NVIDIA-H200"}
    plan, diff = day2.held_plan(s, status, new, "sm90/NVIDIA-H200", 3)
    assert plan == older
    assert "env.OLD: '1' -> None" in diff and any(d.startswith("args: ") and "--old-rule ->" in d for d in diff), diff
    # a spec change (new generation), another GPU class, follow, or no recorded plan: the new plan goes
    assert day2.held_plan(s, status, new, "sm90/NVIDIA-H200", 4) == (new, [])
    assert day2.held_plan(s, status, new, "sm100/NVIDIA-B200", 3) == (new, [])
    assert day2.held_plan(spec(planPolicy="follow"), status, new, "sm90/NVIDIA-H200", 3) == (new, [])
    assert day2.held_plan(s, {**status, "planGeneration": None}, new, "sm90/NVIDIA-H200", 3) == (new, [])
    # the same decisions (prose may differ): nothing pending
    same = new.model_copy(update={"reasons": ["reworded"]})
    assert day2.held_plan(s, {**status, "plan": same.model_dump(mode="json")}, new, "sm90/NVIDIA-H200", 3) == (new, [])


def test_one_inference_pool_spans_moedeployments_that_share_its_name(ckpt):
    shared = {"inferencePool": {"enabled": True, "poolName": "m"}}
    objs, _ = rendered(ckpt, gateway=shared)  # rendered() names the MoEDeployment "m": it owns the pool
    pool = objs["InferencePool"]
    assert pool["spec"]["selector"]["matchLabels"] == {day2.POOL_LABEL: "m"}
    assert objs["Deployment"]["spec"]["template"]["metadata"]["labels"][day2.POOL_LABEL] == "m"
    joined, _ = rendered(ckpt, gateway={"inferencePool": {"enabled": True, "poolName": "other"}})
    assert "InferencePool" not in joined  # it joins the pool another MoEDeployment renders
    assert joined["Deployment"]["spec"]["template"]["metadata"]["labels"][day2.POOL_LABEL] == "other"
    # workers of a LeaderWorkerSet serve no HTTP: not in the pool
    s = spec(gateway=shared, nodesPerReplica=2, parallelism={"tp": 16})
    assert day2.pool_pod_labels(s, "worker") == {} and day2.pool_pod_labels(s, "leader") == {day2.POOL_LABEL: "m"}
    plain, _ = rendered(ckpt)
    assert day2.POOL_LABEL not in plain["Deployment"]["spec"]["template"]["metadata"]["labels"]


def test_a_running_roll_keeps_the_numbers_it_started_with():
    live = {"metadata": {"generation": 2},
            "spec": {"replicas": 2, "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}},
            "status": {"observedGeneration": 2, "replicas": 3, "updatedReplicas": 1}}
    assert day2.running_roll(live) == (1, 0)
    # the surge pod took the spare GPU set: spare 0 now, but the roll keeps surging (no replica down)
    r = day2.rollout_policy(spec(), "sm90/X", 0, running=day2.running_roll(live))
    assert (r.max_surge, r.max_unavailable, r.kept) == (1, 0, True) and r.progress_reason() == "RollingOut"
    done = {**live, "status": {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2}}
    assert day2.running_roll(done) is None
    r = day2.rollout_policy(spec(), "sm90/X", 0, running=day2.running_roll(done))
    assert (r.max_surge, r.max_unavailable) == (0, 1) and r.progress_reason() == "RollingOneAtATime"
    # explicit numbers always win, and an explicit surge on a full class says it waits
    r = day2.rollout_policy(spec(rollout={"maxSurge": 1, "maxUnavailable": 0}), "sm90/X", 0, running=(0, 1))
    assert not r.kept and r.progress_reason() == "WaitingForCapacity"
    lws = {"metadata": {"generation": 3}, "spec": {"replicas": 2, "rolloutStrategy": {
        "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1}}}, "status": {"observedGeneration": 2}}
    assert day2.running_roll(lws) == (0, 1)
    # a kept one-at-a-time roll stays so while replaced pods free their GPUs
    r = day2.rollout_policy(spec(), "sm90/X", 1, running=(0, 1))
    assert r.kept and r.progress_reason() == "RollingOneAtATime"


def test_roll_numbers_change_when_a_roll_starts_not_between(ckpt):
    objs, _ = rendered(ckpt, used={"h200-0": 8, "h200-1": 8}, replicas=2)  # full: 0/1
    live = {"spec": {"strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "template": objs["Deployment"]["spec"]["template"]}}
    dep = objs["Deployment"]
    assert day2.hold_strategy(dep, live, spec(replicas=2))  # same pods: the live numbers stay
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    objs, _ = rendered(ckpt, used={"h200-0": 8, "h200-1": 8}, replicas=2, env=[{"name": "X", "value": "1"}])
    dep = objs["Deployment"]
    assert not day2.hold_strategy(dep, live, spec(replicas=2))  # new pods: a roll starts with today's numbers
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    objs, _ = rendered(ckpt, replicas=2, rollout={"maxSurge": 0})
    dep = objs["Deployment"]
    live["spec"]["template"] = dep["spec"]["template"]
    day2.hold_strategy(dep, live, spec(replicas=2, rollout={"maxSurge": 0}))
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # an explicit value always wins
    assert not day2.hold_strategy(objs["Deployment"], None, spec())
