"""The chart's dashboard, alert rules and prometheus-adapter rules (issue 32 item 6), rendered by
helm: each gated by its value, and every PromQL expression parsed by Prometheus's own parser
(tests/unit/operator/promql_check, github.com/prometheus/prometheus/promql/parser) and naming only
metrics something exports: the operator's registry (moe_operator.metrics, condition_metrics), the
bundled runtime's (moe_runtime.metrics, the vllm:* twins included), sglang's names the autoscaler
uses (each Engine's `metrics`, engines/registry.py), the kube-apiserver's admission metric read from the k8s.io/apiserver
release the local control plane is built from, and Prometheus's own `up`; and the labels each
selector matches, each aggregation groups by and each legend shows are labels those metrics carry
(their registries' label names, `le` of histogram buckets, or the target labels a scrape adds).

Needs helm (as tests/unit/operator/test_chart.py finds it) and Go; without them these FAIL saying
so, unless MOE_SKIP_INTEGRATION=1 (then they skip)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "moe-operator"
PROMQL = Path(__file__).parent / "promql_check"
ALL_ON = ("grafanaDashboard.enabled=true", "prometheusRule.enabled=true", "prometheusAdapter.enabled=true",
          "metrics.serviceMonitor.enabled=true")


def _missing(what: str):
    if os.environ.get("MOE_SKIP_INTEGRATION") == "1":
        pytest.skip(f"{what} not found and MOE_SKIP_INTEGRATION=1")
    pytest.fail(f"{what} not found (or set MOE_SKIP_INTEGRATION=1 to skip)", pytrace=False)


@functools.cache
def _helm() -> str | None:
    if os.environ.get("HELM"):
        return os.environ["HELM"] if os.access(os.environ["HELM"], os.X_OK) else None
    try:
        from moe_operator.devcluster.binaries import BuildError, ensure_binaries
        try:
            return str(ensure_binaries(build=False).helm)
        except BuildError:
            pass
    except ImportError:
        pass
    return shutil.which("helm")


@functools.cache
def render(sets: tuple[str, ...] = ()) -> tuple[dict, ...]:
    exe = _helm()
    if exe is None:
        _missing("helm")
    args = [exe, "template", "moe", str(CHART), "--namespace", "moe-system"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache", "HELM_CONFIG_HOME": "/tmp/helm-config"})
    assert r.returncode == 0, r.stderr
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def find(docs, kind: str, suffix: str = "") -> list[dict]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]


# ------------------------------------------------------------------------ metric names that exist
def _exported(registry) -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"),
                "gauge": ("",), "info": ("_info",)}
    return {fam.name + s for fam in registry.collect() for s in suffixes.get(fam.type, ("",))}


def _apiserver_admission_metrics() -> set[str]:
    """apiserver_admission_* counters of the kube-apiserver release the dev cluster builds
    (deploy/local/versions.env KUBE_STAGING_VERSION), from its k8s.io/apiserver module's
    pkg/admission/metrics/metrics.go."""
    env = dict(line.split("=", 1) for line in (ROOT / "deploy/local/versions.env").read_text().splitlines()
               if "=" in line and not line.startswith("#"))
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(["go", "mod", "download", "-json", f"k8s.io/apiserver@{env['KUBE_STAGING_VERSION']}"],
                           cwd=tmp, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    src = (Path(json.loads(r.stdout)["Dir"]) / "pkg/admission/metrics/metrics.go").read_text()
    assert 'namespace = "apiserver"' in src and 'subsystem = "admission"' in src
    return {"apiserver_admission_" + n for n in re.findall(r'Name:\s+"([a-z_]+)"', src)}


@pytest.fixture(scope="module")
def known() -> set[str]:
    if shutil.which("go") is None:
        _missing("go")
    from prometheus_client import REGISTRY

    import moe_operator.condition_metrics  # noqa: F401 - registers its gauge
    import moe_operator.metrics  # noqa: F401
    from moe_operator.engines.registry import REGISTRY as ENGINES
    from moe_runtime.metrics import Metrics

    operator = {n for n in _exported(REGISTRY) if n.startswith("moe_operator_")}
    runtime = _exported(Metrics("m").registry)
    sglang = {v for v in ENGINES["sglang"].metrics.values()}
    return operator | runtime | sglang | _apiserver_admission_metrics() | {"up"}


# what Prometheus (through prometheus-operator's ServiceMonitor / PodMonitor) adds to every scraped series
TARGET_LABELS = frozenset({"job", "instance", "namespace", "service", "pod", "container", "endpoint"})


def _labelnames(registry) -> dict[str, frozenset[str]]:
    """Exported sample name -> the label names of its series, from the collectors' own label names."""
    out = {}
    for collector, names in registry._collector_to_names.items():
        own = frozenset(getattr(collector, "_labelnames", ()))
        for n in names:
            out[n] = own | ({"le"} if n.endswith("_bucket") else set())
    return out


