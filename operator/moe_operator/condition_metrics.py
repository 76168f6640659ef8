"""The conditions of each MoEDeployment as a Prometheus gauge, for the chart's alert rules and
dashboard (charts/moe-operator/templates/prometheusrule.yaml, files/grafana/): one series per
(namespace, name, condition) at value 1, labelled with its status and reason, as kube-state-metrics
exports built-in objects' conditions. A status or reason change replaces the series (an alert's
`for:` restarts only when the state does); a deleted object's series go with `forget`."""

from __future__ import annotations

from typing import Any

from prometheus_client import Gauge

CONDITION = Gauge("moe_operator_moedeployment_condition",
                  "Conditions of MoEDeployments (value 1; status and reason as labels)",
                  ["namespace", "name", "condition", "status", "reason"])

_seen: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}  # (ns, name) -> condition -> (status, reason)


def observe(namespace: str, name: str, conditions: list[dict[str, Any]]) -> None:
    """Export `conditions` (status.conditions as written) for one object."""
    now = {c["type"]: (str(c.get("status", "")), str(c.get("reason", ""))) for c in conditions if c.get("type")}
    before = _seen.get((namespace, name), {})
    for type_, (status, reason) in before.items():
        if now.get(type_) != (status, reason):
            CONDITION.remove(namespace, name, type_, status, reason)
    for type_, (status, reason) in now.items():
        CONDITION.labels(namespace, name, type_, status, reason).set(1)
    _seen[(namespace, name)] = now


def forget(namespace: str, name: str) -> None:
    """The object is gone: its series go too."""
    for type_, (status, reason) in _seen.pop((namespace, name), {}).items():
        CONDITION.remove(namespace, name, type_, status, reason)
