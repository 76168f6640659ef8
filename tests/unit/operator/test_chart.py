"""The Helm chart (charts/moe-operator), the plain manifests rendered from it and the Dockerfiles.

Needs the helm binary: $HELM, else the pinned one built by deploy/local/build.sh (found through
moe_operator.devcluster), else helm on PATH. Without helm these tests FAIL with a message saying
how to get it, unless MOE_SKIP_INTEGRATION=1 (then they skip). The chart is validated against the
real API server (server-side dry run) in tests/integration/test_install.py.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import moe_operator
from moe_operator import images, permissions
from moe_operator.crd import crd_yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "moe-operator"
SKIP_ENV = "MOE_SKIP_INTEGRATION"


# ---------------------------------------------------------------------------------------- helm
@functools.cache
def _find_helm() -> str | None:
    if os.environ.get("HELM"):
        exe = os.environ["HELM"]
        return exe if os.access(exe, os.X_OK) else None
    try:
        from moe_operator.devcluster.binaries import BuildError, build_script, ensure_binaries

        try:
            exe = ensure_binaries(build=False).helm
            if os.access(exe, os.X_OK):
                return str(exe)
        except BuildError:
            # Another binary of the set may be missing; helm itself may still be there.
            out = subprocess.run(["bash", str(build_script()), "--print-dir"], capture_output=True, text=True)
            dirs = [ln.split("=", 1)[1] for ln in out.stdout.splitlines() if ln.startswith("BIN_DIR=")]
            if dirs and os.access(Path(dirs[-1]) / "helm", os.X_OK):
                return str(Path(dirs[-1]) / "helm")
    except ImportError:
        pass
    return shutil.which("helm")


@pytest.fixture(scope="module")
def helm() -> str:
    exe = _find_helm()
    if exe is None:
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(f"helm not found and {SKIP_ENV}=1")
        pytest.fail(f"helm not found ($HELM={os.environ.get('HELM', '')!r}): build it with `bash deploy/local/build.sh` (pinned in "
                    "deploy/local/versions.env), set HELM=/path/to/helm or put helm on PATH; "
                    f"or set {SKIP_ENV}=1 to skip the chart tests", pytrace=False)
    return exe


def _run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    exe = _find_helm()
    assert exe, "helm not found"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache", "HELM_CONFIG_HOME": "/tmp/helm-config"})


@functools.cache
def _render(sets: tuple[str, ...] = (), namespace: str = "moe-system", release: str = "moe") -> tuple[dict, ...]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    proc = _run_helm(*args)
    assert proc.returncode == 0, f"helm template {sets} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def render(helm, *sets: str, **kw) -> list[dict]:
    return list(_render(tuple(sets), **kw))


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind):
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def operator_container(docs):
    dep = one(docs, "Deployment")
    return dep["spec"]["template"]["spec"]["containers"][0]


# ------------------------------------------------------------------------- files, no helm needed
def test_chart_crd_is_the_generated_crd():
    committed = (CHART / "files" / "moedeployments.crd.yaml").read_text()
    assert committed == crd_yaml(), "charts/moe-operator/files/moedeployments.crd.yaml is stale: run deploy/render-manifests.sh"
    assert not (CHART / "crds" / "moedeployments.yaml").exists(), "crds/ is installed once and never upgraded"


def test_the_crd_is_a_template_helm_upgrades_and_keeps(helm):
    """issue 26 item 4: the MoEDeployment CRD is rendered from the generated file (so `helm upgrade`
    applies a schema change), with helm.sh/resource-policy keep (an uninstall never deletes it, nor
    so every MoEDeployment); crds.install=false leaves it out (the releases that do not own it)."""
    docs = render(helm)
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert [c["metadata"]["name"] for c in crds] == ["moedeployments.moe.serving.dev"]
    meta = crds[0].pop("metadata")
    assert meta["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    want = yaml.safe_load(crd_yaml())
    assert want.pop("metadata") == {"name": meta["name"]} and crds[0] == want
    assert not [d for d in render(helm, "crds.install=false") if d["kind"] == "CustomResourceDefinition"]


def test_kopf_peering_crds_match_what_kopf_looks_for():
    docs = [d for d in yaml.safe_load_all((CHART / "crds" / "kopf-peerings.yaml").read_text()) if d]
    by_plural = {d["spec"]["names"]["plural"]: d for d in docs}
    assert set(by_plural) == {"clusterkopfpeerings", "kopfpeerings"}
    assert by_plural["clusterkopfpeerings"]["spec"]["scope"] == "Cluster"
    assert by_plural["kopfpeerings"]["spec"]["scope"] == "Namespaced"
    try:
        from kopf._cogs.structs import references as kref
    except ImportError:  # kopf's private module moved: the names above are still checked
        return
    for sel in (kref.CLUSTER_PEERINGS_K, kref.NAMESPACED_PEERINGS_K):
        plural = sel.plural or sel.any_name
        d = by_plural[plural]
        assert d["spec"]["group"] == sel.group
        assert [v["name"] for v in d["spec"]["versions"]] == [sel.version]
        assert d["metadata"]["name"] == f"{plural}.{sel.group}"


def test_chart_versions_follow_the_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == moe_operator.__version__ == images.RUNTIME_VERSION == "0.1.0"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["runtimeImage"]["repository"] == images.RUNTIME_REPOSITORY
    assert values["replicas"] == 1 and values["watchNamespaces"] == []


def test_values_schema_is_strict():
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node, path):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                assert node.get("additionalProperties") is False, f"{path} accepts unknown keys"
            for k, v in node.items():
                walk(v, f"{path}/{k}")

    walk(schema, "")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) == set(schema["properties"]) - {"global"}, "values.yaml and values.schema.json disagree"


def test_dockerfiles():
    op = (ROOT / "deploy" / "Dockerfile.operator").read_text()
    assert re.search(r"^ARG PYTHON_VERSION=3\.11$", op, re.M) and "FROM python:${PYTHON_VERSION}-slim" in op
    assert "pip install /dist/moe_operator-*.whl" in op and "[runtime" not in op and "torch must not be" in op
    assert re.search(r"^USER 65532", op, re.M)
    rt = (ROOT / "deploy" / "Dockerfile.runtime").read_text()
    # the flashinfer the image installs is the one the planner assumes the bundled image has
    assert f"ARG FLASHINFER_VERSION={images.BUNDLED_FLASHINFER}\n" in rt
    assert "ARG CUDA_MAJOR=12" in rt and "FROM cuda${CUDA_MAJOR}" in rt
    assert 'extras=runtime,flashinfer' in rt and "extras=runtime;" in rt
    assert re.search(r"^USER 65532", rt, re.M)
    # the documented tag scheme is the one images.runtime_image produces
    assert f"{images.RUNTIME_REPOSITORY}:<version>-cu<CUDA_MAJOR>[-flashinfer][-arm64]" in rt
    hadolint = shutil.which("hadolint")
    if hadolint:
        proc = subprocess.run([hadolint, str(ROOT / "deploy" / "Dockerfile.operator"),
                               str(ROOT / "deploy" / "Dockerfile.runtime")], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerignore_keeps_the_build_context_small():
    lines = (ROOT / ".dockerignore").read_text().split()
    assert lines.count("**") == 1
    for keep in ("!pyproject.toml", "!operator/", "!runtime/", "!kernels/"):
        assert keep in lines


# ------------------------------------------------------------------------------- helm lint etc.
@pytest.mark.parametrize("sets", [
    (),
    ("replicas=3", "watchNamespaces={team-a,team-b}", "nodeProbe.enabled=true",
     "metrics.serviceMonitor.enabled=true", "logLevel=debug", "policy.allowedHostPaths={/models}",
     "webhook.certManager=true", "rbac.secrets.resourceNames={hf}"),
    ("rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=existing",
     "metrics.enabled=false", "nodeProbe.enabled=true", "nodeProbe.serviceAccount.create=false"),
], ids=["defaults", "everything-on", "bring-your-own-rbac"])
def test_helm_lint_strict(helm, sets):
    set_args = [a for s in sets for a in ("--set", s)]
    for strict in ([], ["--strict"]):
        proc = _run_helm("lint", str(CHART), *strict, *set_args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("bad,where", [
    ("logLevel=verbose", "logLevel"),
    ("defaultEngine=sglang", "defaultEngine"),   # removed: the CRD defaults spec.engine.name
    ("policy.allowedHostPaths={relative}", "allowedHostPaths"),
    ("webhook.certManager=maybe", "certManager"),
    ("replicas=-1", "replicas"),
    ("replicas=two", "replicas"),
    ("watchNamespaces={Not_A_Namespace}", "watchNamespaces"),
    ("surprise=1", "surprise"),
    ("image.pullPolicy=Sometimes", "pullPolicy"),
    ("image.tag=has space", "tag"),
    ("metrics.port=0", "port"),
    ("metrics.service.type=ExternalName", "type"),
    ("nodeProbe.architectures={ppc64le}", "architectures"),
    ("nodeProbe.intervalSeconds=5", "intervalSeconds"),
    ("nodeProbe.enabeld=true", "enabeld"),
    ("resources.limits.memory=lots", "memory"),
])
def test_values_schema_rejects_bad_values(helm, bad, where):
    proc = _run_helm("template", "x", str(CHART), "--set", bad)
    assert proc.returncode != 0, f"--set {bad} was accepted"
    assert "schema" in proc.stderr and where in proc.stderr, proc.stderr


@pytest.mark.parametrize("replicas,leader", [(0, False), (1, False), (2, True), (5, True)])
def test_leader_election_iff_more_than_one_replica(helm, replicas, leader):
    docs = render(helm, f"replicas={replicas}")
    args = operator_container(docs)["args"]
    assert args[0] == "run"
    assert ("--peering=moe-moe-operator" in args) is leader
    assert ("--standalone" in args) is (not leader)
    assert one(docs, "Deployment")["spec"]["replicas"] == replicas
    peerings = of_kind(docs, "ClusterKopfPeering")
    assert len(peerings) == (1 if leader else 0)
    assert not of_kind(docs, "KopfPeering")
    if leader:
        assert peerings[0]["metadata"]["name"] == "moe-moe-operator"
    else:  # a lone operator never runs next to its successor during a rollout
        assert one(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}


def test_leader_election_per_watched_namespace(helm):
    docs = render(helm, "replicas=2", "watchNamespaces={a,b}", "leaderElection.peeringName=moe-lock")
    args = operator_container(docs)["args"]
    assert "--peering=moe-lock" in args and "--standalone" not in args
    assert not of_kind(docs, "ClusterKopfPeering")
    assert sorted((p["metadata"]["namespace"], p["metadata"]["name"]) for p in of_kind(docs, "KopfPeering")) == [
        ("a", "moe-lock"), ("b", "moe-lock")]


def test_operator_deployment(helm):
    docs = render(helm, "watchNamespaces={team-a,team-b}", "logLevel=debug",
                  "runtimeImage.repository=registry.local/moe-runtime", "image.tag=dev")
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = operator_container(docs)
    assert c["image"] == "ghcr.io/moe-operator/moe-operator:dev"
    assert c["command"] == ["moe-operator"]
    args = c["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    for a in ("--metrics-port=9090", "--log-level=debug",
              "--runtime-image=registry.local/moe-runtime", "--liveness=http://0.0.0.0:8080/healthz"):
        assert a in args
    env = {e["name"]: e for e in c["env"]}
    assert env["MOE_OPERATOR_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 9090, "health": 8080, "webhook": 9443}
    # non-root, read-only root filesystem, nothing extra
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # default image tag is the appVersion
    assert operator_container(render(helm))["image"] == "ghcr.io/moe-operator/moe-operator:0.1.0"


def test_everything_is_namespaced_to_the_release(helm):
    docs = render(helm, "nodeProbe.enabled=true", "metrics.serviceMonitor.enabled=true", namespace="ops")
    for d in docs:
        if d["kind"] in ("ServiceAccount", "Deployment", "Service", "ServiceMonitor", "DaemonSet"):
            assert d["metadata"]["namespace"] == "ops", d["kind"]
    for b in of_kind(docs, "ClusterRoleBinding"):
        assert all(s["namespace"] == "ops" for s in b["subjects"])


# ----------------------------------------------------------------------------------------- RBAC
# What the operator uses (issue 4 / the operator's API calls): resource -> verbs.
# What the operator's code uses (operator/moe_operator/permissions.py): the chart grants exactly that.
NAMESPACED_PERMS = {k: set(v) for k, (v, _) in permissions.NAMESPACED.items()}
CLUSTER_PERMS = {k: set(v) for k, (v, _) in permissions.CLUSTER.items()}
WEBHOOK_PERMS = {k: set(v) for k, (v, _) in permissions.WEBHOOK.items()}
PEERING_VERBS = set(permissions.PEERING_VERBS)
LEDGER_PERMS = {k: set(v) for k, (v, _) in permissions.LEDGER.items()}


def perms(rules) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for r in rules:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                out.setdefault((g, res), set()).update(r["verbs"])
    return out


def test_rbac_has_no_wildcards(helm):
    for sets in [(), ("replicas=2",), ("watchNamespaces={a}", "replicas=2", "nodeProbe.enabled=true")]:
        for d in render(helm, *sets):
            if d["kind"] in ("ClusterRole", "Role"):
                for r in d["rules"]:
                    for key in ("apiGroups", "resources", "verbs"):
                        assert "*" not in r.get(key, []), f"{d['kind']} {d['metadata']['name']}: {r}"
                    assert "nonResourceURLs" not in r
                    # names only where the chart knows them: its own webhook configuration, the
                    # model cache ledger's ConfigMap (test_cache_ledger_rbac.py)
                    assert "resourceNames" not in r or r["resources"] == ["validatingwebhookconfigurations"] \
                        or (perms([r]) == LEDGER_PERMS and len(r["resourceNames"]) == 1
                            and r["resourceNames"][0].endswith(permissions.LEDGER_NAME_SUFFIX))


def test_rbac_secrets_can_be_narrowed_or_dropped(helm):
    role = one(render(helm, "rbac.secrets.resourceNames={hf-token}"), "ClusterRole")
    (rule,) = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    assert rule["resourceNames"] == ["hf-token"] and rule["verbs"] == ["get"]
    role = one(render(helm, "rbac.secrets.enabled=false"), "ClusterRole")
    assert not [r for r in role["rules"] if "secrets" in r["resources"]]


def test_webhook_ships_on_by_default_and_fails_open(helm):
    from moe_operator.webhook import HANDLER_ID

    docs = render(helm)
    vwc = one(docs, "ValidatingWebhookConfiguration")
    (hook,) = vwc["webhooks"]
    assert hook["failurePolicy"] == "Ignore" and hook["timeoutSeconds"] <= 10
    assert hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]   # never DELETE
    svc = next(d for d in of_kind(docs, "Service") if d["metadata"]["name"].endswith("-webhook"))
    assert hook["clientConfig"]["service"] == {"name": svc["metadata"]["name"], "namespace": "moe-system",
                                                "port": 9443, "path": f"/{HANDLER_ID}"}
    args = operator_container(docs)["args"]
    host = f"{svc['metadata']['name']}.moe-system.svc"
    assert f"--admission={host}:9443" in args and "--admission-listen=0.0.0.0" in args
    assert f"--admission-configuration={vwc['metadata']['name']}" in args
    assert not [a for a in args if a.startswith("--admission-cert-dir")]   # no cert-manager: the operator's CA
    role = one(docs, "ClusterRole")
    (rule,) = [r for r in role["rules"] if r["resources"] == ["validatingwebhookconfigurations"]]
    assert rule["resourceNames"] == [vwc["metadata"]["name"]]
    # with cert-manager: its Certificate, the Secret mounted, the CA injected, no RBAC on the configuration
    docs = render(helm, "webhook.certManager=true")
    cert = one(docs, "Certificate")
    assert cert["spec"]["dnsNames"] == [host]
    assert one(docs, "ValidatingWebhookConfiguration")["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] \
        == f"moe-system/{cert['metadata']['name']}"
    assert "--admission-cert-dir=/etc/moe-operator/webhook" in operator_container(docs)["args"]
    assert not [r for r in one(docs, "ClusterRole")["rules"] if r["resources"] == ["validatingwebhookconfigurations"]]
    assert not of_kind(render(helm, "webhook.enabled=false"), "ValidatingWebhookConfiguration")


def test_chart_refuses_clusters_older_than_its_api_needs(helm):
    # the CRD's CEL quantity library is 1.28; an older API server would refuse the CRD at install
    old = _run_helm("template", "x", str(CHART), "--kube-version", "1.27.9")
    assert old.returncode != 0 and "kubeVersion" in old.stderr, old.stderr
    assert _run_helm("template", "x", str(CHART), "--kube-version", "1.28.0").returncode == 0


def test_several_replicas_share_the_charts_webhook_certificate(helm, tmp_path):
    """Without cert-manager, several replicas cannot each make a CA (each would overwrite the
    caBundle the others' certificates need): the chart makes one, mounted by all, CA in the bundle."""
    import base64

    docs = render(helm, "replicas=2")
    secret = next(d for d in of_kind(docs, "Secret") if d["metadata"]["name"].endswith("-webhook-tls"))
    assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    (hook,) = one(docs, "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    dep = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert "--admission-cert-dir=/etc/moe-operator/webhook" in dep["containers"][0]["args"]
    assert {"name": "webhook-cert", "secret": {"secretName": secret["metadata"]["name"]}} in dep["volumes"]
    assert not [r for r in one(docs, "ClusterRole")["rules"] if r["resources"] == ["validatingwebhookconfigurations"]]
    for k, v in secret["data"].items():
        (tmp_path / k).write_bytes(base64.b64decode(v))
    # the serving certificate chains to the CA and names the Service host the API server dials
    ok = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    san = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "tls.crt")],
                         capture_output=True, text=True).stdout
    assert "DNS:moe-moe-operator-webhook.moe-system.svc" in san, san
    # one replica keeps the operator-made CA; cert-manager keeps its own Secret
    assert not [d for d in of_kind(render(helm), "Secret") if d["metadata"]["name"].endswith("-webhook-tls")]
    assert not [d for d in of_kind(render(helm, "replicas=2", "webhook.certManager=true"), "Secret")
                if d["metadata"]["name"].endswith("-webhook-tls")]


