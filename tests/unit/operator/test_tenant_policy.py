"""Tenant safety, pure parts: the admin's policy, rendered security contexts, drift comparison,
model URIs, the admission webhook's server and verdicts."""

from __future__ import annotations

import pytest
from moe_core.gpu import from_name
from pydantic import ValidationError

from moe_operator.api import MoEDeploymentSpec
from moe_operator.drift import differences
from moe_operator.model_uri import ModelURI
from moe_operator.image_ref import parse as parse_image
from moe_operator.policy import Policy, host_path_problems, image_allowed
from moe_operator.render import Owner, engine_cache_volume, inspection_job, render


# ------------------------------------------------------------------------------- policy
@pytest.mark.parametrize("path,allowed,ok", [
    ("/models/x", ("/models",), True),
    ("/models", ("/models",), True),
    ("/models/x/", ("/models/",), True),
    ("/modelsx", ("/models",), False),            # a prefix is not a parent directory
    ("/models/../etc", ("/models",), False),
    ("/var/lib/kubelet", ("/models",), False),
    ("/", ("/models",), False),
    ("/models/x", (), False),                     # nothing allowed by default
    ("relative/x", ("/",), False),
    ("/data/a", ("/models", "/data"), True),
])
def test_host_paths(path, allowed, ok):
    assert (not host_path_problems(path, allowed)) is ok


@pytest.mark.parametrize("image,norm", [
    ("ubuntu", "docker.io/library/ubuntu"),
    ("index.docker.io/x/y", "docker.io/x/y"),
    ("Registry.Local:5000/a/b/c:t@sha256:" + "a" * 64, "registry.local:5000/a/b/c:t@sha256:" + "a" * 64),
    ("lmsysorg/sglang:v0.5", "docker.io/lmsysorg/sglang:v0.5"),
    ("ghcr.io/moe-operator/moe-runtime:0.1.0", "ghcr.io/moe-operator/moe-runtime:0.1.0"),
    ("localhost/x", "localhost/x"),
    ("registry.local:5000/x", "registry.local:5000/x"),
])
def test_image_references_normalize_like_docker(image, norm):
    assert str(parse_image(image)) == norm


def test_image_registries():
    allowed = ("docker.io/lmsysorg", "ghcr.io/moe-operator/")
    assert image_allowed("lmsysorg/sglang:v0.5.23", allowed)
    assert image_allowed("ghcr.io/moe-operator/moe-runtime@sha256:" + "a" * 64, allowed)
    # a string prefix is not a registry: '@' ends the name, so this is not a reference at all
    assert not image_allowed("ghcr.io/moe-operator@evil.example/x", allowed)
    assert not image_allowed("ghcr.io/moe-operator", ("ghcr.io/moe-operator/runtime",))
    assert image_allowed("ubuntu:24.04", ("docker.io/library",)) and not image_allowed("ubuntu", ("docker.io/lmsysorg",))
    assert not image_allowed("ghcr.io/moe-operator-evil/x", allowed)
    assert not image_allowed("evil.io/lmsysorg/sglang", allowed)
    assert not image_allowed("lmsysorg-x/sglang", allowed)


def spec(**kw) -> MoEDeploymentSpec:
    return MoEDeploymentSpec.model_validate({"model": {"uri": "hf://org/name"}, **kw})


def test_policy_problems_name_the_fix():
    p = Policy(allowed_host_paths=("/models",), allowed_registries=("docker.io/lmsysorg",))
    assert p.problems(spec()) == []
    assert p.problems(spec(model={"uri": "file:///models/x"})) == []
    (msg,) = p.problems(spec(model={"uri": "file:///etc"}))
    assert "not under an allowed host path (/models)" in msg and "pvc://" in msg
    (msg,) = p.problems(spec(engine={"name": "sglang", "image": "evil/sglang"}))
    assert "not from an allowed registry" in msg and "leave engine.image unset" in msg
    assert Policy().problems(spec(engine={"name": "sglang", "image": "evil/sglang"})) == []  # any image by default
    assert "--allow-host-path" in Policy().problems(spec(model={"uri": "file:///models/x"}))[0]


@pytest.mark.parametrize("env", [{"name": "LD_PRELOAD"}, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                                 {"name": "CUDA_VISIBLE_DEVICES"}, {"name": "LWS_LEADER_ADDRESS"},
                                 {"name": "PYTHONPATH"}, {"name": "SGLANG_CACHE_DIR"}, {"name": "HF_ENDPOINT"}])
def test_reserved_env_names_are_in_the_crd_rule(env):
    from moe_operator.crd import crd

    rules = " ".join(r["rule"] for r in crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["env"]["items"]["x-kubernetes-validations"])
    name = env["name"]
    assert f"'{name}'" in rules or any(f"startsWith('{p}')" in rules for p in ("LD_", "NVIDIA_", "LWS_", "PYTHON")
                                       if name.startswith(p))


