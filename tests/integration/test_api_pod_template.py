"""spec.engine.args, spec.podTemplate and spec.model.servedName through the real kube-apiserver (issue 32
items 1 and 3): the CRD keeps what the user wrote, the operator merges it into the Deployment (pods
created on kwok nodes carry it) and into both templates of a LeaderWorkerSet (the released LWS CRD
accepts them), the live objects stay as rendered (no re-apply loop on API-server defaults), and the
webhook refuses what the operator owns, naming the field to use."""

from __future__ import annotations

import json
import time

import pytest

from .operator_fixture import condition, get_json, wait_for

pytestmark = pytest.mark.integration

TEMPLATE = {
    "metadata": {"labels": {"team": "search"}, "annotations": {"example.com/cost-center": "42"}},
    "spec": {
        "serviceAccountName": "inference",
        "imagePullSecrets": [{"name": "team-registry"}],
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": {"team": "search"}}}}]}},
        "volumes": [{"name": "extra", "configMap": {"name": "engine-extra"}}],
        "containers": [
            {"name": "engine", "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra", "readOnly": True}]},
            {"name": "proxy", "image": "ghcr.io/example/proxy:1.0", "args": ["--listen", ":9000"],
             "ports": [{"name": "proxy", "containerPort": 9000}], "resources": {"limits": {"memory": "64Mi"}}},
        ],
        "initContainers": [{"name": "warm", "image": "busybox:1.36", "command": ["true"]}],
    },
}


