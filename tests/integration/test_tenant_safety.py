"""A tenant who may only create MoEDeployments, and a fault injector, against the real control plane.

What a tenant must not get through a MoEDeployment: a host path the admin did not allow, a pod as
root with a service-account token, another Secret of the namespace, dangerous env. What the
operator must survive: drift of its objects, GPU nodes losing their labels, kill -9 mid-burst.
The operator runs with the chart's ServiceAccount and RBAC (the `operator` fixture).
"""

from __future__ import annotations

import json
import signal
import time

import pytest
import yaml

from .operator_fixture import SAMPLES, condition, get_json, wait_for

pytestmark = pytest.mark.integration


def moed(namespace: str, name: str, **spec) -> dict:
    return {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def sample(namespace: str, file: str, name: str | None = None) -> dict:
    doc = yaml.safe_load((SAMPLES / file).read_text())
    doc["metadata"] = {"name": name or doc["metadata"]["name"], "namespace": namespace}
    return doc


def apply(kubectl, doc, check=True):
    r = kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
    assert not check or r.returncode == 0, f"kubectl apply {doc['metadata']['name']}: {r.stderr}"
    return r


def planned_condition(kubectl, ns, name, status, reason=None, timeout=30, log=None):
    def ok():
        c = condition(get_json(kubectl, "moed", name, "-n", ns), "Planned")
        return c if c and c["status"] == status and (reason is None or c["reason"] == reason) else None
    return wait_for(ok, timeout, f"{ns}/{name} Planned={status} {reason or ''}", log)


def events_of(kubectl, ns, name) -> list[dict]:
    return get_json(kubectl, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]


def wait_event(kubectl, ns, name, reason, timeout=15, log=None) -> dict:
    """The Event is posted right after the status write: wait for it rather than race it."""
    return wait_for(lambda: next((e for e in events_of(kubectl, ns, name) if e["reason"] == reason), None), timeout,
                    f"Event {reason} on {ns}/{name}", log)


# ------------------------------------------------------------------------------- admission (CEL)
@pytest.mark.parametrize("name,spec,message", [
    ("dotdot", {"model": {"uri": "file:///models/../var/lib/kubelet"}}, "must not contain '.' or '..' path segments"),
    ("pvcdotdot", {"model": {"uri": "pvc://models/a/../../b"}}, "must not contain '.' or '..' path segments"),
    ("dashrev", {"model": {"uri": "hf://org/name@--upload-file"}}, "spec.model.uri"),
    ("preload", {"model": {"uri": "hf://org/name"}, "env": [{"name": "LD_PRELOAD", "value": "/x.so"}]}, "env name is reserved"),
    ("allgpus", {"model": {"uri": "hf://org/name"}, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
     "env name is reserved"),
    ("tokenenv", {"model": {"uri": "hf://org/name", "tokenSecretRef": {"name": "hf"}},
                  "env": [{"name": "HF_TOKEN", "value": "x"}]}, "collides with model.tokenSecretRef"),
    ("bigenv", {"model": {"uri": "hf://org/name"},
                "env": [{"name": f"E{i}", "value": "x" * 30000} for i in range(3)]}, "must stay under 65536 bytes"),
    ("badqty", {"model": {"uri": "hf://org/name"}, "resources": {"limits": {"memory": "lots"}}}, "spec.resources.limits.memory"),
    ("badsel", {"model": {"uri": "hf://org/name"}, "nodeSelector": {"zone": "not a label value!"}}, "spec.nodeSelector.zone"),
    # issue 27: env that loads code, chooses a cache mount, or sends the token elsewhere
    ("pypath", {"model": {"uri": "hf://org/name"}, "env": [{"name": "PYTHONPATH", "value": "/models/x"}]},
     "loads code into the engine"),
    ("pyuser", {"model": {"uri": "hf://org/name"}, "env": [{"name": "PYTHONUSERBASE", "value": "/models/x"}]},
     "loads code into the engine"),
    ("path", {"model": {"uri": "hf://org/name"}, "env": [{"name": "PATH", "value": "/models/x"}]}, "loads code"),
    ("cachedir", {"model": {"uri": "hf://org/name"}, "env": [{"name": "SGLANG_CACHE_DIR", "value": "/usr/lib"}]},
     "mounted by the operator at fixed paths"),
    ("endpoint", {"model": {"uri": "hf://org/name"}, "env": [{"name": "HF_ENDPOINT", "value": "http://attacker"}]},
     "the operator sets it"),
    ("offline", {"model": {"uri": "hf://org/name"}, "env": [{"name": "HF_HUB_OFFLINE", "value": "0"}]}, "the operator sets it"),
    ("rev", {"model": {"uri": "hf://org/name"}, "env": [{"name": "HF_REVISION", "value": "main"}]}, "the operator sets it"),
    ("proxy", {"model": {"uri": "hf://org/name", "tokenSecretRef": {"name": "hf"}},
               "env": [{"name": "https_proxy", "value": "http://attacker:3128"}]}, "refused beside model.tokenSecretRef"),
    ("cabundle", {"model": {"uri": "hf://org/name", "tokenSecretRef": {"name": "hf"}},
                  "env": [{"name": "SSL_CERT_FILE", "value": "/models/ca.pem"}]}, "refused beside model.tokenSecretRef"),
    ("inject", {"model": {"uri": "pvc://models/x';touch /tmp/p;'"}}, "spec.model.uri"),
    ("tolsec", {"model": {"uri": "hf://org/name"}, "tolerations": [{"key": "a", "operator": "Exists",
                                                                     "effect": "NoSchedule", "tolerationSeconds": 5}]},
     "tolerationSeconds applies only to effect NoExecute"),
    ("imgspace", {"model": {"uri": "hf://org/name"}, "engine": {"name": "sglang", "image": "lmsysorg/sglang:v0.5 "}},
     "spec.engine.image"),
    ("imgat", {"model": {"uri": "hf://org/name"}, "engine": {"name": "sglang", "image": "ghcr.io/moe-operator@evil.example/x"}},
     "spec.engine.image"),
    ("a" * 60, {"model": {"uri": "hf://org/name"}}, "metadata.name must be at most 52 characters"),
    ("l" * 51, {"model": {"uri": "hf://org/name"}, "engine": {"name": "sglang"}, "nodesPerReplica": 2, "replicas": 1},
     "too long for a multi-node MoEDeployment"),
    ("l" * 50, {"model": {"uri": "hf://org/name"}, "engine": {"name": "sglang"}, "nodesPerReplica": 2, "replicas": 11},
     "too long for a multi-node MoEDeployment"),
    ("1starts-with-digit", {"model": {"uri": "hf://org/name"}}, "metadata.name must be a DNS-1035 label"),
])
def test_hostile_specs_are_refused_by_the_api_server(kubectl, namespace, crd, name, spec, message):
    r = apply(kubectl, moed(namespace, name, **spec), check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr


# ------------------------------------------------------------------------------- policy
def test_host_path_outside_the_allowed_ones_is_refused_and_mounts_nothing(kubectl, namespace, operator):
    apply(kubectl, moed(namespace, "kubelet", model={"uri": "file:///var/lib/kubelet"}))
    c = planned_condition(kubectl, namespace, "kubelet", "False", "PolicyViolation", log=operator.log_tail)
    assert "not under an allowed host path" in c["message"]
    wait_event(kubectl, namespace, "kubelet", "PolicyViolation", log=operator.log_tail)
    time.sleep(3)
    assert get_json(kubectl, "deployment", "kubelet", "-n", namespace) is None
    assert not get_json(kubectl, "jobs", "-n", namespace)["items"], "no inspection Job may mount the path either"


def test_a_load_balancer_needs_the_admin(kubectl, namespace, operator):
    """policy.allowedServiceTypes defaults to ClusterIP: a tenant cannot expose a model outside the cluster."""
    doc = sample(namespace, "deepseek-v3-nvfp4-b200.yaml", "exposed")
    doc["spec"]["service"] = {"type": "LoadBalancer"}
    apply(kubectl, doc)
    c = planned_condition(kubectl, namespace, "exposed", "False", "PolicyViolation", log=operator.log_tail)
    assert "service.type LoadBalancer is not allowed" in c["message"]
    time.sleep(2)
    assert get_json(kubectl, "service", "exposed", "-n", namespace) is None


def test_rendered_pods_run_without_root_token_or_privileges(kubectl, namespace, operator):
    doc = sample(namespace, "deepseek-v3-nvfp4-b200.yaml", "locked")
    doc["spec"]["engine"] = {"name": "bundled"}   # the runtime image: non-root
    doc["spec"]["parallelism"] = {"tp": 1}
    apply(kubectl, doc)
    name = doc["metadata"]["name"]
    planned_condition(kubectl, namespace, name, "True", log=operator.log_tail)
    dep = wait_for(lambda: get_json(kubectl, "deployment", name, "-n", namespace), 30, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"] and not sc["privileged"]
    assert not [v for v in pod["volumes"] if "hostPath" in v and not v["hostPath"]["path"].startswith("/models")]
    # the pods the API server made from it: no token volume, non-root
    pods = wait_for(lambda: get_json(kubectl, "pods", "-n", namespace, "-l", f"moe.serving.dev/deployment={name}")["items"],
                    30, "pods")
    for p in pods:
        assert not [v for v in p["spec"]["volumes"] if "projected" in v or v["name"].startswith("kube-api-access")]


def test_token_secret_must_be_marked_for_model_use(kubectl, namespace, operator):
    kubectl("-n", namespace, "create", "secret", "generic", "db-password", "--from-literal=token=hunter2")
    doc = sample(namespace, "deepseek-v3-nvfp4-b200.yaml", "tok")
    # an hf:// model (the token reaches the pod); format and a commit sha given, so the hub is not asked
    doc["spec"]["model"] = {"uri": "hf://nvidia/DeepSeek-V3-0324-FP4@" + "0" * 40, "format": "nvfp4",
                            "architecture": "DeepseekV3ForCausalLM", "tokenSecretRef": {"name": "db-password"}}
    apply(kubectl, doc)
    c = planned_condition(kubectl, namespace, "tok", "False", "PolicyViolation", log=operator.log_tail)
    assert "lacks the label moe.serving.dev/model-token=true" in c["message"]
    assert get_json(kubectl, "deployment", "tok", "-n", namespace) is None
    doc["spec"]["model"]["tokenSecretRef"] = {"name": "missing"}
    apply(kubectl, doc)
    c = wait_for(lambda: (c := condition(get_json(kubectl, "moed", "tok", "-n", namespace), "Planned"))
                 and "not found" in c["message"] and c, 30, "missing Secret reported")
    # the Secret's owner marks it: now it may be used
    kubectl("-n", namespace, "label", "secret", "db-password", "moe.serving.dev/model-token=true")
    doc["spec"]["model"]["tokenSecretRef"] = {"name": "db-password"}
    apply(kubectl, doc)
    planned_condition(kubectl, namespace, "tok", "True", log=operator.log_tail)
    dep = wait_for(lambda: get_json(kubectl, "deployment", "tok", "-n", namespace), 30, "Deployment")
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "token"}}} in env
    st = json.dumps(get_json(kubectl, "moed", "tok", "-n", namespace)["status"])
    assert "hunter2" not in st


def test_a_secret_that_loses_its_label_takes_the_token_out_of_the_workload(kubectl, namespace, operator):
    kubectl("-n", namespace, "create", "secret", "generic", "hf-tok", "--from-literal=token=t")
    kubectl("-n", namespace, "label", "secret", "hf-tok", "moe.serving.dev/model-token=true")
    doc = sample(namespace, "deepseek-v3-nvfp4-b200.yaml", "revoked")
    doc["spec"]["model"] = {"uri": "hf://nvidia/DeepSeek-V3-0324-FP4@" + "0" * 40, "format": "nvfp4",
                            "architecture": "DeepseekV3ForCausalLM", "tokenSecretRef": {"name": "hf-tok"}}
    doc["spec"]["replicas"] = 0
    apply(kubectl, doc)
    planned_condition(kubectl, namespace, "revoked", "True", log=operator.log_tail)

    def token_env():
        dep = get_json(kubectl, "deployment", "revoked", "-n", namespace)
        pod = dep["spec"]["template"]["spec"]
        return [e for c in pod["containers"] + pod.get("initContainers", []) for e in c.get("env") or []
                if (e.get("valueFrom") or {}).get("secretKeyRef", {}).get("name") == "hf-tok"]
    wait_for(token_env, 30, "the token in the Deployment", operator.log_tail)
    kubectl("-n", namespace, "label", "secret", "hf-tok", "moe.serving.dev/model-token-")
    wait_for(lambda: not token_env(), 30, "the token removed from the Deployment", operator.log_tail)
    e = wait_event(kubectl, namespace, "revoked", "TokenRevoked", log=operator.log_tail)
    assert "no longer labelled" in e["message"]
    time.sleep(5)  # stays out: the reconcile reports PolicyViolation and renders nothing
    assert not token_env()


# ------------------------------------------------------------------------------- drift
def test_drift_repair_removes_fields_the_operator_does_not_render(kubectl, namespace, operator):
    doc = sample(namespace, "deepseek-v3-nvfp4-b200.yaml", "whole")
    doc["spec"]["replicas"] = 0
    apply(kubectl, doc)
    planned_condition(kubectl, namespace, "whole", "True", log=operator.log_tail)
    wait_for(lambda: get_json(kubectl, "deployment", "whole", "-n", namespace), 30, "Deployment")
    patch = {"spec": {"template": {"spec": {"hostNetwork": True, "hostPID": True, "containers": [
        {"name": "engine", "lifecycle": {"postStart": {"exec": {"command": ["sh", "-c", "id"]}}}}]}}}}
    kubectl("-n", namespace, "patch", "deployment", "whole", "--type=strategic", "-p", json.dumps(patch))
    kubectl("-n", namespace, "patch", "service", "whole", "--type=merge", "-p",
            json.dumps({"spec": {"externalIPs": ["203.0.113.7"]}}))

    def clean():
        pod = get_json(kubectl, "deployment", "whole", "-n", namespace)["spec"]["template"]["spec"]
        svc = get_json(kubectl, "service", "whole", "-n", namespace)["spec"]
        return (not pod.get("hostNetwork") and not pod.get("hostPID") and "lifecycle" not in pod["containers"][0]
                and not svc.get("externalIPs"))
    wait_for(clean, 30, "hostNetwork, hostPID, postStart and externalIPs removed", operator.log_tail)
    # repaired once: no drift is seen again on the settled objects (what the API server defaults is not drift)
    time.sleep(6)
    before = operator.log_tail(400).count("drift on Deployment")
    time.sleep(6)
    assert operator.log_tail(400).count("drift on Deployment") == before, operator.log_tail(20)


def test_drift_is_repaired_field_by_field(kubectl, namespace, operator):
    doc = sample(namespace, "deepseek-v3-nvfp4-b200.yaml", "drift")
    doc["spec"]["replicas"] = 0   # no pods: the repaired template starts no roll whose progress status would show
    apply(kubectl, doc)
    planned_condition(kubectl, namespace, "drift", "True", log=operator.log_tail)
    dep = wait_for(lambda: get_json(kubectl, "deployment", "drift", "-n", namespace), 30, "Deployment")
    rendered_env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    # an env var added by hand (another field manager: server-side apply alone would keep it)
    kubectl("-n", namespace, "set", "env", "deployment/drift", "-c", "engine", "INJECTED=1")

    def env_back():
        env = get_json(kubectl, "deployment", "drift", "-n", namespace)["spec"]["template"]["spec"]["containers"][0]["env"]
        return env == rendered_env
    wait_for(env_back, 30, "the added env var to be removed", operator.log_tail)
    kubectl("-n", namespace, "delete", "service", "drift")
    kubectl("-n", namespace, "delete", "configmap", "drift-plan")
    wait_for(lambda: get_json(kubectl, "service", "drift", "-n", namespace)
             and get_json(kubectl, "configmap", "drift-plan", "-n", namespace), 30, "Service and ConfigMap back",
             operator.log_tail)
    # nothing changed since: a resync tick writes nothing (the Deployment's generation counts spec
    # writes; its resourceVersion also moves with the Deployment controller's status updates)
    time.sleep(4)   # let the controller settle the repaired Deployment's status
    gen = get_json(kubectl, "deployment", "drift", "-n", namespace)["metadata"]["generation"]
    before = get_json(kubectl, "moed", "drift", "-n", namespace)
    time.sleep(6)   # three resync ticks at MOE_RESYNC_SECONDS=2
    assert get_json(kubectl, "deployment", "drift", "-n", namespace)["metadata"]["generation"] == gen
    after = get_json(kubectl, "moed", "drift", "-n", namespace)
    changed = {k: (before["status"].get(k), v) for k, v in after["status"].items() if before["status"].get(k) != v}
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], changed


