"""spec.engine.args, spec.podTemplate, spec.model.servedName and the configured registries (issues 32
items 1 and 3, 26 item 5), pure: what the API refuses by name, what the renderer puts in the pods."""

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from moe_core.checkpoint import inspect_dir
from moe_core.gpu import from_name
from moe_operator import engine_args, images, pod_overlay
from moe_operator.api import MoEDeploymentSpec
from moe_operator.images import Registries
from moe_operator.inventory import build, node_info
from moe_operator.placement import place
from moe_operator.render import Owner, endpoint, render
from moe_operator.sample_checkpoints import write_sample

OPERATOR = Path(pod_overlay.__file__).parent


def node(name, gpus=8):
    return {"metadata": {"name": name, "labels": {
        "nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0", "nvidia.com/gpu.count": str(gpus), "kubernetes.io/arch": "amd64"}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "capacity": {"nvidia.com/gpu": str(gpus)},
                   "conditions": [{"type": "Ready", "status": "True"}]}}


def spec(**kw):
    base = {"model": {"uri": "file:///models/x"}, "engine": {"name": "sglang"}, "parallelism": {"tp": 8}}
    base.update(kw)
    return MoEDeploymentSpec.model_validate(base)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return inspect_dir(write_sample("deepseek-v3-nvfp4", tmp_path_factory.mktemp("c")))


def rendered(ckpt, s, registries=None):
    p = place(s, ckpt, build([node_info(node(f"h200-{i}")) for i in range(2)], {}))
    assert p.ok, p.explain()
    objs = render(Owner("m", "ns", "uid-1"), p.spec or s, p.plan, p.inventory.gpu_class, registries=registries)
    return {o["kind"]: o for o in objs}


def pods(objs):
    if "LeaderWorkerSet" in objs:
        t = objs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"], t["workerTemplate"]]
    return [objs["Deployment"]["spec"]["template"]]


def refused(**kw) -> str:
    with pytest.raises(ValidationError) as e:
        spec(**kw)
    return str(e.value)


# --- engine arguments -----------------------------------------------------------------------------

@pytest.mark.parametrize("engine,arg,field", [
    ("sglang", "--tp-size=4", "spec.parallelism.tp"), ("sglang", "--moe-runner-backend", "spec.moe.runnerBackend"),
    ("sglang", "--context-length", "spec.engine.maxModelLen"), ("sglang", "--served-model-name", "spec.model.servedName"),
    ("vllm", "--tensor_parallel_size=2", "spec.parallelism.tp"), ("vllm", "-tp", "spec.parallelism.tp"),
    ("vllm", "--port", "the operator"), ("vllm", "--moe-backend=triton", "spec.moe.runnerBackend"),
    ("bundled", "--tp", "spec.parallelism.tp"), ("bundled", "--model", "spec.model.uri"),
])
def test_owned_engine_arguments_are_refused_with_the_field_to_use(engine, arg, field):
    extra = {} if engine == "sglang" else {"moe": {"runnerBackend": "auto" if engine == "bundled" else "auto"}}
    msg = refused(engine={"name": engine, "args": [arg, "1"]}, **extra)
    assert f"engine argument {arg.split('=')[0].replace('_', '-')}" in msg and field in msg, msg


def test_abbreviated_owned_flags_are_refused_and_values_are_not_flags():
    assert "abbreviates --moe-runner-backend" in engine_args.refusal("sglang", "--moe-runner=triton")
    assert "read as -tp" in engine_args.refusal("vllm", "-tp4") and "read as -tp" in engine_args.refusal("vllm", "-t")
    assert "spec.parallelism" in engine_args.refusal("sglang", "--pipeline-parallel-size=2")
    assert engine_args.refusal("vllm", "-O3") is None and engine_args.refusal("vllm", "-dcp") is None
    assert engine_args.refusal("vllm", "-1") is None  # a negative value, not a flag
    assert engine_args.refusal("vllm", "--max-num-seqs") is None
    assert "newline" in engine_args.refusal("vllm", "--x\n--port")


