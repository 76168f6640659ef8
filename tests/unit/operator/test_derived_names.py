"""Every object name the operator derives from a MoEDeployment's name (issue 32 item 3) is valid for
every name the CRD admits: the API server refuses a longer name at admission (api.NAME_RULES, CEL
on metadata.name), so nothing is refused late. Checked at the longest admitted name: the objects
render() returns (workload, Service, plan ConfigMap, PDB, HPA or ScaledObject, InferencePool, the
endpoint picker's five), the names their controllers derive from them (ReplicaSets and pods of a
Deployment, the StatefulSets, pods and controller-revision-hash labels of a LeaderWorkerSet, KEDA's
HPA), every label value and selector, and the names that do not derive from it (model cache claim
and fill Job, inspection Job). The rules are Kubernetes' own (apimachinery pkg/util/validation):
DNS-1035 labels for Services, DNS-1123 subdomains for the rest, 63-character label values."""

from __future__ import annotations

import re

import pytest

from moe_core.checkpoint import inspect_dir
from moe_operator import day2, epp, inspect_job, model_cache
from moe_operator.api import NAME_MAX, NAME_RULES, MoEDeploymentSpec
from moe_operator.inventory import build, node_info
from moe_operator.placement import place
from moe_operator.render import Owner, render
from moe_operator.sample_checkpoints import write_sample

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
HASH = "a" * 10  # controller-revision-hash / pod-template-hash suffixes: at most 10 characters


def label(v: str) -> bool:
    return len(v) <= 63 and bool(DNS1123_LABEL.match(v))


def dns1035(v: str) -> bool:
    return len(v) <= 63 and bool(DNS1035.match(v))


def subdomain(v: str) -> bool:
    return len(v) <= 253 and bool(DNS1123_SUBDOMAIN.match(v))


def label_value(v: str) -> bool:
    return len(v) <= 63 and bool(LABEL_VALUE.match(v))


def admitted(name: str, spec: MoEDeploymentSpec) -> bool:
    """api.NAME_RULES as the API server evaluates them (the rule texts are checked below)."""
    top = max(spec.replicas, spec.autoscaling.maxReplicas if spec.autoscaling.enabled else 0)
    multi_ok = spec.nodesPerReplica <= 1 or len(name) + len(str(top - 1)) + 12 <= 63
    ref = spec.gateway.inferencePool.endpointPicker
    return (len(name) <= NAME_MAX and multi_ok and bool(DNS1035.match(name))
            and not (ref is not None and ref.name == name))


def longest(spec: MoEDeploymentSpec) -> str:
    n = max(k for k in range(1, 254) if admitted("m" * k, spec))
    return "m" * n


def test_the_mirror_is_the_crd_rules():
    rules = [r["rule"] for r in NAME_RULES]
    assert f"self.metadata.name.size() <= {NAME_MAX}" in rules
    assert any(r.endswith(").size() + 12 <= 63") and "self.spec.nodesPerReplica <= 1" in r for r in rules)
    assert any(DNS1035.pattern in r for r in rules)
    assert any("endpointPicker.name != self.metadata.name" in r for r in rules)
    assert len(rules) == 4