# ------------------------------------------------------------------------------- inventory
def test_gpu_nodes_losing_their_labels_replan_every_object_with_an_event(dev_cluster, kubectl, namespace, operator):
    """Every affected object re-plans within 30 s, each with an Event (the sweep posts Events
    itself, so one object's Event does not stop the others)."""
    from moe_operator.devcluster.pools import POOL_LABEL

    names = [f"rtx-{i}" for i in range(4)]
    for n in names:
        doc = sample(namespace, "deepseek-v3-nvfp4-b200.yaml", n)
        doc["spec"]["gpu"] = {"allowedArchitectures": ["sm120"]}
        doc["spec"]["replicas"] = 0
        apply(kubectl, doc)
    for n in names:
        planned_condition(kubectl, namespace, n, "True", timeout=60, log=operator.log_tail)
    gfd = [k for k in get_json(kubectl, "nodes", "-l", f"{POOL_LABEL}=rtx-pro-6000")["items"][0]["metadata"]["labels"]
           if k.startswith("nvidia.com/")]
    try:
        t0 = time.monotonic()
        kubectl("label", "nodes", "-l", f"{POOL_LABEL}=rtx-pro-6000", *[f"{k}-" for k in gfd])
        for n in names:
            planned_condition(kubectl, namespace, n, "False", "NoFeasibleGpuClass", timeout=max(1, 30 - (time.monotonic() - t0)),
                              log=operator.log_tail)
        for n in names:
            wait_event(kubectl, namespace, n, "NoFeasibleGpuClass", log=operator.log_tail)
    finally:
        dev_cluster.remove_pool("rtx-pro-6000")
        dev_cluster.add_pool("rtx-pro-6000")


