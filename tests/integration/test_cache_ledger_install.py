"""A Helm install whose watchNamespaces leave the release namespace out still lets the operator keep
its model cache ledger (cache_ledger.py) there: the API server's own answer for the installed
ServiceAccount (kubectl auth can-i), on that ConfigMap's name and no other. The operator process of
such an install, against this RBAC, is tests/integration/test_cache_ledger.py (kwok runs no
container of the installed pod). Fixtures and helpers are test_install's."""

from __future__ import annotations

import pytest


from .operator_fixture import kubectl_json
from .test_install import CHART, _can_i, _exists, _helm, release  # noqa: F401  (release: the fixture)

pytestmark = pytest.mark.integration


def test_an_install_watching_other_namespaces_grants_the_ledger_configmap(dev_cluster, kubectl, release,  # noqa: F811
                                                                          namespace):
    rel, ns = release
    sa = f"system:serviceaccount:{ns}:{rel}-moe-operator"
    _helm(dev_cluster, "install", rel, str(CHART), "-n", ns, "--create-namespace",
          "--set", f"watchNamespaces={{{namespace}}}", "--take-ownership", "--wait", "--timeout", "240s")
    env = kubectl_json(kubectl, "-n", ns, "get", "deployment", f"{rel}-moe-operator")["spec"]["template"]["spec"][
        "containers"][0]["env"]
    assert {"name": "MOE_OPERATOR_NAMESPACE", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}} \
        in env or {"name": "MOE_OPERATOR_NAMESPACE", "value": ns} in env, env
    name = f"{rel}-moe-operator-model-caches"  # per release: two releases in one namespace keep two
    assert {"name": "MOE_CACHE_LEDGER_NAME", "value": name} in env, env
    ledger = f"configmaps/{name}"
    for verb in ("get", "create", "patch"):
        assert _can_i(kubectl, sa, verb, ledger, "-n", ns), verb
    # nothing else in the release namespace, and the watched namespace's grants are unchanged
    assert not _can_i(kubectl, sa, "get", "configmaps/other", "-n", ns)
    assert not _can_i(kubectl, sa, "list", "configmaps", "-n", ns)
    assert not _can_i(kubectl, sa, "delete", ledger, "-n", ns)
    assert _can_i(kubectl, sa, "create", "configmaps", "-n", namespace)
    _helm(dev_cluster, "uninstall", rel, "-n", ns, "--wait", "--timeout", "120s")
    assert not _exists(kubectl, "-n", ns, "role", f"{rel}-moe-operator-cache-ledger")