# --------------------------------------------------------------------------- rendering at the limit
def node(name, gpus=8):
    return {"metadata": {"name": name, "labels": {
        "nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.compute.major": "9", "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.count": str(gpus), "kubernetes.io/arch": "amd64"}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "capacity": {"nvidia.com/gpu": str(gpus)},
                   "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return inspect_dir(write_sample("deepseek-v3-nvfp4", tmp_path_factory.mktemp("c")))


def rendered(ckpt, name: str, s: MoEDeploymentSpec) -> list[dict]:
    classes = build([node_info(node(f"h200-{i}")) for i in range(4)], {})
    p = place(s, ckpt, classes)
    assert p.ok, p.explain()
    return render(Owner(name, "ns", "uid-1"), p.spec or s, p.plan, p.inventory.gpu_class)


def spec(**kw) -> MoEDeploymentSpec:
    base = {"model": {"uri": "file:///models/x"}, "engine": {"name": "sglang"}, "parallelism": {"tp": 8},
            "gpu": {"product": "NVIDIA-H200"}, "replicas": 2,
            "gateway": {"inferencePool": {"enabled": True}}}
    base.update(kw)
    return MoEDeploymentSpec.model_validate(base)


CASES = {
    "single node, HPA": spec(autoscaling={"enabled": True, "provider": "hpa", "maxReplicas": 1000}),
    "single node, KEDA": spec(autoscaling={"enabled": True, "provider": "keda", "maxReplicas": 8,
                                           "prometheusAddress": "http://prometheus:9090"}),
    "multi-node, 1000 replicas": spec(nodesPerReplica=2, parallelism={"tp": 16}, replicas=1000),
    "multi-node, autoscaled to 1000": spec(nodesPerReplica=2, parallelism={"tp": 16}, replicas=2,
                                           autoscaling={"enabled": True, "provider": "hpa", "maxReplicas": 1000}),
    "multi-node, 10 replicas": spec(nodesPerReplica=2, parallelism={"tp": 16}, replicas=10),
}


def labels_in(obj, path="") -> list[tuple[str, str]]:
    """(where, value) of every label value and selector value in the object."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("labels", "matchLabels") and isinstance(v, dict) or (k == "selector" and isinstance(v, dict)
                                                                          and all(isinstance(x, str) for x in v.values())):
                out += [(f"{path}.{k}.{lk}", str(lv)) for lk, lv in v.items()]
            else:
                out += labels_in(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += labels_in(v, f"{path}[{i}]")
    return out


def derived(obj: dict, s: MoEDeploymentSpec) -> list[tuple[str, str, str]]:
    """(what, name, rule) of the names the object's controllers make from its name."""
    n = obj["metadata"]["name"]
    kind = obj["kind"]
    out = []
    if kind == "Deployment":  # ReplicaSet <name>-<pod-template-hash>; pods generateName <rs>- (cut to 58 + 5)
        out.append(("ReplicaSet", f"{n}-{HASH}", "subdomain"))
    if kind == "LeaderWorkerSet":
        top = max(s.replicas, s.autoscaling.maxReplicas if s.autoscaling.enabled else 0) - 1
        workers = s.nodesPerReplica - 1
        # leader StatefulSet <name>, pods <name>-<group>; worker StatefulSet <name>-<group>, pods
        # <name>-<group>-<worker>: a StatefulSet's pod name is its hostname and a label value
        # (statefulset.kubernetes.io/pod-name), its revision label <statefulset>-<hash>
        out += [("leader StatefulSet", n, "subdomain"), ("leader pod", f"{n}-{top}", "label"),
                ("leader revision label", f"{n}-{HASH}", "label_value"),
                ("worker StatefulSet", f"{n}-{top}", "subdomain"), ("worker pod", f"{n}-{top}-{workers}", "label"),
                ("worker revision label", f"{n}-{top}-{HASH}", "label_value"),
                ("LWS headless Service", n, "dns1035"), ("LWS name label", n, "label_value")]
    if kind == "ScaledObject":
        out += [("KEDA's HPA", f"keda-hpa-{n}", "subdomain"), ("KEDA's label", n, "label_value")]
    return out


RULE = {"Service": "dns1035", "Job": "label"}  # a Job's name is its pods' job-name label value


@pytest.mark.parametrize("case", list(CASES))
def test_every_derived_name_is_valid_at_the_longest_admitted_name(ckpt, case):
    s = CASES[case]
    name = longest(s)
    assert not admitted(name + "m", s)
    objs = rendered(ckpt, name, s)
    kinds = {o["kind"] for o in objs}
    want = {"Service", "ConfigMap", "PodDisruptionBudget", "InferencePool", "ServiceAccount", "Role", "RoleBinding",
            "Deployment", "LeaderWorkerSet" if s.nodesPerReplica > 1 else "Deployment"}
    assert want <= kinds, kinds
    assert ("ScaledObject" if s.autoscaling.provider == "keda" else "HorizontalPodAutoscaler") in kinds \
        or not s.autoscaling.enabled
    checks = {"dns1035": dns1035, "label": label, "subdomain": subdomain, "label_value": label_value}
    bad = []
    for o in objs:
        n = o["metadata"]["name"]
        rule = RULE.get(o["kind"], "subdomain")
        if not checks[rule](n):
            bad.append(f"{o['kind']} {n} ({len(n)}): not a {rule}")
        for what, dn, r in derived(o, s):
            if not checks[r](dn):
                bad.append(f"{what} of {o['kind']} {n}: {dn} ({len(dn)}): not a {r}")
        for where, v in labels_in(o):
            if not label_value(v):
                bad.append(f"{o['kind']} {n}{where}: {v!r} ({len(v)}) is not a label value")
    assert not bad, "\n".join(bad)
    # the picker's objects are among them, named <name>-epp
    assert {o["metadata"]["name"] for o in objs if epp.is_picker(o)} == {f"{name}-epp"}


def test_a_picker_of_the_longest_admitted_service_name(ckpt):
    s = spec(gateway={"inferencePool": {"enabled": True, "endpointPicker": {"name": "p" * 63, "deploy": True}}})
    objs = [o for o in rendered(ckpt, longest(s), s) if epp.is_picker(o)]
    assert len(objs) == 5
    for o in objs:
        assert (dns1035 if o["kind"] == "Service" else subdomain)(o["metadata"]["name"])
        assert all(label_value(v) for _, v in labels_in(o)), labels_in(o)
    with pytest.raises(ValueError):  # 64, or not a Service name: refused by the schema
        spec(gateway={"inferencePool": {"enabled": True, "endpointPicker": {"name": "p" * 64}}})
    with pytest.raises(ValueError):
        spec(gateway={"inferencePool": {"enabled": True, "endpointPicker": {"name": "picker.example"}}})
    with pytest.raises(ValueError):
        spec(gateway={"inferencePool": {"enabled": True, "endpointPicker": {"name": "1picker"}}})
    # under the object's own name it would be the workload's Deployment and Service: refused (CEL)
    s = spec(gateway={"inferencePool": {"enabled": True, "endpointPicker": {"name": "m", "deploy": True}}})
    assert not admitted("m", s) and admitted("n", s)


def test_names_that_do_not_derive_from_the_object_name_are_bounded():
    for uri in ("hf://" + "o" * 96 + "/" + "n" * 96, "pvc://" + "c" * 63 + "/" + "p" * 500):
        job = inspect_job.job_name(uri)
        assert label(job), job
    claim = model_cache.claim_name("o" * 96 + "/" + "n" * 96, "r" * 255)
    assert label(claim) and label(claim + "-fill")
    assert day2.endpoint_picker_ref("m" * NAME_MAX, spec())[0] == "m" * NAME_MAX + "-epp"