def test_kill_9_mid_burst_moves_no_workload(dev_cluster, kubectl, namespace, operator):
    """A burst of objects that fit two classes, the operator killed -9 while placing them, restarted:
    every workload stays on the class it was first applied with."""
    names = [f"burst-{i}" for i in range(12)]
    for n in names:
        doc = sample(namespace, "deepseek-v3-nvfp4-b200.yaml", n)
        doc["spec"]["parallelism"] = {"tp": 4}   # fits B200 (8 per node) and GB200 (4 per node)
        doc["spec"]["gpu"] = {"allowedArchitectures": ["sm100"]}   # B200 and GB200 (amd64 / arm64)
        apply(kubectl, doc)
    first: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while len(first) < 3 and time.monotonic() < deadline:   # kill once some, not all, are applied
        for n in names:
            d = get_json(kubectl, "deployment", n, "-n", namespace)
            if d and n not in first:
                first[n] = d["metadata"]["annotations"]["moe.serving.dev/gpu-class"]
        time.sleep(0.2)
    operator.proc.send_signal(signal.SIGKILL)
    operator.proc.wait()
    operator.start()
    for n in names:
        planned_condition(kubectl, namespace, n, "True", timeout=90, log=operator.log_tail)
    time.sleep(6)
    for n in names:
        d = get_json(kubectl, "deployment", n, "-n", namespace)
        cls = d["metadata"]["annotations"]["moe.serving.dev/gpu-class"]
        if n in first:
            assert cls == first[n], f"{n} moved from {first[n]} to {cls}"
        assert get_json(kubectl, "moed", n, "-n", namespace)["status"]["gpuClass"] == cls