def test_model_uri_revision_may_not_look_like_a_flag():
    for bad in ("hf://org/name@-x", "hf://org/name@--upload", "hf://org/name@.x"):
        with pytest.raises(ValidationError):
            spec(model={"uri": bad})
    spec(model={"uri": "hf://org/name@v1.0"})


# ------------------------------------------------------------------------------- model URIs
def test_model_uris_parse_once():
    assert ModelURI.parse("hf://org/name@main") == ModelURI("hf", repo="org/name", revision="main")
    u = ModelURI.parse("pvc://models/deepseek/v3/")
    assert (u.claim, u.subpath) == ("models", "deepseek/v3")
    vol, mount, path = u.volume()
    assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert mount["readOnly"] is True and path == "/models/models/deepseek/v3"
    vol, mount, path = ModelURI.parse("file:///models/x").volume()
    assert vol["hostPath"]["path"] == "/models/x" and mount["readOnly"] is True and path == "/models/x"
    with pytest.raises(ValueError):
        ModelURI.parse("s3://bucket/x")


# ------------------------------------------------------------------------------- rendering
def _plan_for(s: MoEDeploymentSpec, family: str):
    from moe_core.checkpoint import CheckpointInfo
    from moe_operator.placement import choices_from_spec
    from moe_operator.planner import plan

    ck = CheckpointInfo(architecture="DeepseekV3ForCausalLM", format="nvfp4", formatSource="test", expertsFp4=True)
    return plan(ck, from_name(family), choices_from_spec(s), engine=s.engine.name, engine_version=s.engine.version)


