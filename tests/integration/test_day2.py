"""Day-2 operations (issue 22) through the real API server, controller manager and scheduler:
kubectl scale, an HPA reading the scale subresource, rollouts on a full GPU class, the disruption
budget, KEDA and InferencePool objects validated by their released CRDs.

The operator runs with the chart's ServiceAccount and RBAC (the `operator` fixture), so every call
the day-2 objects need is granted by the chart or the module fails.
"""

from __future__ import annotations

import json

import pytest
import yaml

from .operator_fixture import SAMPLES, condition, get_json, wait_for

pytestmark = pytest.mark.integration


def sample(namespace: str, file: str, name: str, **spec) -> dict:
    doc = yaml.safe_load((SAMPLES / file).read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"].update(spec)
    return doc


def apply(kubectl, doc) -> None:
    r = kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
    assert r.returncode == 0, f"kubectl apply {doc['metadata']['name']}: {r.stderr}"


def moed(kubectl, ns, name):
    return get_json(kubectl, "moed", name, "-n", ns)


def wait_cond(kubectl, ns, name, type_, status, reason=None, timeout=60, log=None):
    def ok():
        c = condition(moed(kubectl, ns, name), type_)
        return c if c and c["status"] == status and (reason is None or c["reason"] == reason) else None
    return wait_for(ok, timeout, f"{ns}/{name} {type_}={status} {reason or ''}", log)


def deployment(kubectl, ns, name):
    return get_json(kubectl, "deployment", name, "-n", ns)


def test_kubectl_scale_scales_the_workload_and_the_budget_follows(kubectl, namespace, operator):
    apply(kubectl, sample(namespace, "deepseek-v4-fp4-h200.yaml", "scaled", replicas=1))
    wait_for(lambda: (deployment(kubectl, namespace, "scaled") or {}).get("spec", {}).get("replicas") == 1, 60,
             "Deployment with 1 replica", operator.log_tail)
    obj = wait_for(lambda: (o := moed(kubectl, namespace, "scaled")) and o.get("status", {}).get("selector") and o,
                   30, "status.selector", operator.log_tail)
    sel = obj["status"]["selector"]
    assert sel == "app.kubernetes.io/instance=scaled,moe.serving.dev/deployment=scaled,moe.serving.dev/role=single"
    assert get_json(kubectl, "pdb", "scaled", "-n", namespace) is None  # one replica: no budget

    kubectl("scale", "moed", "scaled", "-n", namespace, "--replicas", "2")
    dep = wait_for(lambda: (d := deployment(kubectl, namespace, "scaled")) and d["spec"]["replicas"] == 2 and d,
                   60, "Deployment scaled to 2", operator.log_tail)
    # the scale subresource reads what the operator reports
    scale = json.loads(kubectl("get", "--raw", f"/apis/moe.serving.dev/v1alpha1/namespaces/{namespace}"
                               "/moedeployments/scaled/scale").stdout)
    assert scale["spec"]["replicas"] == 2
    wait_for(lambda: json.loads(kubectl("get", "--raw", f"/apis/moe.serving.dev/v1alpha1/namespaces/{namespace}"
                                        "/moedeployments/scaled/scale").stdout)["status"].get("replicas") == 2,
             30, "scale status.replicas 2", operator.log_tail)
    assert scale["status"]["selector"] == sel
    pods = get_json(kubectl, "pods", "-n", namespace, "-l", sel)["items"]
    assert pods and all(p["metadata"]["labels"]["moe.serving.dev/deployment"] == "scaled" for p in pods)
    assert {r["name"] for r in dep["metadata"]["ownerReferences"]} == {"scaled"}

    pdb = wait_for(lambda: get_json(kubectl, "pdb", "scaled", "-n", namespace), 30, "PodDisruptionBudget",
                   operator.log_tail)
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert pdb["metadata"]["ownerReferences"][0]["kind"] == "MoEDeployment"

    kubectl("scale", "moed", "scaled", "-n", namespace, "--replicas", "1")
    wait_for(lambda: deployment(kubectl, namespace, "scaled")["spec"]["replicas"] == 1, 60, "Deployment back to 1",
             operator.log_tail)
    wait_for(lambda: get_json(kubectl, "pdb", "scaled", "-n", namespace) is None, 30, "budget pruned at 1 replica",
             operator.log_tail)


def test_hpa_targeting_the_moedeployment_reads_and_writes_its_scale(kubectl, namespace, operator):
    """The real HPA controller (kube-controller-manager) resolves the MoEDeployment's scale
    subresource and enforces minReplicas; no metrics adapter runs locally, so it says the metric
    is unavailable, and scales on nothing else."""
    apply(kubectl, sample(namespace, "deepseek-v4-fp4-h200.yaml", "autoscaled", replicas=1,
                          autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 3}))
    hpa = wait_for(lambda: get_json(kubectl, "hpa", "autoscaled", "-n", namespace), 60, "HPA rendered",
                   operator.log_tail)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
                                             "name": "autoscaled"}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "sglang_num_queue_reqs"

    # the HPA controller scales the MoEDeployment to minReplicas; the operator follows with the Deployment
    wait_for(lambda: moed(kubectl, namespace, "autoscaled")["spec"]["replicas"] == 2, 180,
             "HPA raised spec.replicas to minReplicas", operator.log_tail)
    wait_for(lambda: deployment(kubectl, namespace, "autoscaled")["spec"]["replicas"] == 2, 60,
             "Deployment follows the HPA", operator.log_tail)

    def able_to_scale():
        h = get_json(kubectl, "hpa", "autoscaled", "-n", namespace)
        c = next((c for c in (h.get("status") or {}).get("conditions") or [] if c["type"] == "AbleToScale"), None)
        return h if c and c["status"] == "True" and h["status"].get("currentReplicas") == 2 else None
    h = wait_for(able_to_scale, 90, "HPA AbleToScale with 2 current replicas", operator.log_tail)
    assert h["status"]["desiredReplicas"] == 2

    # autoscaling off: the operator prunes its HPA
    kubectl("patch", "moed", "autoscaled", "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"autoscaling": {"enabled": False}}}))
    wait_for(lambda: get_json(kubectl, "hpa", "autoscaled", "-n", namespace) is None, 30, "HPA pruned",
             operator.log_tail)


def test_autoscaling_rules_at_admission(kubectl, namespace, crd):
    base = sample(namespace, "deepseek-v4-fp4-h200.yaml", "refused")
    for autoscaling, message in [
        ({"enabled": True, "minReplicas": 0}, "scale to zero"),
        ({"enabled": True, "minReplicas": 5, "maxReplicas": 2}, "must not exceed"),
        ({"enabled": True, "provider": "keda"}, "set autoscaling.prometheusAddress"),
    ]:
        r = kubectl("apply", "-f", "-", input=json.dumps({**base, "spec": {**base["spec"], "autoscaling": autoscaling}}),
                    check=False)
        assert r.returncode != 0 and message in r.stderr, (autoscaling, r.stderr)
    r = kubectl("apply", "-f", "-", check=False, input=json.dumps(
        {**base, "spec": {**base["spec"], "rollout": {"maxSurge": 0, "maxUnavailable": 0}}}))
    assert r.returncode != 0 and "must not both be 0" in r.stderr, r.stderr


def test_plan_change_on_a_full_class_rolls_one_replica_at_a_time(kubectl, namespace, operator):
    """Both B200 nodes taken by this MoEDeployment: a surge pod could never schedule, so the
    change replaces one replica at a time and Progressing says so; asked to surge anyway, the
    roll waits and Progressing says for what."""
    name = "full"
    doc = sample(namespace, "deepseek-v4-fp4-b200.yaml", name, replicas=2)
    apply(kubectl, doc)

    def all_ready(gen_hash=None):
        d = deployment(kubectl, namespace, name)
        st = (d or {}).get("status") or {}
        ok = d and st.get("readyReplicas") == 2 and st.get("updatedReplicas") == 2 and st.get("replicas") == 2 \
            and st.get("observedGeneration") == d["metadata"]["generation"]
        return d if ok else None
    dep = wait_for(all_ready, 120, "2 ready replicas on the B200 nodes", operator.log_tail)
    # with every B200 GPU taken, the next roll replaces one replica at a time; the numbers are
    # rendered when a roll starts (between rolls the workload is left as it is)
    def next_roll():
        c = condition(moed(kubectl, namespace, name), "Progressing")
        return c if c and c["reason"] == "Complete" and "no free capacity of class sm100/NVIDIA-B200: rolling one " \
            "replica at a time" in c["message"] else None
    wait_for(next_roll, 60, "Progressing: the next roll goes one replica at a time", operator.log_tail)
    old_hash = dep["spec"]["template"]["metadata"]["annotations"]["moe.serving.dev/inputs-hash"]

    # a change of the pods (their CPU request) rolls every pod, though no GPU is free
    kubectl("patch", "moed", name, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"resources": {"requests": {"cpu": "2"}}}}))
    seen = set()

    def rolled():
        o = moed(kubectl, namespace, name)
        if (c := condition(o, "Progressing")) and c["status"] == "True":
            seen.add((c["reason"], c["message"].split("; ", 1)[-1]))
        d = all_ready()
        h = d and d["spec"]["template"]["metadata"]["annotations"]["moe.serving.dev/inputs-hash"]
        return d if d and h != old_hash else None
    wait_for(rolled, 180, "the roll to finish on the full class", operator.log_tail)
    pods = get_json(kubectl, "pods", "-n", namespace, "-l", f"moe.serving.dev/deployment={name}")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    assert len(live) == 2 and all(p["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "2"
                                  for p in live), [p["metadata"]["name"] for p in live]
    # whatever Progressing said during the roll, it was the one-at-a-time policy (the reason is
    # RollingOneAtATime while pods of the old template remain, RollingOut for the last pod's start)
    assert all("maxSurge 0, maxUnavailable 1" in m for _, m in seen), seen
    assert all(r in ("RollingOneAtATime", "RollingOut") for r, _ in seen), seen
    assert deployment(kubectl, namespace, name)["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0,
                                                                                   "maxUnavailable": 1}

    # told to surge on a full class: the roll waits, and Progressing says for what
    kubectl("patch", "moed", name, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"rollout": {"maxSurge": 1, "maxUnavailable": 0},
                                 "resources": {"requests": {"cpu": "3"}}}}))
    c = wait_cond(kubectl, namespace, name, "Progressing", "True", "WaitingForCapacity", timeout=90,
                  log=operator.log_tail)
    assert "no free capacity of class sm100/NVIDIA-B200: a surge replica waits for a free GPU set" in c["message"], c
    assert condition(moed(kubectl, namespace, name), "Available")["status"] == "True"  # the old pods still serve


