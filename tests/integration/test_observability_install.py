"""The chart's observability objects (issue 32 item 6) through the real API server: the
PrometheusRule validated by prometheus-operator's released CRD (optional_crds.PROMETHEUS_RULE,
the release of the PodMonitor CRD), the dashboard and prometheus-adapter ConfigMaps by the core
API, all by a server-side dry run of what helm renders."""

from __future__ import annotations

import pytest
import yaml

pytestmark = pytest.mark.integration

SETS = ("prometheusRule.enabled=true", "grafanaDashboard.enabled=true", "prometheusAdapter.enabled=true",
        "metrics.serviceMonitor.enabled=true")


def test_rendered_rules_dashboard_and_adapter_are_accepted(dev_cluster, kubectl, namespace):
    from moe_operator import optional_crds

    from .operator_fixture import ROOT

    optional_crds.install(kubectl, optional_crds.PROMETHEUS_RULE)
    args = ["template", "moe-obs", str(ROOT / "charts" / "moe-operator"), "-n", namespace]
    for s in SETS:
        args += ["--set", s]
    for template in ("prometheusrule.yaml", "grafana-dashboard.yaml", "prometheus-adapter.yaml"):
        rendered = dev_cluster.helm(*args, "--show-only", f"templates/{template}").stdout
        doc = yaml.safe_load(rendered)
        assert doc["kind"] in ("PrometheusRule", "ConfigMap"), doc
        out = kubectl("apply", "--dry-run=server", "-o", "yaml", "-f", "-", input=rendered).stdout
        assert yaml.safe_load(out)["metadata"]["name"] == doc["metadata"]["name"]
    # the CRD's schema is enforced: a rule without expr is refused
    bad = yaml.safe_load(dev_cluster.helm(*args, "--show-only", "templates/prometheusrule.yaml").stdout)
    del bad["spec"]["groups"][0]["rules"][0]["expr"]
    r = kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert r.returncode != 0 and "expr" in r.stderr, r.stderr
