"""Installing moe-operator on a real API server (the local control plane): the Helm chart
(install, upgrade-free uninstall), the plain manifests (`kubectl apply -k deploy/`), the rendered
chart validated server-side, every sample accepted and invalid MoEDeployments refused with the
CEL messages of moe_operator/api.py.

The operator's pods are scheduled onto simulated (kwok) GPU nodes, where kwok reports them
Running: this checks the install, not the operator's behaviour (tests/integration/test_operator*).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from moe_core import registry
from moe_operator.crd import crd
from moe_operator.planner import ALL_A2A, ALL_RUNNERS

from .operator_fixture import CHECKPOINTS, GOLDEN_SAMPLES, HOST_PATH_ARGS, ROOT, SAMPLES as DEMO, kubectl_json, wait_for

pytestmark = pytest.mark.integration

CHART = ROOT / "charts" / "moe-operator"
SAMPLES = sorted(GOLDEN_SAMPLES.glob("*.yaml")) + sorted(DEMO.glob("*.yaml"))  # the CRD accepts both
OUR_CRDS = ("moedeployments.moe.serving.dev", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")


def _exists(kubectl, *args) -> bool:
    return kubectl("get", *args, "--ignore-not-found", "-o", "name", check=False).stdout.strip() != ""


def _can_i(kubectl, sa: str, *args: str) -> bool:
    proc = kubectl("auth", "can-i", f"--as={sa}", *args, check=False)
    answer = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert answer in ("yes", "no"), f"kubectl auth can-i {args}: {proc.stdout}{proc.stderr}"
    return answer == "yes"


def _helm(dev_cluster, *args, timeout=300.0):
    proc = dev_cluster.helm(*args, check=False, timeout=timeout)
    assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _debug(kubectl, ns: str) -> str:
    return (kubectl("get", "all", "-n", ns, "-o", "wide", check=False).stdout
            + kubectl("get", "events", "-n", ns, check=False).stdout[-3000:])


@pytest.fixture
def release(dev_cluster, kubectl):
    """A unique release name and namespace; uninstalled and deleted afterwards whatever happens."""
    name = f"it-{uuid.uuid4().hex[:6]}"
    yield name, name
    dev_cluster.helm("uninstall", name, "-n", name, "--wait", check=False)
    kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def crds_installed(kubectl):
    """The chart's CRDs (the same file the generator writes), established."""
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=moe-it",
            "-f", str(CHART / "crds"), "-f", str(ROOT / "crds" / "moedeployments.yaml"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{c}" for c in OUR_CRDS])


# ------------------------------------------------------------------------------------ helm
def test_helm_install_and_uninstall(dev_cluster, kubectl, release):
    rel, ns = release
    sa = f"system:serviceaccount:{ns}:{rel}-moe-operator"
    # the session may have applied the CRD with kubectl: each release here adopts it (crds.install,
    # the default, with --take-ownership; the CRD is kept when the release goes)
    _helm(dev_cluster, "install", rel, str(CHART), "-n", ns, "--create-namespace", "--take-ownership",
          "--set", "replicas=2", "--set", "nodeProbe.enabled=true", "--wait", "--timeout", "240s")
    try:
        for c in OUR_CRDS:
            cond = {x["type"]: x["status"] for x in kubectl_json(kubectl, "get", "crd", c)["status"]["conditions"]}
            assert cond.get("Established") == "True", (c, cond)
        dep = kubectl_json(kubectl, "-n", ns, "get", "deployment", f"{rel}-moe-operator")
        assert dep["status"].get("readyReplicas") == 2, dep["status"]
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--peering={rel}-moe-operator" in args and "--standalone" not in args
        pods = kubectl_json(kubectl, "-n", ns, "get", "pods", "-l", "app.kubernetes.io/component=operator")["items"]
        assert len(pods) == 2 and all(p["spec"].get("nodeName") for p in pods)
        assert _exists(kubectl, "clusterkopfpeering", f"{rel}-moe-operator")
        for kind in ("serviceaccount", "service"):
            assert _exists(kubectl, "-n", ns, kind, f"{rel}-moe-operator" + ("-metrics" if kind == "service" else ""))
        for kind in ("clusterrole", "clusterrolebinding"):
            assert _exists(kubectl, kind, f"{rel}-moe-operator")
            assert _exists(kubectl, kind, f"{rel}-moe-operator-node-probe")

        # least privilege, as the API server's authorizer sees it
        assert _can_i(kubectl, sa, "watch", "moedeployments.moe.serving.dev", "-A")
        assert _can_i(kubectl, sa, "patch", "moedeployments.moe.serving.dev", "--subresource=status", "-n", "default")
        assert _can_i(kubectl, sa, "create", "deployments.apps", "-n", "default")
        assert _can_i(kubectl, sa, "patch", "clusterkopfpeerings.kopf.dev")
        assert _can_i(kubectl, sa, "get", "secrets", "-n", "default")
        assert _can_i(kubectl, sa, "list", "nodes")
        assert not _can_i(kubectl, sa, "list", "secrets", "-n", "default")
        assert not _can_i(kubectl, sa, "patch", "nodes")
        assert not _can_i(kubectl, sa, "delete", "moedeployments.moe.serving.dev", "-n", "default")
        assert not _can_i(kubectl, sa, "create", "clusterroles.rbac.authorization.k8s.io")
        probe_sa = f"system:serviceaccount:{ns}:{rel}-moe-operator-node-probe"
        assert _can_i(kubectl, probe_sa, "patch", "nodes")
        assert not _can_i(kubectl, probe_sa, "list", "pods", "-A")

        # the node probe goes exactly to the nodes GPU Feature Discovery does not describe
        nodes = kubectl_json(kubectl, "get", "nodes")["items"]
        for arch in ("amd64", "arm64"):
            want = sum(1 for n in nodes if "nvidia.com/gpu.present" not in n["metadata"]["labels"]
                       and n["metadata"]["labels"].get("kubernetes.io/arch") == arch)
            ds = kubectl_json(kubectl, "-n", ns, "get", "daemonset", f"{rel}-moe-operator-node-probe-{arch}")
            assert ds["status"].get("desiredNumberScheduled", 0) == want, (arch, ds["status"])

        notes = _helm(dev_cluster, "get", "notes", rel, "-n", ns).stdout
        assert "kubectl get moed" in notes
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_debug(kubectl, ns)}") from None

    _helm(dev_cluster, "uninstall", rel, "-n", ns, "--wait", "--timeout", "120s")
    wait_for(lambda: not _exists(kubectl, "-n", ns, "deployment", f"{rel}-moe-operator"), 60, "the Deployment to go")
    for kind in ("clusterrole", "clusterrolebinding"):
        assert not _exists(kubectl, kind, f"{rel}-moe-operator")
    assert not _exists(kubectl, "clusterkopfpeering", f"{rel}-moe-operator")
    # Helm never deletes CRDs (that would delete every MoEDeployment): they stay; the MoEDeployment
    # one, a template of the release, by its helm.sh/resource-policy keep
    for c in OUR_CRDS:
        assert _exists(kubectl, "crd", c)
    ann = kubectl_json(kubectl, "get", "crd", OUR_CRDS[0])["metadata"].get("annotations", {})
    assert ann.get("helm.sh/resource-policy") == "keep", ann