def test_every_flag_the_planner_emits_is_owned():
    """The planner's sources name each flag it puts on a command line as a string literal: every one
    is in engine_args.OWNED for its engine (a message like '--chunked-prefill-size <= 8192' is advice).
    An engine's folder (engines/<engine>/: its rows and its command builder) is checked against its own list."""
    flag = re.compile(r"[\"'](--[a-z0-9-]+)[\"']")
    shared = [OPERATOR / "planner.py", OPERATOR / "selection.py", *sorted((OPERATOR / "engine_rules").glob("*.py"))]
    flags = {f for src in shared for f in flag.findall(src.read_text())}
    owned = set(engine_args.OWNED["sglang"]) | set(engine_args.OWNED["vllm"])
    assert flags and flags <= owned, flags - owned
    for engine in ("sglang", "vllm", "bundled"):
        mine = {f for src in sorted((OPERATOR / "engines" / engine).rglob("*.py")) for f in flag.findall(src.read_text())}
        assert mine and mine <= set(engine_args.OWNED[engine]), (engine, mine - set(engine_args.OWNED[engine]))
    from moe_core.bundled import parallel_args
    assert {a for a in parallel_args(8, 8, 2)[0] if a.startswith("--")} <= set(engine_args.OWNED["bundled"])


@pytest.mark.parametrize("engine", ["sglang", "vllm", "bundled"])
def test_rendered_operator_flags_are_owned(ckpt, engine):
    kw = {"engine": {"name": engine, "maxModelLen": 4096}, "model": {"uri": "file:///models/x", "servedName": "ds"}}
    if engine == "bundled":
        kw["parallelism"] = {"tp": 8, "ep": 8}
    args = pods(rendered(ckpt, spec(**kw)))[0]["spec"]["containers"][0]["args"]
    flags = {a for a in args if a.startswith("-")}
    assert flags <= set(engine_args.OWNED[engine]), flags - set(engine_args.OWNED[engine])


def test_user_arguments_come_last_and_change_the_hash(ckpt):
    plain = rendered(ckpt, spec())
    objs = rendered(ckpt, spec(engine={"name": "sglang", "args": ["--max-running-requests", "64", "--enable-metrics"]}))
    args = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-3:] == ["--max-running-requests", "64", "--enable-metrics"]
    assert args[:-3] == plain["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    h = lambda o: o["Deployment"]["metadata"]["annotations"]["moe.serving.dev/inputs-hash"]
    assert h(objs) != h(plain)


# --- served name and endpoint ---------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["sglang", "vllm", "bundled"])
def test_every_engine_serves_the_served_name_default_the_object_name(ckpt, engine):
    kw = {"engine": {"name": engine}} | ({"parallelism": {"tp": 8, "ep": 8}} if engine == "bundled" else {})
    for model, want in (({"uri": "file:///models/x"}, "m"), ({"uri": "file:///models/x", "servedName": "org/ds-v3"}, "org/ds-v3")):
        args = pods(rendered(ckpt, spec(model=model, **kw)))[0]["spec"]["containers"][0]["args"]
        assert args.count("--served-model-name") == 1 and args[args.index("--served-model-name") + 1] == want


def test_served_name_pattern_and_endpoint():
    assert "servedName" in refused(model={"uri": "file:///models/x", "servedName": "a b"})
    assert "servedName" in refused(model={"uri": "file:///models/x", "servedName": "-x"})
    assert endpoint("m", "team", spec(service={"port": 9000})) == "http://m.team.svc:9000/v1"


# --- pod template ---------------------------------------------------------------------------------

TEMPLATE = {
    "metadata": {"labels": {"team": "a", "app.kubernetes.io/part-of": "search"}, "annotations": {"example.com/cost-center": "42"}},
    "spec": {
        "serviceAccountName": "reader", "priorityClassName": "inference", "imagePullSecrets": [{"name": "mine"}],
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]}},
        "securityContext": {"fsGroup": 2000},
        "volumes": [{"name": "extra", "configMap": {"name": "cfg"}}],
        "containers": [{"name": "engine", "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra"}]},
                       {"name": "proxy", "image": "ghcr.io/example/proxy:1", "args": ["--listen", ":9000"]}],
        "initContainers": [{"name": "warm", "image": "busybox:1.36", "command": ["true"]}],
    },
}