# ------------------------------------------------------------------------------- webhook
def test_webhook_admits_deletes_and_writes_when_the_operator_is_gone(kubectl, kubeconfig, namespace, crd, tmp_path):
    """failurePolicy Ignore and CREATE/UPDATE only: after the operator dies (kill -9 leaves the
    configuration behind) deletes and writes still go through; it binds where it is told."""
    from .operator_fixture import start_webhook_operator

    op, port = start_webhook_operator(kubeconfig, tmp_path / "webhook.log")
    try:
        vwc = wait_for(lambda: get_json(kubectl, "validatingwebhookconfiguration", "validate.moe.serving.dev"), 30,
                       "managed ValidatingWebhookConfiguration", op.log_tail)
        hook = vwc["webhooks"][0]
        assert hook["failurePolicy"] == "Ignore"
        assert hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]

        def listening():
            r = __import__("subprocess").run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True)
            return r.stdout.strip() or None
        out = wait_for(listening, 30, "webhook listening")
        local = {ln.split()[3] for ln in out.splitlines()}   # State Recv-Q Send-Q Local Peer
        assert local == {f"127.0.0.1:{port}"}, out
        doc = moed(namespace, "outage", model={"uri": "file:///var/lib/kubelet"})
        r = apply(kubectl, doc, check=False)
        assert r.returncode != 0 and "not under an allowed host path" in r.stderr, r.stderr
        doc["spec"]["model"]["uri"] = "hf://org/name"
        apply(kubectl, doc)
        op.proc.send_signal(signal.SIGKILL)
        op.proc.wait()
        assert get_json(kubectl, "validatingwebhookconfiguration", "validate.moe.serving.dev")
        kubectl("-n", namespace, "delete", "moed", "outage", "--wait=false", "--timeout=20s")
        apply(kubectl, moed(namespace, "while-down", model={"uri": "hf://org/name"}))
    finally:
        op.stop()
        kubectl("delete", "validatingwebhookconfiguration", "validate.moe.serving.dev", "--ignore-not-found")