def test_policy_values_become_flags(helm):
    args = operator_container(render(helm, "policy.allowedHostPaths={/models,/data}",
                                     "policy.allowedImageRegistries={docker.io/lmsysorg}",
                                     "policy.requireTokenSecretLabel=false", "policy.engineCacheHostPath=/var/cache/moe"))["args"]
    for a in ("--allow-host-path=/models", "--allow-host-path=/data", "--allow-image-registry=docker.io/lmsysorg",
              "--no-token-secret-label", "--engine-cache-host-path=/var/cache/moe"):
        assert a in args
    assert not [a for a in operator_container(render(helm))["args"] if a.startswith("--allow-host-path")]


def test_rbac_cluster_wide(helm):
    docs = render(helm)
    # the one Role: the model cache ledger's, in the release namespace (test_cache_ledger_rbac.py)
    assert [r["metadata"]["name"] for r in of_kind(docs, "Role") + of_kind(docs, "RoleBinding")] == \
        ["moe-moe-operator-cache-ledger"] * 2
    role = one(docs, "ClusterRole")
    assert perms(role["rules"]) == {**CLUSTER_PERMS, **NAMESPACED_PERMS, **WEBHOOK_PERMS}
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = one(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "moe-system"}]
    leader = one(render(helm, "replicas=2"), "ClusterRole")
    assert perms(leader["rules"])[("kopf.dev", "clusterkopfpeerings")] == PEERING_VERBS