@pytest.fixture(scope="module")
def optional_crds_state(kubectl):
    return {k: kubectl("get", "crd", v.name, check=False).returncode == 0
            for k, v in __import__("moe_operator.optional_crds", fromlist=["ALL"]).ALL.items()}


def test_inference_pool_selects_exactly_its_pods_and_a_missing_crd_is_a_condition(kubectl, namespace, operator,
                                                                                   optional_crds_state):
    from moe_operator import optional_crds

    pool_spec = {"gateway": {"inferencePool": {"enabled": True}}}
    apply(kubectl, sample(namespace, "gpt-oss-mxfp4-h100.yaml", "pooled", replicas=2, **pool_spec))
    apply(kubectl, sample(namespace, "gpt-oss-mxfp4-h100.yaml", "pooled-other", replicas=1))
    if not optional_crds_state["inferencepool"]:
        c = wait_cond(kubectl, namespace, "pooled", "Degraded", "True", "InferencePoolCrdMissing",
                      log=operator.log_tail)
        assert "Gateway API Inference Extension" in c["message"]
        # the workload does not wait for the optional object
        wait_for(lambda: deployment(kubectl, namespace, "pooled"), 30, "Deployment despite the missing CRD")
        optional_crds.install(kubectl, optional_crds.INFERENCE_POOL)
    pool = wait_for(lambda: get_json(kubectl, "inferencepools.inference.networking.k8s.io", "pooled", "-n", namespace),
                    90, "InferencePool", operator.log_tail)
    wait_cond(kubectl, namespace, "pooled", "Degraded", "False", "Applied", log=operator.log_tail)
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "pooled-epp"
    sel = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())

    def both_running():
        pods = get_json(kubectl, "pods", "-n", namespace, "-l", "moe.serving.dev/deployment")["items"]  # not the picker's
        return pods if len([p for p in pods if p["status"].get("phase") == "Running"]) == 3 else None
    every = wait_for(both_running, 90, "3 pods of two MoEDeployments", operator.log_tail)
    selected = {p["metadata"]["name"] for p in get_json(kubectl, "pods", "-n", namespace, "-l", sel)["items"]}
    mine = {p["metadata"]["name"] for p in every if p["metadata"]["labels"]["moe.serving.dev/deployment"] == "pooled"}
    assert selected == mine and len(mine) == 2, (selected, mine)

    # the InferencePool goes when the spec stops asking for it
    kubectl("patch", "moed", "pooled", "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"gateway": {"inferencePool": {"enabled": False}}}}))
    wait_for(lambda: get_json(kubectl, "inferencepools.inference.networking.k8s.io", "pooled", "-n", namespace) is None,
             30, "InferencePool pruned", operator.log_tail)


def test_keda_scaled_object_is_accepted_by_its_crd(kubectl, namespace, operator, optional_crds_state):
    from moe_operator import optional_crds

    spec = {"autoscaling": {"enabled": True, "provider": "keda", "minReplicas": 0, "maxReplicas": 2, "metric": "kv",
                            "prometheusAddress": "http://prometheus.monitoring:9090"}}
    apply(kubectl, sample(namespace, "gpt-oss-mxfp4-h100.yaml", "keda", replicas=1, **spec))
    if not optional_crds_state["keda"]:
        c = wait_cond(kubectl, namespace, "keda", "Degraded", "True", "KedaMissing", log=operator.log_tail)
        assert "install KEDA" in c["message"]
        optional_crds.install(kubectl, optional_crds.KEDA)
    so = wait_for(lambda: get_json(kubectl, "scaledobjects.keda.sh", "keda", "-n", namespace), 90, "ScaledObject",
                  operator.log_tail)
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["scaleTargetRef"]["kind"] == "MoEDeployment"
    t = so["spec"]["triggers"][0]
    assert t["type"] == "prometheus" and t["metadata"]["threshold"] == "0.8"
    assert "sglang:token_usage" in t["metadata"]["query"]
    wait_cond(kubectl, namespace, "keda", "Degraded", "False", "Applied", log=operator.log_tail)


def test_multi_node_rollout_settings_are_accepted_by_the_leaderworkerset_crd(kubectl, namespace, operator):
    """No LWS controller runs locally: the LWS CRD validates the rolloutStrategy the operator renders."""
    apply(kubectl, sample(namespace, "deepseek-v3-fp8-multinode.yaml", "multi", replicas=2))
    lws = wait_for(lambda: get_json(kubectl, "leaderworkersets.leaderworkerset.x-k8s.io", "multi", "-n", namespace),
                   60, "LeaderWorkerSet", operator.log_tail)
    assert lws["spec"]["rolloutStrategy"]["type"] == "RollingUpdate"
    cfg = lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
    assert cfg["maxSurge"] + cfg["maxUnavailable"] >= 1
    pdb = wait_for(lambda: get_json(kubectl, "pdb", "multi", "-n", namespace), 30, "PodDisruptionBudget",
                   operator.log_tail)
    assert pdb["spec"]["maxUnavailable"] == 1  # one pod down = one group down; the next must wait
    st = moed(kubectl, namespace, "multi")["status"]
    assert st["selector"].endswith("moe.serving.dev/role=leader")


def test_plan_policy_pin_holds_a_plan_the_spec_did_not_cause(kubectl, namespace, operator):
    """An upgraded operator finds in status the plan the previous one made (simulated by writing
    it there: the same plan with one more engine flag); under pin the pods keep it, status shows
    the diff, and a spec change accepts the new plan."""
    name = "pinned"
    apply(kubectl, sample(namespace, "deepseek-v4-fp4-h200.yaml", name, replicas=0))
    obj = wait_for(lambda: (o := moed(kubectl, namespace, name)) and o.get("status", {}).get("planGeneration")
                   == o["metadata"]["generation"] and o, 60, "plan made for this generation", operator.log_tail)
    assert condition(obj, "PlanPending")["status"] == "False"
    current_args = obj["status"]["plan"]["args"]
    older = [*current_args, "--enable-older-rule"]
    wait_for(lambda: deployment(kubectl, namespace, name), 30, "Deployment", operator.log_tail)

    def held():
        # a reconcile already running when the status is written may write its own plan over it:
        # write it again until the operator has read it (an upgraded operator finds it in place)
        o = moed(kubectl, namespace, name)
        c = condition(o, "PlanPending")
        if c and c["status"] == "True":
            return c
        if o["status"]["plan"]["args"] != older:
            kubectl("patch", "moed", name, "-n", namespace, "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"plan": {"args": older}}}))
        return None
    c = wait_for(held, 60, "PlanPending=True HeldByPlanPolicy", operator.log_tail)
    assert c["reason"] == "HeldByPlanPolicy"
    assert "--enable-older-rule" in c["message"]
    st = moed(kubectl, namespace, name)["status"]
    assert st["pendingPlan"]["diff"] == [f"args: {' '.join(older)} -> {' '.join(current_args)}"]
    assert st["plan"]["args"] == older  # status says what the pods run
    dep = wait_for(lambda: (d := deployment(kubectl, namespace, name))
                   and "--enable-older-rule" in d["spec"]["template"]["spec"]["containers"][0]["args"] and d,
                   30, "the workload keeps the held plan", operator.log_tail)
    assert dep["spec"]["replicas"] == 0

    # the user accepts: any spec change (here the policy itself) applies the new plan
    kubectl("patch", "moed", name, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": {"planPolicy": "follow"}}))
    wait_cond(kubectl, namespace, name, "PlanPending", "False", "UpToDate", log=operator.log_tail)
    wait_for(lambda: "--enable-older-rule" not in deployment(kubectl, namespace, name)["spec"]["template"]["spec"]
             ["containers"][0]["args"], 30, "the new plan rolled out", operator.log_tail)
    st = moed(kubectl, namespace, name)["status"]
    assert "pendingPlan" not in st and st["plan"]["args"] == current_args


def test_one_inference_pool_spans_two_moedeployments_on_different_gpu_classes(kubectl, namespace, operator):
    from moe_operator import optional_crds

    if kubectl("get", "crd", optional_crds.INFERENCE_POOL.name, check=False).returncode != 0:
        optional_crds.install(kubectl, optional_crds.INFERENCE_POOL)
    shared = {"gateway": {"inferencePool": {"enabled": True, "poolName": "fleet"}}}
    apply(kubectl, sample(namespace, "gpt-oss-mxfp4-h100.yaml", "fleet", replicas=1, **shared))
    apply(kubectl, sample(namespace, "gpt-oss-mxfp4-h100.yaml", "fleet-h200", replicas=1, **shared,
                          gpu={"allowedArchitectures": ["sm90"], "product": "NVIDIA-H200"}))
    apply(kubectl, sample(namespace, "gpt-oss-mxfp4-h100.yaml", "outsider", replicas=1))
    pool = wait_for(lambda: get_json(kubectl, "inferencepools.inference.networking.k8s.io", "fleet", "-n", namespace),
                    60, "InferencePool fleet", operator.log_tail)
    assert get_json(kubectl, "inferencepools.inference.networking.k8s.io", "fleet-h200", "-n", namespace) is None
    sel = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())

    def three_running():
        pods = [p for p in get_json(kubectl, "pods", "-n", namespace, "-l", "moe.serving.dev/deployment")["items"]
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
        return pods if len(pods) == 3 else None
    pods = wait_for(three_running, 90, "3 running pods", operator.log_tail)
    selected = {p["metadata"]["labels"]["moe.serving.dev/deployment"]
                for p in get_json(kubectl, "pods", "-n", namespace, "-l", sel)["items"]}
    assert selected == {"fleet", "fleet-h200"}, selected
    products = {p["metadata"]["labels"]["moe.serving.dev/deployment"]: p["spec"]["nodeName"] for p in pods}
    assert products["fleet"] != products["fleet-h200"]
    classes = {moed(kubectl, namespace, n)["status"]["gpuClass"] for n in ("fleet", "fleet-h200")}
    assert classes == {"sm90/NVIDIA-H100-80GB-HBM3", "sm90/NVIDIA-H200"}, classes


def test_chart_pod_monitor_is_valid_and_selects_the_serving_pods(dev_cluster, kubectl, namespace, operator):
    from moe_operator import optional_crds

    from .operator_fixture import ROOT

    optional_crds.install(kubectl, optional_crds.POD_MONITOR)
    rendered = dev_cluster.helm("template", "moe-pm", str(ROOT / "charts" / "moe-operator"), "-n", namespace,
                                "--show-only", "templates/podmonitor.yaml", "--set", "podMonitor.enabled=true").stdout
    kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)  # the released CRD validates it
    import yaml as _yaml
    pm = _yaml.safe_load(rendered)
    sel = pm["spec"]["selector"]
    selector = ",".join([f"{k}={v}" for k, v in sel["matchLabels"].items()]
                        + [f"{e['key']} notin ({','.join(e['values'])})" for e in sel["matchExpressions"]])
    apply(kubectl, sample(namespace, "gpt-oss-mxfp4-h100.yaml", "scraped", replicas=1))
    pods = wait_for(lambda: get_json(kubectl, "pods", "-n", namespace, "-l", selector)["items"], 60,
                    "the PodMonitor's selector finds the inference pod", operator.log_tail)
    assert {p["metadata"]["labels"]["moe.serving.dev/deployment"] for p in pods} == {"scraped"}
    port = {p["name"]: p["containerPort"] for p in pods[0]["spec"]["containers"][0]["ports"]}
    assert "http" in port  # podMetricsEndpoints[].port names this port