def test_helm_install_watching_namespaces(dev_cluster, kubectl, release, namespace):
    rel, ns = release
    sa = f"system:serviceaccount:{ns}:{rel}-moe-operator"
    _helm(dev_cluster, "install", rel, str(CHART), "-n", ns, "--create-namespace",
          "--set", f"watchNamespaces={{{namespace}}}", "--set", "replicas=2", "--take-ownership",
          "--wait", "--timeout", "240s")
    args = kubectl_json(kubectl, "-n", ns, "get", "deployment", f"{rel}-moe-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={namespace}" in args
    assert _exists(kubectl, "-n", namespace, "kopfpeering", f"{rel}-moe-operator")
    assert _exists(kubectl, "-n", namespace, "role", f"{rel}-moe-operator")
    assert _can_i(kubectl, sa, "watch", "moedeployments.moe.serving.dev", "-n", namespace)
    assert _can_i(kubectl, sa, "patch", "kopfpeerings.kopf.dev", "-n", namespace)
    assert _can_i(kubectl, sa, "create", "jobs.batch", "-n", namespace)
    assert not _can_i(kubectl, sa, "watch", "moedeployments.moe.serving.dev", "-A")
    assert not _can_i(kubectl, sa, "get", "secrets", "-n", "default")
    assert not _can_i(kubectl, sa, "create", "deployments.apps", "-n", "default")
    assert _can_i(kubectl, sa, "watch", "nodes")
    _helm(dev_cluster, "uninstall", rel, "-n", ns, "--wait", "--timeout", "120s")
    assert not _exists(kubectl, "-n", namespace, "role", f"{rel}-moe-operator")


def test_rendered_chart_is_valid_server_side(dev_cluster, kubectl, crds_installed, namespace):
    """Every object of the chart with everything switched on, validated by the API server itself
    (strict field validation: an unknown or misplaced field is an error)."""
    sets = ["replicas=3", f"watchNamespaces={{{namespace}}}", "nodeProbe.enabled=true",
            "extraEnv[0].name=X", "extraEnv[0].value=x1", "podAnnotations.a=b"]
    has_sm = _exists(kubectl, "crd", "servicemonitors.monitoring.coreos.com")
    if has_sm:
        sets.append("metrics.serviceMonitor.enabled=true")
    out = _helm(dev_cluster, "template", "dry", str(CHART), "-n", namespace,
                *[a for s in sets for a in ("--set", s)]).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert {"Deployment", "DaemonSet", "ClusterRole", "Role", "KopfPeering", "Service"} <= {d["kind"] for d in docs}
    proc = kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=out, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(server dry run)") == len(docs), proc.stdout


# -------------------------------------------------------------------------- plain manifests
def test_kubectl_apply_k_deploy(kubectl):
    manifests = ROOT / "deploy" / "manifests"
    # A cluster shared with a real install (e.g. the demo's) is only dry-run, never taken over.
    taken = _exists(kubectl, "-n", "moe-system", "deployment", "moe-operator")
    if taken:
        proc = kubectl("apply", "-k", str(ROOT / "deploy"), "--dry-run=server", "--validate=strict", check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    proc = kubectl("apply", "-k", str(ROOT / "deploy"), "--validate=strict", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        kubectl("wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{c}" for c in OUR_CRDS])
        kubectl("-n", "moe-system", "rollout", "status", "deployment/moe-operator", "--timeout=180s")
        args = kubectl_json(kubectl, "-n", "moe-system", "get", "deployment", "moe-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--standalone" in args
        assert _can_i(kubectl, "system:serviceaccount:moe-system:moe-operator", "watch", "moedeployments.moe.serving.dev", "-A")
        # a second apply changes nothing
        again = kubectl("apply", "-k", str(ROOT / "deploy")).stdout
        assert all(ln.endswith("unchanged") for ln in again.strip().splitlines()), again
    finally:
        # everything but the CRDs (deleting those would delete every MoEDeployment in the cluster)
        kubectl("delete", "-f", str(manifests / "20-operator.yaml"), "-f", str(manifests / "00-namespace.yaml"),
                "--ignore-not-found", "--wait=false", check=False)


# ------------------------------------------------------- the chart's RBAC is what the operator needs
RBAC_SAMPLES = ["gpt-oss-mxfp4-h100.yaml", "deepseek-v3-nvfp4-b200.yaml"]


@pytest.mark.parametrize("mode", ["all-namespaces", "watched-namespace"])
def test_operator_runs_with_only_the_chart_rbac(dev_cluster, kubectl, release, namespace, tmp_path, mode):
    """The real operator, authenticated as the chart's ServiceAccount (a TokenRequest token), plans
    the samples with no request refused: the least-privilege RBAC is enough. replicas=0 keeps the
    in-cluster Deployment from competing; the operator runs here, as the demo runs it."""
    rel, ns = release
    sets = ["--set", "replicas=0", "--take-ownership"] + (["--set", f"watchNamespaces={{{namespace}}}"] if mode == "watched-namespace" else [])
    _helm(dev_cluster, "install", rel, str(CHART), "-n", ns, "--create-namespace", *sets)
    token = kubectl("-n", ns, "create", "token", f"{rel}-moe-operator", "--duration=1h").stdout.strip()
    kc = yaml.safe_load(Path(dev_cluster.kubeconfig).read_text())
    for u in kc["users"]:
        u["user"] = {"token": token}
    sa_kubeconfig = tmp_path / "sa.kubeconfig"
    sa_kubeconfig.write_text(yaml.safe_dump(kc))
    assert kubectl("--kubeconfig", str(sa_kubeconfig), "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").stdout \
        == f"system:serviceaccount:{ns}:{rel}-moe-operator"

    cmd = [sys.executable, "-m", "moe_operator.cli", "run", "--kubeconfig", str(sa_kubeconfig), "--standalone",
           "--metrics-port", "0", "--liveness", "", "--log-level", "debug",
           "--local-models-dir", str(CHECKPOINTS), *HOST_PATH_ARGS]
    if mode == "watched-namespace":
        cmd += ["--namespace", namespace]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("operator", "runtime", "kernels"))}
    log_path = tmp_path / "operator.log"
    with open(log_path, "w") as log:
        op = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            for s in RBAC_SAMPLES:
                kubectl("apply", "-n", namespace, "-f", str(DEMO / s))
            names = [yaml.safe_load((DEMO / s).read_text())["metadata"]["name"] for s in RBAC_SAMPLES]

            def planned():
                items = kubectl_json(kubectl, "-n", namespace, "get", "moed")["items"]
                ok = {i["metadata"]["name"] for i in items
                      if any(c["type"] == "Planned" and c["status"] == "True" for c in i.get("status", {}).get("conditions", []))}
                return set(names) <= ok

            try:
                wait_for(planned, 120, f"{names} to be Planned by the operator running as the chart's ServiceAccount")
            except AssertionError as e:
                raise AssertionError(f"{e}\n--- operator log (tail)\n{log_path.read_text()[-4000:]}") from None
        finally:
            op.terminate()
            try:
                op.wait(timeout=20)
            except subprocess.TimeoutExpired:
                op.kill()
    text = log_path.read_text()
    refused = [ln for ln in text.splitlines() if "Forbidden" in ln or " 403" in ln or "forbidden" in ln]
    assert not refused, "requests refused with the chart's RBAC:\n" + "\n".join(refused[:10])


def test_two_peered_operators_elect_one(dev_cluster, kubectl, release, namespace, tmp_path):
    """replicas > 1 renders --peering: of two operators on the same peering exactly one must act."""
    rel, ns = release
    _helm(dev_cluster, "install", rel, str(CHART), "-n", ns, "--create-namespace", "--set", "replicas=2",
          "--set", f"watchNamespaces={{{namespace}}}", "--take-ownership")
    # the chart's in-cluster pods only pretend to run (kwok); two real operators run here instead
    kubectl("-n", ns, "scale", "deployment", f"{rel}-moe-operator", "--replicas=0")
    peering = f"{rel}-moe-operator"
    assert _exists(kubectl, "-n", namespace, "kopfpeering", peering)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("operator", "runtime", "kernels"))}
    cmd = [sys.executable, "-m", "moe_operator.cli", "run", "--kubeconfig", str(dev_cluster.kubeconfig),
           "--namespace", namespace, "--peering", peering, "--metrics-port", "0", "--liveness", "",
           "--local-models-dir", str(CHECKPOINTS), *HOST_PATH_ARGS]
    procs, logs = [], []
    try:
        for who in ("a", "b"):
            logs.append(tmp_path / f"op-{who}.log")
            procs.append(subprocess.Popen(cmd, stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT,
                                          env={**env, "POD_ID": f"op-{who}"}, cwd=ROOT))
            time.sleep(3)
        kubectl("apply", "-n", namespace, "-f", str(DEMO / "gpt-oss-mxfp4-h100.yaml"))

        def planned():
            obj = kubectl_json(kubectl, "-n", namespace, "get", "moed", "gpt-oss-h100")
            return any(c["type"] == "Planned" and c["status"] == "True" for c in obj.get("status", {}).get("conditions", []))

        try:
            wait_for(planned, 45, "one of the two peered operators to plan the sample")
        except AssertionError as e:
            raise AssertionError(f"{e}\n" + "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs)) from None
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


# ------------------------------------------------------------------------------- samples, CEL
@pytest.mark.parametrize("sample", SAMPLES, ids=[f"{p.parent.name}/{p.stem}" for p in SAMPLES])
def test_sample_is_accepted(kubectl, crds_installed, namespace, sample):
    proc = kubectl("apply", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", str(sample), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "moedeployment.moe.serving.dev/" in proc.stdout and "(server dry run)" in proc.stdout


def _cel_message(rule_part: str) -> str:
    """The message api.py declares for the CEL rule containing rule_part (so the test follows api.py)."""
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    found = [v["message"] for v in spec["x-kubernetes-validations"] if rule_part in v["rule"]]
    assert len(found) == 1, f"no single CEL rule contains {rule_part!r}"
    return found[0]


A2A = next(a for a in ALL_A2A if a != "none")
NOT_BUNDLED = next(r for r in ALL_RUNNERS if r != "auto" and r not in registry.names())


def _merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


INVALID = [
    ("tp-not-multiple-of-ep", {"engine": {"name": "sglang"}, "parallelism": {"tp": 4, "ep": 3}},
     _cel_message("self.parallelism.tp % self.parallelism.ep")),
    ("tp-not-multiple-of-dp", {"engine": {"name": "sglang"}, "parallelism": {"tp": 8, "dp": 3}},
     _cel_message("self.parallelism.tp % self.parallelism.dp")),
    ("a2a-without-ep", {"engine": {"name": "sglang"}, "parallelism": {"tp": 8}, "moe": {"a2aBackend": A2A}},
     _cel_message("self.parallelism.ep > 1")),
    ("a2a-on-bundled", {"parallelism": {"tp": 8, "ep": 8}, "moe": {"a2aBackend": A2A}},
     _cel_message("self.moe.a2aBackend == 'none' || self.engine.name != 'bundled'")),
    ("bundled-non-registry-backend", {"moe": {"runnerBackend": NOT_BUNDLED}},
     _cel_message("self.engine.name != 'bundled' || self.moe.runnerBackend in")),
    ("bundled-too-many-nodes", {"parallelism": {"tp": 72}, "nodesPerReplica": 9},
     _cel_message("self.nodesPerReplica <= ")),
    ("vllm-deferred-finalize", {"engine": {"name": "vllm"}, "moe": {"deferredFinalize": "on"}},
     _cel_message("self.engine.name != 'vllm' || self.moe.deferredFinalize")),
    ("gpus-not-tp", {"engine": {"name": "sglang"}, "parallelism": {"tp": 8}, "gpusPerReplica": 4},
     _cel_message("self.gpusPerReplica == self.parallelism.tp")),
    ("bad-uri", {"model": {"uri": "s3://bucket/model"}}, "spec.model.uri"),
    ("unknown-runner", {"moe": {"runnerBackend": "warp-drive"}}, "spec.moe.runnerBackend"),
]


@pytest.mark.parametrize("name,patch,message", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_moedeployment_is_refused(kubectl, crds_installed, namespace, name, patch, message):
    base = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": name},
            "spec": {"model": {"uri": "file:///models/deepseek-v4-flash-fp4"}}}
    obj = _merge(base, {"spec": patch})
    proc = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert proc.returncode != 0, f"{name} was accepted: {proc.stdout}"
    assert message in proc.stderr, f"expected {message!r} in:\n{proc.stderr}"


def test_unknown_field_is_refused_with_strict_validation(kubectl, crds_installed, namespace):
    obj = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "typo"},
           "spec": {"model": {"uri": "hf://org/model"}, "replicaz": 2}}
    proc = kubectl("apply", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", "-",
                   input=yaml.safe_dump(obj), check=False)
    assert proc.returncode != 0 and "replicaz" in proc.stderr, proc.stdout + proc.stderr