def test_webhook_admits_updates_that_leave_spec_unchanged(kubectl, kubeconfig, namespace, crd, tmp_path):
    """An object that violates policy (admitted before the webhook, or before the policy tightened)
    still takes label and annotation changes (kopf's own state annotations among them); a spec change
    that still violates the policy is refused."""
    from .operator_fixture import start_webhook_operator

    doc = moed(namespace, "old-violator", model={"uri": "file:///var/lib/kubelet"})
    apply(kubectl, doc)  # no webhook yet
    op, _ = start_webhook_operator(kubeconfig, tmp_path / "admission.log")
    try:
        wait_for(lambda: get_json(kubectl, "validatingwebhookconfiguration", "validate.moe.serving.dev"), 30,
                 "managed ValidatingWebhookConfiguration", op.log_tail)
        tries = iter(range(2, 1000))

        def refused():  # a new spec each try: before the webhook answers, the apply goes through
            doc["spec"]["replicas"] = next(tries)
            r = apply(kubectl, doc, check=False)
            return r.stderr if r.returncode != 0 and "denied the request" in r.stderr else None
        err = wait_for(refused, 30, "webhook refusal of the spec change", op.log_tail)
        assert "not under an allowed host path" in err
        kubectl("-n", namespace, "label", "moed", "old-violator", "team=a")
        kubectl("-n", namespace, "annotate", "moed", "old-violator", "kopf.zalando.org/last-handled-configuration={}",
                "--overwrite")
        got = get_json(kubectl, "moed", "old-violator", "-n", namespace)
        assert got["metadata"]["labels"]["team"] == "a"
        assert got["spec"]["replicas"] == doc["spec"]["replicas"] - 1  # the refused change did not land
    finally:
        op.stop()
        kubectl("delete", "validatingwebhookconfiguration", "validate.moe.serving.dev", "--ignore-not-found")