@pytest.mark.parametrize("engine,non_root", [("bundled", True), ("sglang", False), ("vllm", False)])
def test_every_rendered_pod_is_locked_down(engine, non_root):
    s = spec(engine={"name": engine}, model={"uri": "file:///models/x"})
    objs = render(Owner("x", "ns", "uid"), s, _plan_for(s, "sm100"), from_name("B200"))
    pod = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"].get("runAsNonRoot", False) is non_root
    for c in pod["containers"] + pod.get("initContainers", []):
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                        "capabilities": {"drop": ["ALL"]}}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model"]["hostPath"]["path"] == "/models/x"
    assert all(m.get("readOnly") for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model")


def test_engine_cache_is_per_pod_unless_the_admin_gives_a_root():
    s = spec(engine={"name": "sglang"})
    p = _plan_for(s, "sm100")
    assert engine_cache_volume(Owner("x", "team-a", "u"), from_name("B200"), p, None) == {"name": "engine-cache", "emptyDir": {}}
    v = engine_cache_volume(Owner("x", "team-a", "u"), from_name("B200"), p, "/var/cache/moe")
    assert v["hostPath"]["path"].startswith("/var/cache/moe/team-a/")


def test_inspection_job_is_locked_down_and_owned():
    job = inspection_job("ns", "moe-inspect-x", "pvc://models/a", "img", Owner("x", "ns", "uid"))
    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid"


def test_workload_carries_its_gpu_class_for_sticky_placement():
    s = spec(engine={"name": "sglang"}, nodesPerReplica=1)
    objs = render(Owner("x", "ns", "uid"), s, _plan_for(s, "sm100"), from_name("B200"))
    wl = next(o for o in objs if o["kind"] == "Deployment")
    assert wl["metadata"]["annotations"]["moe.serving.dev/gpu-class"] == from_name("B200").key()


# ------------------------------------------------------------------------------- drift
def test_drift_ignores_what_the_server_adds_but_not_added_list_items():
    desired = {"spec": {"template": {"spec": {"containers": [{"name": "e", "env": [{"name": "A", "value": ""}],
                                                              "resources": {"limits": {"cpu": "1000m"}}}]}}},
               "metadata": {"labels": {"a": "b"}}}
    live = {"spec": {"template": {"spec": {"containers": [{"name": "e", "env": [{"name": "A"}],
                                                           "imagePullPolicy": "IfNotPresent",
                                                           "resources": {"limits": {"cpu": "1"}}}],
                                           "dnsPolicy": "ClusterFirst"}}},
            "metadata": {"labels": {"a": "b", "extra": "x"}, "resourceVersion": "5"}}
    assert differences(desired, live) == []
    live["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "INJECTED", "value": "1"})
    (d,) = differences(desired, live)
    assert "env" in d and "1 items rendered, live has 2" in d
    live["spec"]["template"]["spec"]["containers"][0]["env"].pop()
    live["metadata"]["labels"]["a"] = "c"
    assert differences(desired, live) == [".metadata.labels.a: rendered 'b', live 'c'"]


# ------------------------------------------------------------------------------- webhook
def test_webhook_binds_where_it_is_told_with_a_ca_it_made():
    import ssl

    from moe_operator.webhook import server

    srv, ca = server("127.0.0.1:9443")
    assert srv.addr == "127.0.0.1" and srv.host == "127.0.0.1" and srv.port == 9443
    assert b"BEGIN CERTIFICATE" in ca
    ctx = ssl.create_default_context(cadata=ca.decode())   # the CA verifies the serving certificate
    assert ctx.cert_store_stats()["x509_ca"] == 1
    srv2, _ = server("moe.svc:9443", listen="0.0.0.0")
    assert srv2.addr == "0.0.0.0" and srv2.host == "moe.svc"


def test_webhook_serving_cert_is_signed_by_its_ca(tmp_path):
    import subprocess

    from moe_operator.webhook import operator_ca

    cert, key, ca = operator_ca("moe-operator-webhook.moe-system.svc")
    r = subprocess.run(["openssl", "verify", "-CAfile", ca, cert], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = subprocess.run(["openssl", "x509", "-in", cert, "-noout", "-text"], capture_output=True, text=True).stdout
    assert "DNS:moe-operator-webhook.moe-system.svc" in text


def test_map_keys_the_schema_cannot_bound_are_checked_by_the_model_and_the_webhook():
    from moe_operator.reconcile import Config
    from moe_operator.webhook import verdict

    with pytest.raises(ValidationError):
        spec(nodeSelector={"bad key!": "x"})
    with pytest.raises(ValidationError):
        spec(resources={"limits": {"memory": "lots"}})
    spec(nodeSelector={"topology.kubernetes.io/zone": "a"}, resources={"limits": {"memory": "64Gi", "cpu": "500m"}})
    msg = verdict({"model": {"uri": "hf://org/name"}, "nodeSelector": {"bad key!": "x"}}, Config())
    assert msg and msg.startswith("invalid spec: nodeSelector")


def test_webhook_judges_an_explicit_a2a_under_an_auto_runner(tmp_path):
    from moe_operator.policy import Policy
    from moe_operator.reconcile import Config
    from moe_operator.sample_checkpoints import write_sample
    from moe_operator.webhook import verdict

    write_sample("deepseek-v3-nvfp4", tmp_path / "deepseek-v3-nvfp4")
    cfg = Config(local_models_dir=str(tmp_path), policy=Policy(allowed_host_paths=("/models",)))
    base = {"model": {"uri": "file:///models/deepseek-v3-nvfp4"}, "engine": {"name": "sglang"},
            "parallelism": {"tp": 8, "ep": 8}, "gpu": {"allowedArchitectures": ["sm80"]}}
    assert verdict(base, cfg) is None
    msg = verdict({**base, "moe": {"a2aBackend": "deepep"}}, cfg)   # the planner refuses it on sm80
    from moe_operator.placement import choices_from_spec, plan
    from moe_core.checkpoint import inspect_dir
    from moe_core.gpu import from_name
    from moe_operator.api import MoEDeploymentSpec

    s = MoEDeploymentSpec.model_validate({**base, "moe": {"a2aBackend": "deepep"}})
    p = plan(inspect_dir(tmp_path / "deepseek-v3-nvfp4"), from_name("sm80"), choices_from_spec(s), engine="sglang",
             engine_version=None)
    assert p.errors and msg and "impossible on every allowed GPU class" in msg   # admission says what the planner says
    assert all(e in msg for e in p.errors)   # every error of the class, not only the first


def test_an_unchanged_status_is_not_written_again():
    from moe_operator.reconcile import status_changed

    old = {"checkpoint": {"format": "nvfp4"}, "conditions": [{"type": "Planned", "status": "True"}], "replicas": 1}
    # None-valued fields are what the API server drops from a merge patch: no change
    assert not status_changed(old, {"checkpoint": {"format": "nvfp4", "numFiles": None}, "replicas": 1})
    assert status_changed(old, {"replicas": 2})
    assert status_changed(old, {"conditions": [{"type": "Planned", "status": "False"}]})
    assert status_changed(old, {"gpuClass": "sm90/NVIDIA-H200"})


def test_service_types_beyond_cluster_ip_need_the_admin():
    (msg,) = Policy().problems(spec(service={"type": "LoadBalancer"}))
    assert "service.type LoadBalancer is not allowed" in msg and "policy.allowedServiceTypes" in msg
    assert Policy().problems(spec(service={"type": "NodePort"}))
    assert Policy().problems(spec()) == []
    assert Policy(allowed_service_types=("ClusterIP", "LoadBalancer")).problems(spec(service={"type": "LoadBalancer"})) == []


def test_a_pod_template_image_outside_the_allowed_registries_is_refused():
    from moe_operator.policy import Policy

    pol = Policy(allowed_registries=("ghcr.io/moe-operator",))
    spec = MoEDeploymentSpec.model_validate({"model": {"uri": "hf://org/m"}, "podTemplate": {"spec": {"containers": [
        {"name": "side", "image": "evil.example/x:1"}]}}})
    assert any("podTemplate image 'evil.example/x:1' is not from an allowed registry" in p for p in pol.problems(spec))
    ok = MoEDeploymentSpec.model_validate({"model": {"uri": "hf://org/m"}, "podTemplate": {"spec": {"initContainers": [
        {"name": "side", "image": "ghcr.io/moe-operator/helper:1"}]}}})
    assert not pol.problems(ok)