def test_rbac_watched_namespaces(helm):
    docs = render(helm, "watchNamespaces={a,b}", "replicas=2")
    cluster = one(docs, "ClusterRole")
    # cluster-wide only what is cluster-scoped: no secrets, workloads or namespaces outside a and b;
    # two replicas share the chart's webhook certificate, so none patches the configuration's CA
    assert perms(cluster["rules"]) == CLUSTER_PERMS
    ledger = lambda d: d["metadata"]["name"].endswith("-cache-ledger")  # noqa: E731  (test_cache_ledger_rbac.py)
    roles = [r for r in of_kind(docs, "Role") if not ledger(r)]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["a", "b"]
    for role in roles:
        assert perms(role["rules"]) == {**NAMESPACED_PERMS, ("kopf.dev", "kopfpeerings"): PEERING_VERBS}
    bindings = [b for b in of_kind(docs, "RoleBinding") if not ledger(b)]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["a", "b"]
    for b in bindings:
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": roles[0]["metadata"]["name"]}
        assert b["subjects"][0]["namespace"] == "moe-system"


def test_rbac_can_be_left_to_the_user(helm):
    docs = render(helm, "rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=mine")
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount")]
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "mine"


# ------------------------------------------------------------------------------ metrics, probe
def metrics_service(docs):
    (svc,) = [d for d in of_kind(docs, "Service") if d["metadata"]["name"].endswith("-metrics")]
    return svc


