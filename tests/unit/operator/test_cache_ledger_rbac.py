"""The chart grants the model cache ledger (cache_ledger.py) its ConfigMap in the release namespace
whatever namespaces are watched: a Role narrowed to the ledger's name, bound to the operator's
ServiceAccount. Before, watchNamespaces that left the release namespace out granted nothing there
and the operator kept its record in memory (a restart forgot every cache). Rendered with helm
template (test_chart's helpers); the real API server's answer is in
tests/integration/test_cache_ledger.py."""

from __future__ import annotations

import pytest

from moe_operator import cache_ledger, permissions
from test_chart import helm, of_kind, one, perms, render  # noqa: F401  (helm: the fixture)

LEDGER_PERMS = {k: set(v) for k, (v, _) in permissions.LEDGER.items()}


def _ledger_env(docs) -> str:
    """MOE_CACHE_LEDGER_NAME as the chart hands it to the operator container."""
    dep = one(docs, "Deployment")
    (env,) = [e for c in dep["spec"]["template"]["spec"]["containers"] for e in c.get("env") or []
              if e["name"] == "MOE_CACHE_LEDGER_NAME"]
    return env["value"]


def _ledger_grants(docs, namespace: str) -> list[dict]:
    """The rules of Roles in `namespace`, bound to the chart's ServiceAccount, that name configmaps."""
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    bound = {b["roleRef"]["name"] for b in of_kind(docs, "RoleBinding") if b["metadata"]["namespace"] == namespace
             and {"kind": "ServiceAccount", "name": sa, "namespace": "moe-system"} in b["subjects"]
             and b["roleRef"]["kind"] == "Role"}
    return [r for role in of_kind(docs, "Role") if role["metadata"]["namespace"] == namespace
            and role["metadata"]["name"] in bound for r in role["rules"] if "configmaps" in r["resources"]]


@pytest.mark.parametrize("sets", [(), ("watchNamespaces={team-a,team-b}",), ("watchNamespaces={team-a}", "replicas=2"),
                                  ("watchNamespaces={moe-system}",)])
def test_the_ledger_configmap_is_granted_in_the_release_namespace(helm, sets):  # noqa: F811
    docs = render(helm, *sets)
    rules = [r for r in _ledger_grants(docs, "moe-system") if r.get("resourceNames")]
    name = "moe-moe-operator" + permissions.LEDGER_NAME_SUFFIX
    assert perms(rules) == LEDGER_PERMS and all(r["resourceNames"] == [name] for r in rules), rules  # permissions.py
    assert _ledger_env(docs) == name  # the name the Role grants
    (role,) = [d for d in of_kind(docs, "Role") if d["metadata"]["name"].endswith("-cache-ledger")]
    assert perms(role["rules"]) == LEDGER_PERMS and all(r.get("resourceNames") == [name] for r in role["rules"])


@pytest.mark.parametrize("release,ledger", [("moe-operator", cache_ledger.NAME), ("other", "other-moe-operator-model-caches")])
def test_each_release_names_its_own_ledger(helm, release, ledger):  # noqa: F811
    """Two releases in one namespace keep two ledgers; a release named moe-operator keeps the old name."""
    docs = render(helm, release=release)
    (rule,) = [r for r in _ledger_grants(docs, "moe-system") if r.get("resourceNames")]
    assert rule["resourceNames"] == [ledger] and _ledger_env(docs) == ledger


def test_the_default_ledger_name_is_a_release_named_moe_operator():
    assert cache_ledger.NAME == "moe-operator" + permissions.LEDGER_NAME_SUFFIX


def test_the_operator_reads_the_ledger_name_from_the_chart_env(monkeypatch):
    monkeypatch.setenv("MOE_OPERATOR_NAMESPACE", "moe-system")
    monkeypatch.delenv("MOE_CACHE_LEDGER_NAME", raising=False)
    assert cache_ledger.location() == ("moe-system", cache_ledger.NAME)
    monkeypatch.setenv("MOE_CACHE_LEDGER_NAME", "other-moe-operator-model-caches")
    assert cache_ledger.location() == ("moe-system", "other-moe-operator-model-caches")


def test_the_ledger_role_grants_nothing_else(helm):  # noqa: F811
    docs = render(helm, "watchNamespaces={team-a}")
    (role,) = [r for r in of_kind(docs, "Role") if r["metadata"]["name"].endswith("-cache-ledger")]
    assert role["metadata"]["namespace"] == "moe-system"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch"],
                              "resourceNames": [_ledger_env(docs)]}]
    # the watched namespace's own Role is unchanged: no ledger name there
    (team,) = [r for r in of_kind(docs, "Role") if r["metadata"]["namespace"] == "team-a"]
    assert not [r for r in team["rules"] if r.get("resourceNames")]


def test_no_ledger_role_without_rbac(helm):  # noqa: F811
    docs = render(helm, "rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=mine")
    assert not of_kind(docs, "Role") and not of_kind(docs, "RoleBinding")