def doc(namespace, name, **spec):
    return {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def apply(kubectl, d) -> None:
    r = kubectl("apply", "-f", "-", input=json.dumps(d), check=False)
    assert r.returncode == 0, f"kubectl apply {d['metadata']['name']}: {r.stderr}"


def check_pod(ps: dict, meta: dict, served: str, args_tail: list[str] | None) -> None:
    assert meta["labels"]["team"] == "search" and meta["labels"]["moe.serving.dev/deployment"]
    assert meta["annotations"]["example.com/cost-center"] == "42" and meta["annotations"]["moe.serving.dev/inputs-hash"]
    assert ps["serviceAccountName"] == "inference"
    assert ps["imagePullSecrets"] == [{"name": "team-registry"}]
    assert ps["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert ps["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]  # the GPU class stays
    assert ps["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 10
    # (a Deployment's template gets defaultMode from the API server, a LeaderWorkerSet's, in a CRD, does not)
    assert [v["configMap"]["name"] for v in ps["volumes"] if v["name"] == "extra"] == ["engine-extra"]
    engine, proxy = ps["containers"]
    assert engine["name"] == "engine" and proxy["name"] == "proxy"
    assert {"name": "extra", "mountPath": "/etc/extra", "readOnly": True} in engine["volumeMounts"]
    a = engine["args"]
    assert a[a.index("--served-model-name") + 1] == served and a.count("--served-model-name") == 1
    if args_tail:
        assert a[-len(args_tail):] == args_tail
    assert proxy["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                        "capabilities": {"drop": ["ALL"]}}
    assert ps["initContainers"][-1]["name"] == "warm"


def test_args_pod_template_and_served_name_reach_the_deployment_and_its_pods(kubectl, namespace, operator):
    kubectl("create", "serviceaccount", "inference", "-n", namespace)
    name = "templated"
    args = ["--max-running-requests", "32", "--enable-metrics"]
    apply(kubectl, doc(namespace, name, model={"uri": "file:///models/deepseek-v3-fp8", "servedName": "deepseek/v3"},
                       engine={"name": "sglang", "args": args}, parallelism={"tp": 8},
                       gpu={"allowedArchitectures": ["sm90"], "product": "NVIDIA-H200"}, podTemplate=TEMPLATE))
    stored = get_json(kubectl, "moed", name, "-n", namespace)
    assert stored["spec"]["podTemplate"]["spec"]["containers"][1]["args"] == ["--listen", ":9000"]  # not pruned
    assert stored["spec"]["engine"]["args"] == args

    dep = wait_for(lambda: get_json(kubectl, "deployment", name, "-n", namespace), 60, "Deployment", operator.log_tail)
    check_pod(dep["spec"]["template"]["spec"], dep["spec"]["template"]["metadata"], "deepseek/v3", args)

    # kwok runs the pods: the API server admitted the merged spec (service account exists, names unique)
    sel = ",".join(f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())
    pod = wait_for(lambda: (p := get_json(kubectl, "pods", "-n", namespace, "-l", sel)) and p["items"] and p["items"][0],
                   60, "a pod", operator.log_tail)
    check_pod(pod["spec"], pod["metadata"], "deepseek/v3", args)

    # what the API server defaulted in the user's items is not drift: the operator stops applying
    gen = dep["metadata"]["generation"]
    wait_for(lambda: condition(get_json(kubectl, "moed", name, "-n", namespace), "Degraded"), 30, "Degraded condition",
             operator.log_tail)
    time.sleep(8)  # four 2-second resyncs
    after = get_json(kubectl, "deployment", name, "-n", namespace)
    assert after["metadata"]["generation"] == gen, "the operator keeps re-applying the Deployment"

    # a podTemplate change rolls the pods; removing it takes everything it added away again
    apply(kubectl, doc(namespace, name, model={"uri": "file:///models/deepseek-v3-fp8"}, engine={"name": "sglang"},
                       parallelism={"tp": 8}, gpu={"allowedArchitectures": ["sm90"], "product": "NVIDIA-H200"}))

    def plain():
        d = get_json(kubectl, "deployment", name, "-n", namespace)
        ps = d["spec"]["template"]["spec"]
        return d if len(ps["containers"]) == 1 and "team" not in d["spec"]["template"]["metadata"]["labels"] else None
    d = wait_for(plain, 60, "the overlay removed", operator.log_tail)
    ps = d["spec"]["template"]["spec"]
    assert ps.get("serviceAccountName") in (None, "default") and ps.get("serviceAccount") in (None, "default")
    assert not ps.get("imagePullSecrets")
    assert not any(v["name"] == "extra" for v in ps["volumes"]) and not ps.get("topologySpreadConstraints")
    a = ps["containers"][0]["args"]
    assert a[a.index("--served-model-name") + 1] == name and "--enable-metrics" not in a  # default: the object's name


def test_pod_template_reaches_both_templates_of_a_leaderworkerset(kubectl, namespace, operator):
    name = "templated-lws"
    apply(kubectl, doc(namespace, name, model={"uri": "file:///models/deepseek-v3-fp8"},
                       engine={"name": "bundled", "args": ["--max-batch", "16"]},
                       parallelism={"tp": 16, "ep": 16}, gpusPerReplica=16, nodesPerReplica=2,
                       gpu={"allowedArchitectures": ["sm90"], "product": "NVIDIA-H200"}, podTemplate=TEMPLATE))
    lws = wait_for(lambda: get_json(kubectl, "leaderworkersets.leaderworkerset.x-k8s.io", name, "-n", namespace),
                   60, "LeaderWorkerSet", operator.log_tail)
    tpl = lws["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        check_pod(tpl[role]["spec"], tpl[role]["metadata"], name, ["--max-batch", "16"])
        assert tpl[role]["metadata"]["labels"]["moe.serving.dev/role"] == role.removesuffix("Template")


REFUSED = [
    ({"engine": {"name": "sglang", "args": ["--tp-size", "4"]}}, "engine argument --tp-size is set by the operator for "
     "engine sglang: use spec.parallelism.tp"),
    ({"engine": {"name": "vllm", "args": ["--max_model_len=8192"]}, "moe": {"runnerBackend": "auto"}},
     "engine argument --max-model-len is set by the operator for engine vllm: use spec.engine.maxModelLen"),
    ({"podTemplate": {"spec": {"containers": [{"name": "engine", "image": "evil.example/x:1"}]}}},
     "podTemplate.spec.containers engine: image is the operator's: use spec.engine.image"),
    ({"podTemplate": {"spec": {"nodeSelector": {"a": "b"}}}},
     "podTemplate.spec.nodeSelector is the operator's: use spec.nodeSelector"),
    ({"podTemplate": {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}}, "hostPath volumes are refused"),
    ({"podTemplate": {"spec": {"containers": [{"name": "s", "image": "busybox:1", "securityContext": {"privileged": True}}]}}},
     "securityContext may set only"),
]


def test_the_webhook_refuses_what_the_operator_owns_naming_the_field(kubectl, kubeconfig, namespace, crd, tmp_path):
    from .operator_fixture import start_webhook_operator

    op, _ = start_webhook_operator(kubeconfig, tmp_path / "admission.log")
    try:
        wait_for(lambda: get_json(kubectl, "validatingwebhookconfiguration", "validate.moe.serving.dev"), 30,
                 "managed ValidatingWebhookConfiguration", op.log_tail)
        for spec, words in REFUSED:
            d = doc(namespace, "refused", model={"uri": "file:///models/deepseek-v3-fp8"},
                    **{"engine": {"name": "sglang"}, **spec})

            def answered():
                r = kubectl("apply", "-f", "-", input=json.dumps(d), check=False)
                return r if r.returncode != 0 and "denied" in r.stderr else None
            r = wait_for(answered, 30, "the webhook's refusal", op.log_tail)
            assert words in r.stderr, r.stderr
            assert get_json(kubectl, "moed", "refused", "-n", namespace) is None
    finally:
        op.stop()
        kubectl("delete", "validatingwebhookconfiguration", "validate.moe.serving.dev", "--ignore-not-found")


def test_status_names_the_endpoint_the_model_id_and_the_image(kubectl, namespace, operator):
    """status.endpoint / status.modelName / status.image (issue 32 item 3, issue 26 item 5), and the URL column."""
    name = "discoverable"
    apply(kubectl, doc(namespace, name, model={"uri": "file:///models/deepseek-v3-fp8", "servedName": "deepseek/v3"},
                       engine={"name": "sglang"}, parallelism={"tp": 8}, service={"port": 8080},
                       gpu={"allowedArchitectures": ["sm90"], "product": "NVIDIA-H200"}))
    obj = wait_for(lambda: (o := get_json(kubectl, "moed", name, "-n", namespace)) and o.get("status", {}).get("image") and o,
                   60, "status.image", operator.log_tail)
    st = obj["status"]
    assert st["endpoint"] == f"http://{name}.{namespace}.svc:8080/v1" and st["modelName"] == "deepseek/v3"
    dep = get_json(kubectl, "deployment", name, "-n", namespace)
    assert st["image"] == dep["spec"]["template"]["spec"]["containers"][0]["image"]
    wide = kubectl("get", "moed", name, "-n", namespace, "-o", "wide").stdout
    assert st["endpoint"] in wide, wide


def test_kubectl_explain_describes_every_spec_field(kubectl, crd):
    """`kubectl explain moed.spec` (issue 32 item 4) from the API server's published OpenAPI: every
    top-level spec field is listed with its description, and the escape hatches are explained."""
    from moe_operator.api import MoEDeploymentSpec

    def explain(path):
        return wait_for(lambda: (r := kubectl("explain", path, check=False)).returncode == 0 and r.stdout, 30,
                        f"kubectl explain {path}")
    out = explain("moed.spec")
    for name, field in MoEDeploymentSpec.model_fields.items():
        words = " ".join(field.description.split()[:4])
        assert name in out and words in " ".join(out.split()), (name, words)
    assert "refused with the field to use" in " ".join(explain("moed.spec.engine.args").split())
    assert "strategic" in " ".join(explain("moed.spec.podTemplate.spec").split())
    assert "--served-model-name" in explain("moed.spec.model.servedName")