@pytest.fixture(scope="module")
def labels_of() -> dict[str, frozenset[str]]:
    """Label names per metric for the metrics whose registry is here (the operator's, the bundled
    runtime's); sglang's, the kube-apiserver's and `up` are not checked label by label."""
    from prometheus_client import REGISTRY

    import moe_operator.condition_metrics  # noqa: F401
    import moe_operator.metrics  # noqa: F401
    from moe_runtime.metrics import Metrics

    ours = {n: v for n, v in _labelnames(REGISTRY).items() if n.startswith("moe_operator_")}
    return ours | _labelnames(Metrics("m").registry)


def check_labels(exe: Path, labels_of: dict[str, frozenset[str]], exprs: list[str],
                 legends: list[str | None] | None = None) -> None:
    """Every label an expression matches on or groups by, and each {{label}} of its legend, is one
    its metrics carry (a dashboard grouping by a label the metric lacks shows one unnamed series)."""
    legends = legends or [None] * len(exprs)
    for expr, legend, res in zip(exprs, legends, parse(exe, exprs)):
        res = {k: res.get(k) or [] for k in ("selectors", "groupings")}  # Go writes an empty list as null
        for sel in res["selectors"]:
            if sel["metric"] in labels_of:
                unknown = set(sel["labels"]) - labels_of[sel["metric"]] - TARGET_LABELS
                assert not unknown, f"{expr}: {sel['metric']} has no label {sorted(unknown)}"
        carried: set[str] = set()
        for g in res["groupings"]:
            known = [labels_of[m] for m in g["metrics"] if m in labels_of]
            if not known or g["without"]:
                continue
            have = frozenset().union(*known) | TARGET_LABELS
            assert not set(g["by"]) - have, f"{expr}: grouped by {sorted(set(g['by']) - have)}, not a label of {g['metrics']}"
        if res["groupings"] and not res["groupings"][0]["without"]:
            carried = set(res["groupings"][0]["by"])  # the outermost aggregation's labels reach the legend
        elif all(s["metric"] in labels_of for s in res["selectors"]):
            carried = set().union(*(labels_of[s["metric"]] for s in res["selectors"])) | TARGET_LABELS
        else:
            continue
        shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend or ""))
        assert not shown - carried, f"{expr}: legend {legend!r} shows {sorted(shown - carried)}, which the query does not keep"