def test_metrics_service_and_service_monitor(helm):
    docs = render(helm)
    svc = metrics_service(docs)
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert not of_kind(docs, "ServiceMonitor")
    docs = render(helm, "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom")
    sm = one(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    svc = metrics_service(docs)
    assert all(svc["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    webhook_svc = next(d for d in of_kind(docs, "Service") if d["metadata"]["name"].endswith("-webhook"))
    assert not all(webhook_svc["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert not of_kind(render(helm, "metrics.enabled=false", "metrics.serviceMonitor.enabled=true"), "ServiceMonitor")


def test_node_probe(helm):
    assert not of_kind(render(helm), "DaemonSet")
    docs = render(helm, "nodeProbe.enabled=true")
    dss = {d["metadata"]["name"]: d for d in of_kind(docs, "DaemonSet")}
    assert set(dss) == {"moe-moe-operator-node-probe-amd64", "moe-moe-operator-node-probe-arm64"}
    sa = next(d for d in of_kind(docs, "ServiceAccount") if d["metadata"]["name"].endswith("node-probe"))
    role = next(d for d in of_kind(docs, "ClusterRole") if d["metadata"]["name"].endswith("node-probe"))
    assert perms(role["rules"]) == {("", "nodes"): {"get", "patch"}}
    binding = next(d for d in of_kind(docs, "ClusterRoleBinding") if d["metadata"]["name"].endswith("node-probe"))
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"]
    for arch, ds in (("amd64", dss["moe-moe-operator-node-probe-amd64"]), ("arm64", dss["moe-moe-operator-node-probe-arm64"])):
        pod = ds["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == sa["metadata"]["name"]
        c = pod["containers"][0]
        suffix = "-arm64" if arch == "arm64" else ""
        assert c["image"] == f"{images.RUNTIME_REPOSITORY}:{images.RUNTIME_VERSION}-cu12{suffix}"
        assert "moe-runtime probe --annotate-node \"$NODE_NAME\"" in c["args"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        exprs = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"]
        assert {"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"} in exprs
        assert {"key": "kubernetes.io/arch", "operator": "In", "values": [arch]} in exprs
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        sel = ds["spec"]["selector"]["matchLabels"]
        assert all(ds["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())
    # the two DaemonSets must not select each other's pods
    sels = [frozenset(d["spec"]["selector"]["matchLabels"].items()) for d in dss.values()]
    assert sels[0] != sels[1]


def _notes(tmp_path, *sets: str) -> str:
    """NOTES.txt as `helm install` prints it, without a cluster: a copy of the chart gets one
    more template that includes NOTES.txt as a YAML string."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text(
        'notes: |\n{{ include (print $.Template.BasePath "/NOTES.txt") . | indent 2 }}\n')
    args = [a for s in sets for a in ("--set", s)]
    proc = _run_helm("template", "moe", str(chart), "-n", "moe-system", "--show-only", "templates/zz-notes.yaml", *args)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)["notes"]


def test_notes_tell_what_to_do_next(helm, tmp_path):
    notes = _notes(tmp_path)
    for needle in ("kubectl get moed", "kubectl apply -f deploy/samples/", "kubectl describe moed",
                   "conditions", "rollout status deployment/moe-moe-operator", "Watching: all namespaces",
                   "nodeProbe.enabled=true"):
        assert needle in notes, f"NOTES.txt lacks {needle!r}:\n{notes}"
    for sample in re.findall(r"deploy/samples/(\S+\.yaml)", notes):  # the golden path: no file:// demo sample
        assert (ROOT / "deploy" / "samples" / sample).is_file(), f"NOTES.txt names a missing sample {sample}"
        assert "file://" not in (ROOT / "deploy" / "samples" / sample).read_text(), sample
    notes = _notes(tmp_path / "ns", "watchNamespaces={team-a}", "replicas=2")
    assert "kubectl apply -n team-a -f" in notes and "leader election" in notes and "team-a" in notes


# ------------------------------------------------------------------------------ plain manifests
def test_plain_manifests_are_rendered_from_the_chart(helm):
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "render-manifests.sh"), "--check"],
                          capture_output=True, text=True, env={**os.environ, "HELM": helm}, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\nrun deploy/render-manifests.sh"


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((ROOT / "deploy" / "kustomization.yaml").read_text())
    files = sorted(p.name for p in (ROOT / "deploy" / "manifests").glob("*.yaml"))
    assert [Path(r).name for r in k["resources"]] == files
    docs = [d for f in files for d in yaml.safe_load_all((ROOT / "deploy" / "manifests" / f).read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds[0] == "Namespace" and kinds.count("CustomResourceDefinition") == 3
    assert not any(d["metadata"].get("labels", {}).get("app.kubernetes.io/managed-by") == "Helm" for d in docs)
    crd = next(d for d in docs if d["metadata"]["name"] == "moedeployments.moe.serving.dev")
    assert crd == yaml.safe_load(crd_yaml())


def test_helm_package_carries_the_crds(helm, tmp_path):
    proc = _run_helm("package", str(CHART), "-d", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    import tarfile

    (tgz,) = tmp_path.glob("moe-operator-*.tgz")
    with tarfile.open(tgz) as t:
        names = set(t.getnames())
        crd_text = t.extractfile("moe-operator/files/moedeployments.crd.yaml").read().decode()
    assert {"moe-operator/crds/kopf-peerings.yaml", "moe-operator/values.schema.json",
            "moe-operator/templates/crd-moedeployments.yaml",
            "moe-operator/templates/NOTES.txt", "moe-operator/README.md"} <= names
    assert crd_text == crd_yaml()


def test_model_cache_copy_groups_reach_the_operator_and_are_checked(helm):
    """modelCache.copySupplementalGroups -> --model-cache-copy-groups (the pvc:// copy Jobs'
    supplementalGroups); none by default; 0 (root's group) refused by the schema and by the flag."""
    import argparse

    from moe_operator import run_cli
    args = operator_container(render(helm, "modelCache.copySupplementalGroups={2000,3000}"))["args"]
    assert "--model-cache-copy-groups=2000,3000" in args
    assert not [a for a in operator_container(render(helm))["args"] if a.startswith("--model-cache-copy-groups")]
    assert _run_helm("template", "moe", str(CHART), "--set", "modelCache.copySupplementalGroups={0}").returncode != 0
    assert run_cli._gids("2000,3000") == (2000, 3000)
    with pytest.raises(argparse.ArgumentTypeError):
        run_cli._gids("0")


def test_policy_on_violation_reaches_the_operator(helm):
    assert not [a for a in operator_container(render(helm))["args"] if a.startswith("--on-policy-violation")]
    args = operator_container(render(helm, "policy.onViolation=scaleToZero"))["args"]
    assert "--on-policy-violation=scaleToZero" in args
    bad = _run_helm("template", "x", str(CHART), "--set", "policy.onViolation=delete")
    assert bad.returncode != 0 and "onViolation" in bad.stderr
