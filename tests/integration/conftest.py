"""Fixtures for integration tests against the local control plane (moe_operator.devcluster).

- `dev_cluster` (session): a running DevCluster. Reuses the cluster of the kubeconfig in
  $MOE_KUBECONFIG when set (never stops it); otherwise builds the binaries if needed, starts a
  cluster in a temporary state dir (default pools: 2 nodes of every GPU pool) and stops it at the
  end of the session. MOE_SKIP_INTEGRATION=1 skips; any other failure to build or start is an
  error of the tests that need it, never a silent skip.
- `kubeconfig` (session): path of the admin kubeconfig, as a str.
- `kubectl` (session): callable running the pinned kubectl against the cluster,
  `kubectl("get", "nodes", "-o", "json")` -> CompletedProcess (raises on a non-zero exit unless
  check=False).
- `k8s_api_client` (session): a `kubernetes.client.ApiClient` for the cluster.
- `namespace` (function): a fresh namespace, deleted after the test.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

SKIP_ENV = "MOE_SKIP_INTEGRATION"
KUBECONFIG_ENV = "MOE_KUBECONFIG"


def _skip_reason() -> str | None:
    if os.environ.get(SKIP_ENV) == "1":
        return f"{SKIP_ENV}=1: integration tests against the local control plane are disabled"
    return None


@pytest.fixture(scope="session")
def dev_cluster(tmp_path_factory):
    if reason := _skip_reason():
        pytest.skip(reason)
    from moe_operator.devcluster import DevCluster

    existing = os.environ.get(KUBECONFIG_ENV)
    if existing:
        if not Path(existing).is_file():
            raise FileNotFoundError(f"{KUBECONFIG_ENV}={existing} does not exist")
        yield DevCluster(kubeconfig=existing)
        return
    dc = DevCluster(tmp_path_factory.mktemp("dev-cluster"), die_with_parent=True)
    try:
        dc.up()
        yield dc
    finally:
        dc.down()


@pytest.fixture(scope="session")
def kubeconfig(dev_cluster) -> str:
    return str(dev_cluster.kubeconfig)


@pytest.fixture(scope="session")
def kubectl(dev_cluster):
    return dev_cluster.kubectl


@pytest.fixture(scope="session")
def k8s_api_client(kubeconfig):
    from kubernetes import client, config

    return config.new_client_from_config(config_file=kubeconfig)


@pytest.fixture
def namespace(kubectl):
    name = f"it-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


# --- the operator under test (module-scoped: one per test module) -------------------------------

@pytest.fixture(scope="module")
def crd(kubectl):
    from moe_operator import lws_crd

    from .operator_fixture import ROOT

    lws_crd.install(kubectl)
    # --force-conflicts: a chart release may own the CRD (templates/crd-moedeployments.yaml, Helm's
    # field manager); the session's copy is the same generated file. Releases the tests install
    # adopt it with --take-ownership, or leave it alone with crds.install=false.
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "moedeployments.yaml"))
    kubectl("wait", "--for", "condition=established", "crd/moedeployments.moe.serving.dev", "--timeout=60s")


@pytest.fixture(scope="module")
def operator(crd, dev_cluster, kubectl, tmp_path_factory):
    """The operator, authenticated as the chart's ServiceAccount with only the chart's RBAC; at
    the end no request of the whole module may have been refused."""
    import time

    from .operator_fixture import OperatorProcess, chart_service_account_kubeconfig, forbidden_lines

    d = tmp_path_factory.mktemp("operator")
    sa_kubeconfig = chart_service_account_kubeconfig(dev_cluster, kubectl, d / "sa.kubeconfig")
    op = OperatorProcess(str(sa_kubeconfig), d / "operator.log")
    op.start()
    time.sleep(2)
    yield op
    op.stop()
    refused = forbidden_lines(op.log_path.read_text(errors="replace"))
    assert not refused, "requests refused with the chart's RBAC:\n" + "\n".join(refused[:10])