@pytest.fixture(scope="module")
def promql() -> Path:
    go = shutil.which("go")
    if go is None:
        _missing("go")
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in sorted(PROMQL.iterdir()))).hexdigest()[:16]
    exe = Path.home() / ".cache" / "moe-operator" / "promql-check" / digest / "promql-check"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([go, "build", "-o", str(exe), "."], cwd=PROMQL, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr
    return exe


def parse(exe: Path, exprs: list[str]) -> list[dict]:
    r = subprocess.run([str(exe)], input=json.dumps(exprs), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def check_exprs(exe: Path, known: set[str], exprs: list[str]) -> set[str]:
    """Every expression parses and names only known metrics; returns the names."""
    assert exprs
    names: set[str] = set()
    for expr, res in zip(exprs, parse(exe, exprs)):
        assert not res.get("error"), (expr, res["error"])
        assert res["metrics"], expr
        unknown = set(res["metrics"]) - known
        assert not unknown, f"{expr}: {sorted(unknown)} not exported by anything"
        names |= set(res["metrics"])
    return names


# ------------------------------------------------------------------------------------- gating
def test_off_by_default_and_each_gated_alone():
    names = lambda docs: {(d["kind"], d["metadata"]["name"]) for d in docs}  # noqa: E731
    base = names(render())
    assert not {k for k, _ in base} & {"PrometheusRule"}
    assert not {n for _, n in base} & {"moe-moe-operator-dashboard", "moe-moe-operator-prometheus-adapter"}
    added = {s: names(render((s,))) - base for s in ALL_ON[:3]}
    assert added == {"grafanaDashboard.enabled=true": {("ConfigMap", "moe-moe-operator-dashboard")},
                     "prometheusRule.enabled=true": {("PrometheusRule", "moe-moe-operator")},
                     "prometheusAdapter.enabled=true": {("ConfigMap", "moe-moe-operator-prometheus-adapter")}}


def test_the_schema_refuses_a_bad_duration():
    exe = _helm() or _missing("helm")
    r = subprocess.run([exe, "template", "moe", str(CHART), "--set", "prometheusRule.degradedFor=ten"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache", "HELM_CONFIG_HOME": "/tmp/helm-config"})
    assert r.returncode != 0 and "degradedFor" in r.stderr


# ------------------------------------------------------------------------------------ dashboard
def _panel_exprs(dashboard: dict) -> list[str]:
    out = []
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            # Grafana's variables, as Grafana substitutes them, before Prometheus parses the query
            out.append(t["expr"].replace("$__rate_interval", "5m").replace("$namespace", ".*"))
    return out


def _panel_legends(dashboard: dict) -> list[str | None]:
    return [t.get("legendFormat") for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_name_exported_metrics(promql, known, labels_of):
    (cm,) = find(render(ALL_ON), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["moe-operator.json"])
    assert dashboard == json.loads((CHART / "files/grafana/moe-operator.json").read_text())
    names = check_exprs(promql, known, _panel_exprs(dashboard))
    check_labels(promql, labels_of, _panel_exprs(dashboard), _panel_legends(dashboard))
    # what the issue asks the dashboard to show: decisions, free GPUs per class, latency, queue, KV
    assert {"moe_operator_decisions_total", "moe_operator_gpu_class_free_gpus", "vllm:e2e_request_latency_seconds_bucket",
            "vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= names
    # decisions per GPU class (issue 32 item 6): the class the plan chose, as status.gpuClass names it
    decisions = [e for e in _panel_exprs(dashboard) if "moe_operator_decisions_total" in e]
    assert decisions and all(g["by"] and "gpu_class" in g["by"] for r in parse(promql, decisions)
                             for g in r["groupings"]), decisions
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    var = next(v for v in dashboard["templating"]["list"] if v["name"] == "namespace")
    check_exprs(promql, known, [re.sub(r"label_values\((\S+), \w+\)", r"\1", var["query"]["query"])])


# ---------------------------------------------------------------------------------------- alerts
def test_alert_rules(promql, known, labels_of):
    docs = render(ALL_ON)
    (rule,) = find(docs, "PrometheusRule")
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    alerts = {r["alert"]: r for r in rules}
    assert set(alerts) == {"MoEDeploymentDegraded", "MoEDeploymentStalled", "MoEModelCacheFailed",
                           "MoEDeploymentRolloutStuck", "MoEOperatorDown", "MoEOperatorWebhookNotServing"}
    check_exprs(promql, known, [r["expr"] for r in rules])
    check_labels(promql, labels_of, [r["expr"] for r in rules])
    assert alerts["MoEDeploymentDegraded"]["for"] == "10m" and alerts["MoEDeploymentRolloutStuck"]["for"] == "30m"
    assert 'reason="Failed"' in alerts["MoEModelCacheFailed"]["expr"]
    # the names in the rules are the chart's own: the metrics Service (the ServiceMonitor's job) and the webhook
    (svc,) = find(docs, "Service", "-metrics")
    assert f'job="{svc["metadata"]["name"]}"' in alerts["MoEOperatorDown"]["expr"]
    (vwc,) = find(docs, "ValidatingWebhookConfiguration")
    assert f'name="{vwc["webhooks"][0]["name"]}"' in alerts["MoEOperatorWebhookNotServing"]["expr"]
    for r in rules:  # Prometheus templates survive helm's
        assert "{{ $labels." in r["annotations"]["summary"] or r["alert"].startswith("MoEOperator"), r
    # values reach the rules; the webhook alert goes with the webhook
    (quick,) = find(render(ALL_ON + ("prometheusRule.degradedFor=3m", "webhook.enabled=false")), "PrometheusRule")
    alerts = {r["alert"]: r for g in quick["spec"]["groups"] for r in g["rules"]}
    assert alerts["MoEDeploymentDegraded"]["for"] == "3m" and "MoEOperatorWebhookNotServing" not in alerts


def test_check_labels_catches_a_label_the_metric_lacks(promql, labels_of):
    """The check above fails on what the dashboard did before the decisions counter had the class."""
    check_labels(promql, labels_of, ["sum by (gpu_class) (moe_operator_gpu_class_free_gpus)"], ["{{gpu_class}}"])
    with pytest.raises(AssertionError, match="grouped by"):
        check_labels(promql, labels_of, ["sum by (gpu_model) (increase(moe_operator_decisions_total[5m]))"])
    with pytest.raises(AssertionError, match="has no label"):
        check_labels(promql, labels_of, ['moe_operator_reconciles_total{gpu_class="x"}'])
    with pytest.raises(AssertionError, match="legend"):
        check_labels(promql, labels_of, ["sum by (engine) (moe_operator_decisions_total)"], ["{{gpu_class}}"])
    assert {"engine", "gpu_family", "gpu_class", "backend"} <= labels_of["moe_operator_decisions_total"]


def test_alerts_read_the_conditions_the_operator_exports():
    """The series the rules select exist once the operator exports an object's conditions, with
    the labels the rules match on; a change of status replaces the series."""
    from prometheus_client import REGISTRY

    from moe_operator import condition_metrics as cm

    def value(**labels):
        return REGISTRY.get_sample_value("moe_operator_moedeployment_condition", labels)

    cm.observe("ns", "m", [{"type": "ModelCacheReady", "status": "False", "reason": "Failed"},
                           {"type": "Progressing", "status": "True", "reason": "WaitingForCapacity"}])
    assert value(namespace="ns", name="m", condition="ModelCacheReady", status="False", reason="Failed") == 1
    cm.observe("ns", "m", [{"type": "ModelCacheReady", "status": "True", "reason": "Ready"}])
    assert value(namespace="ns", name="m", condition="ModelCacheReady", status="False", reason="Failed") is None
    assert value(namespace="ns", name="m", condition="Progressing", status="True", reason="WaitingForCapacity") is None
    assert value(namespace="ns", name="m", condition="ModelCacheReady", status="True", reason="Ready") == 1
    cm.forget("ns", "m")
    assert value(namespace="ns", name="m", condition="ModelCacheReady", status="True", reason="Ready") is None


# ------------------------------------------------------------------------- prometheus-adapter rules
def test_adapter_rules_serve_every_metric_the_hpa_reads(promql, known, labels_of):
    from moe_operator.api import MoEDeploymentSpec
    from moe_operator.day2 import autoscaler
    from moe_operator.engines.registry import REGISTRY as ENGINES

    (cm,) = find(render(ALL_ON), "ConfigMap", "-prometheus-adapter")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    served = {r["name"]["as"]: r for r in rules}
    # the Pods metric each rendered HPA asks for (every engine, both metrics) has a rule
    for engine, metrics in ((name, e.metrics) for name, e in ENGINES.items()):
        for metric in metrics:
            spec = MoEDeploymentSpec.model_validate({"model": {"uri": "hf://org/m"}, "engine": {"name": engine},
                                                     "autoscaling": {"enabled": True, "provider": "hpa", "metric": metric,
                                                                     "maxReplicas": 4}})
            hpa = autoscaler("m", "ns", {}, spec)
            name = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
            assert name in served, (engine, metric, name)
            rule = served[name]
            assert re.fullmatch(rule["name"]["matches"], metrics[metric])
            assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    # the adapter's templates filled as it fills them, then parsed
    exprs = [r["seriesQuery"] for r in rules] + [
        r["metricsQuery"].replace("<<.Series>>", r["seriesQuery"].split("{")[0])
        .replace("<<.LabelMatchers>>", 'namespace="ns",pod=~"m-.*"').replace("<<.GroupBy>>", "pod") for r in rules]
    check_exprs(promql, known, exprs)
    check_labels(promql, labels_of, exprs)