@pytest.mark.parametrize("layout", [{}, {"nodesPerReplica": 2, "parallelism": {"tp": 16}, "gpusPerReplica": 16}])
def test_pod_template_merges_into_every_pod(ckpt, layout):
    reg = Registries(pull_secrets=("corp-registry",))
    plain = pods(rendered(ckpt, spec(**layout), reg))
    for pod, base in zip(pods(rendered(ckpt, spec(podTemplate=TEMPLATE, **layout), reg)), plain):
        meta, ps = pod["metadata"], pod["spec"]
        assert meta["labels"]["team"] == "a" and meta["annotations"]["example.com/cost-center"] == "42"
        assert meta["labels"]["moe.serving.dev/deployment"] == "m"  # the operator's labels stay
        assert ps["serviceAccountName"] == ps["serviceAccount"] == "reader" and ps["priorityClassName"] == "inference"
        assert ps["imagePullSecrets"] == [{"name": "corp-registry"}, {"name": "mine"}]
        assert ps["topologySpreadConstraints"] == TEMPLATE["spec"]["topologySpreadConstraints"]
        assert ps["affinity"]["nodeAffinity"] == base["spec"]["affinity"]["nodeAffinity"]  # the GPU class stays
        assert "podAntiAffinity" in ps["affinity"]
        assert ps["securityContext"] == {**base["spec"]["securityContext"], "fsGroup": 2000}
        assert ps["volumes"] == base["spec"]["volumes"] + [{"name": "extra", "configMap": {"name": "cfg"}}]
        engine, proxy = ps["containers"]
        assert engine["name"] == "engine" and engine["image"] == base["spec"]["containers"][0]["image"]
        assert engine["volumeMounts"] == base["spec"]["containers"][0]["volumeMounts"] + [
            {"name": "extra", "mountPath": "/etc/extra"}]
        assert engine["args"] == base["spec"]["containers"][0]["args"]
        assert proxy["image"] == "ghcr.io/example/proxy:1"
        assert proxy["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                            "capabilities": {"drop": ["ALL"]}}
        assert ps["initContainers"][-1]["name"] == "warm"
        assert ps["initContainers"][:-1] == base["spec"].get("initContainers", [])


@pytest.mark.parametrize("template,words", [
    ({"spec": {"containers": [{"name": "engine", "image": "x:1"}]}}, "image is the operator's: use spec.engine.image"),
    ({"spec": {"containers": [{"name": "engine", "args": ["--tp-size", "2"]}]}}, "use spec.engine.args"),
    ({"spec": {"containers": [{"name": "engine", "env": [{"name": "A", "value": "1"}]}]}}, "env is the operator's: use spec.env"),
    ({"spec": {"containers": [{"name": "engine", "resources": {}}]}}, "use spec.resources"),
    ({"spec": {"containers": [{"name": "engine", "securityContext": {"privileged": True}}]}}, "securityContext is the operator's"),
    ({"spec": {"containers": [{"name": "engine", "volumeMounts": [{"name": "v", "mountPath": "/etc/moe"}]}]}},
     "overlaps /etc/moe"),
    ({"spec": {"nodeSelector": {"a": "b"}}}, "podTemplate.spec.nodeSelector is the operator's: use spec.nodeSelector"),
    ({"spec": {"tolerations": [{"operator": "Exists"}]}}, "use spec.tolerations"),
    ({"spec": {"hostNetwork": True}}, "podTemplate.spec.hostNetwork"),
    ({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}}}}},
     "the planner's"),
    ({"spec": {"securityContext": {"runAsUser": 0}}}, "securityContext.runAsUser\n  Extra inputs are not permitted"),
    ({"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}, "hostPath volumes are refused"),
    ({"spec": {"volumes": [{"name": "plan", "emptyDir": {}}]}}, "plan: the name is the operator's"),
    ({"spec": {"volumes": [{"name": "n", "nfs": {"server": "10.0.0.1", "path": "/"}}]}}, "one source of configMap"),
    ({"spec": {"containers": [{"name": "engine", "lifecycle": {"postStart": {"exec": {"command": ["sh"]}}}}]}},
     "lifecycle is the operator's"),
    ({"spec": {"containers": [{"name": "s", "image": "busybox:1", "volumeMounts": [{"name": "model", "mountPath": "/m"}]}]}},
     "operator's volume model must be readOnly"),
    ({"spec": {"containers": [{"name": "s", "image": "busybox:1", "ports": [{"containerPort": 80, "hostPort": 80}]}]}},
     "hostPort is refused"),
    ({"spec": {"containers": [{"name": "s", "image": "busybox:1", "securityContext": {"privileged": True}}]}},
     "securityContext may set only"),
    ({"spec": {"containers": [{"name": "s", "image": "busybox:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}},
     "GPUs are the engine's"),
    ({"spec": {"containers": [{"name": "s", "image": "busybox:1", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}},
     "NVIDIA_VISIBLE_DEVICES"),
    ({"spec": {"containers": [{"name": "s", "image": "busybox:1", "envFrom": [{"configMapRef": {"name": "c"}}]}]}},
     "envFrom is refused"),
    ({"spec": {"containers": [{"name": "s"}]}}, "an image is required"),
    ({"spec": {"containers": [{"name": "s", "image": "Not A Ref"}]}}, "whitespace"),
    ({"spec": {"initContainers": [{"name": "fetch-model", "image": "busybox:1"}]}}, "the name is the operator's"),
    ({"metadata": {"labels": {"moe.serving.dev/role": "x"}}}, "reserved for the operator"),
    ({"metadata": {"annotations": {"moe.serving.dev/inputs-hash": "x"}}}, "reserved for the operator"),
    ({"metadata": {"labels": {"app.kubernetes.io/instance": "other"}}}, "reserved for the operator"),
])
def test_pod_template_refusals_name_the_field(template, words):
    msg = refused(podTemplate=template)
    assert words in msg, msg


@pytest.mark.parametrize("template", [
    {"spec": {"affinity": {"nodeAffinity": "x"}}}, {"spec": {"containers": [{"name": "engine", "volumeMounts": ["x"]}]}},
    {"spec": {"containers": [{"name": "s", "image": "a:1", "env": "x"}]}},
    {"spec": {"containers": [{"name": "s", "image": "a:1", "resources": {"limits": ["nvidia.com/gpu"]}}]}},
    {"spec": {"containers": [{"name": "s", "image": "a:1", "securityContext": "x"}]}},
    {"spec": {"containers": [{"name": ["x"], "image": "a:1"}, {"name": ["x"], "image": "a:1"}]}},
    {"spec": {"initContainers": [{"name": "s", "image": "a:1", "volumeMounts": [3]}]}},
])
def test_malformed_pod_templates_are_refused_not_crashed_on(template):
    assert "podTemplate" in refused(podTemplate=template)  # a ValidationError naming the field, no TypeError


def test_engine_mounts_may_not_hide_a_file_model():
    msg = refused(model={"uri": "file:///data/models/x"},
                  podTemplate={"spec": {"containers": [{"name": "engine", "volumeMounts": [{"name": "v", "mountPath": "/data"}]}]}})
    assert "overlaps /data/models/x" in msg


def test_reserved_names_cover_what_the_operator_renders(ckpt):
    """Every volume, init container and mount the operator renders is reserved, so a podTemplate can never
    replace one by merging on its name or mount path."""
    cases = [spec(), spec(engine={"name": "bundled"}, parallelism={"tp": 8, "ep": 8}),
             spec(model={"uri": "hf://org/m@abc", "cache": {"enabled": True}}),
             spec(model={"uri": "pvc://claim/m"}), spec(engine={"name": "bundled"}, model={"uri": "hf://org/m"})]
    for s in cases:
        for pod in pods(rendered(ckpt, s)):
            ps = pod["spec"]
            assert {v["name"] for v in ps["volumes"]} <= set(pod_overlay.RESERVED_VOLUMES)
            assert {c["name"] for c in ps.get("initContainers", [])} <= set(pod_overlay.RESERVED_INIT)
            for m in ps["containers"][0]["volumeMounts"]:
                if s.model.uri.startswith("file://"):
                    continue  # the file:// path itself: refused by the spec validator above
                assert pod_overlay._under(m["mountPath"], pod_overlay.RESERVED_MOUNTS), m


def test_strategic_merge_lists_by_their_keys():
    base = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}]}], "tolerations": [{"key": "k"}]}
    out = pod_overlay.merge(base, {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}]}, {"name": "b"}],
                                   "tolerations": [{"key": "j"}]})
    assert out["containers"] == [{"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
                                 {"name": "b"}]
    assert out["tolerations"] == [{"key": "j"}]  # no merge key: replaced, as strategic merge does
    assert base["containers"][0]["env"] == [{"name": "X", "value": "1"}]  # inputs untouched


# --- registries -----------------------------------------------------------------------------------

def test_configured_registries_reach_the_images(ckpt):
    reg = Registries(runtime_repository="registry.corp/mirror/moe-runtime", runtime_tag="0.2.0",
                     engine_repositories={"sglang": "registry.corp/mirror/sglang", "vllm": "registry.corp/vllm"},
                     engine_tags={"sglang": "v{version}-corp", "vllm": "v{version}"}, pull_secrets=("corp",))
    sg = rendered(ckpt, spec(), reg)["Deployment"]["spec"]["template"]["spec"]
    assert re.fullmatch(r"registry\.corp/mirror/sglang:v[0-9.]+-corp", sg["containers"][0]["image"])
    assert sg["imagePullSecrets"] == [{"name": "corp"}]
    bd = rendered(ckpt, spec(engine={"name": "bundled"}, parallelism={"tp": 8, "ep": 8}), reg)
    assert bd["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.corp/mirror/moe-runtime:0.2.0-cu13"
    gb200 = from_name("sm100").model_copy(update={"arch": "arm64", "product": "NVIDIA-GB200"})
    assert images.engine_image("vllm", "0.11.0", gb200, reg) == "registry.corp/vllm:v0.11.0-aarch64"
    assert images.runtime_image(from_name("sm90")) == "ghcr.io/moe-operator/moe-runtime:0.1.0-cu13"  # unconfigured
    # no pull secret configured: the pods name none (nothing empty rendered)
    assert "imagePullSecrets" not in rendered(ckpt, spec())["Deployment"]["spec"]["template"]["spec"]


def test_configure_sets_the_process_defaults(ckpt):
    old = images.REGISTRIES
    try:
        images.configure(Registries(runtime_repository="r.example/rt", runtime_tag="9.9.9", pull_secrets=("p",)))
        assert images.runtime_image(from_name("sm90")) == "r.example/rt:9.9.9-cu13"
        pod = rendered(ckpt, spec(engine={"name": "bundled"}, parallelism={"tp": 8, "ep": 8}))["Deployment"]
        assert pod["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "p"}]
        assert pod["spec"]["template"]["spec"]["containers"][0]["image"] == "r.example/rt:9.9.9-cu13"
        from moe_operator.render import inspection_job
        job = inspection_job("ns", "m-inspect", "pvc://claim/m", images.runtime_image(from_name("sm90")), Owner("m", "ns", "u"))
        assert job["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "p"}]
    finally:
        images.configure(old)


def test_run_flags_make_the_registries_and_bad_ones_stop_the_start():
    import argparse

    from moe_operator import run_cli

    p = argparse.ArgumentParser()
    run_cli.add_arguments(p)
    reg = run_cli.registries_from(p.parse_args([
        "--runtime-image", "reg.corp/rt", "--runtime-image-tag", "0.3.0", "--sglang-image", "reg.corp/sglang",
        "--vllm-image-tag", "{version}-mirror", "--image-pull-secret", "corp", "--image-pull-secret", "team"]))
    assert reg == Registries(runtime_repository="reg.corp/rt", runtime_tag="0.3.0",
                             engine_repositories={"sglang": "reg.corp/sglang", "vllm": "vllm/vllm-openai"},
                             engine_tags={"sglang": "v{version}", "vllm": "{version}-mirror"}, pull_secrets=("corp", "team"))
    assert run_cli.registries_from(p.parse_args([])) == Registries()
    for bad, words in ((["--vllm-image", "Reg.Corp/UPPER Case"], "--vllm-image/--vllm-image-tag"),
                       (["--sglang-image-tag", "v{version}:x"], "--sglang-image/--sglang-image-tag"),
                       (["--image-pull-secret", "Bad_Name"], "is not a Secret name")):
        with pytest.raises(SystemExit, match=re.escape(words)):
            run_cli.registries_from(p.parse_args(bad))


def test_chart_image_values_become_the_run_flags():
    """The chart's runtimeImage/engineImages/inferenceImagePullSecrets reach `moe-operator run` (the
    flags parsed by the operator's own parser into the Registries the pods get)."""
    import argparse
    import shutil
    import subprocess

    import yaml

    from moe_operator import run_cli

    helm = shutil.which("helm") or next(iter(sorted(Path.home().glob(".cache/moe-operator/k8s-bin/k8s-*/helm"))), None)
    if not helm:
        pytest.skip("helm not built (deploy/local/build.sh)")
    chart = OPERATOR.parents[1] / "charts" / "moe-operator"
    out = subprocess.run([str(helm), "template", "x", str(chart), "-s", "templates/deployment.yaml",
                          "--set", "runtimeImage.repository=reg.corp/rt", "--set", "runtimeImage.tag=0.4.0",
                          "--set", "engineImages.sglang.repository=reg.corp/sglang",
                          "--set", "engineImages.vllm.tag=v{version}-corp",
                          "--set", "inferenceImagePullSecrets={corp,team}"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    args = next(c for c in yaml.safe_load(out)["spec"]["template"]["spec"]["containers"] if c["name"] == "operator")["args"]
    p = argparse.ArgumentParser()
    run_cli.add_arguments(p)
    flags = [a for a in args[1:] if a.startswith(("--runtime-image", "--sglang-image", "--vllm-image", "--image-pull"))]
    reg = run_cli.registries_from(p.parse_args(flags))
    assert reg == Registries(runtime_repository="reg.corp/rt", runtime_tag="0.4.0",
                             engine_repositories={"sglang": "reg.corp/sglang", "vllm": "vllm/vllm-openai"},
                             engine_tags={"sglang": "v{version}", "vllm": "v{version}-corp"}, pull_secrets=("corp", "team"))
    defaults = subprocess.run([str(helm), "template", "x", str(chart), "-s", "templates/deployment.yaml"],
                              capture_output=True, text=True, timeout=60, check=True).stdout
    assert "--runtime-image-tag=0.1.0" in defaults and "--image-pull-secret" not in defaults  # appVersion


def test_default_image_is_what_the_pods_get(ckpt):
    """images.default_image (what `moe-operator plan` can print) is the image render gives the pods."""
    for kw in ({}, {"engine": {"name": "vllm"}, "moe": {"runnerBackend": "auto"}},
               {"engine": {"name": "bundled"}, "parallelism": {"tp": 8, "ep": 8}}):
        s = spec(**kw)
        p = place(s, ckpt, build([node_info(node("h200-0"))], {}))
        assert p.ok, p.explain()
        pod = pods(rendered(ckpt, s))[0]
        assert pod["spec"]["containers"][0]["image"] == images.default_image(
            s.engine.name, p.plan.engine.version, p.inventory.gpu_class)
