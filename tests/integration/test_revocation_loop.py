"""Token revocation from one operator-level loop (issue 34), against the real API server with the
chart's RBAC (Secrets: get only): a Secret that loses its label takes the token out within the
loop's interval (MOE_RESYNC_SECONDS=2 here, the per-object timer's interval before), and no kopf
timer runs per object, so kopf puts no finalizer on a MoEDeployment and takes the one an older
release put there away."""

from __future__ import annotations

import json
import time

import pytest

from .operator_fixture import get_json, wait_for
from .test_tenant_safety import apply, planned_condition, sample, wait_event

pytestmark = pytest.mark.integration

INTERVAL = 2.0  # MOE_RESYNC_SECONDS of the operator fixture


def _token_env(kubectl, ns, name, secret):
    dep = get_json(kubectl, "deployment", name, "-n", ns)
    pod = dep["spec"]["template"]["spec"]
    return [e for c in pod["containers"] + pod.get("initContainers", []) for e in c.get("env") or []
            if (e.get("valueFrom") or {}).get("secretKeyRef", {}).get("name") == secret]


def test_a_secret_losing_its_label_takes_the_token_out_within_the_interval(kubectl, namespace, operator):
    kubectl("-n", namespace, "create", "secret", "generic", "hf-shared", "--from-literal=token=t")
    kubectl("-n", namespace, "label", "secret", "hf-shared", "moe.serving.dev/model-token=true")
    names = ["rev-a", "rev-b"]  # two objects naming one Secret
    for name in names:
        doc = sample(namespace, "deepseek-v3-nvfp4-b200.yaml", name)
        doc["spec"]["model"] = {"uri": "hf://nvidia/DeepSeek-V3-0324-FP4@" + "0" * 40, "format": "nvfp4",
                                "architecture": "DeepseekV3ForCausalLM", "tokenSecretRef": {"name": "hf-shared"}}
        doc["spec"]["replicas"] = 0
        apply(kubectl, doc)
    for name in names:
        planned_condition(kubectl, namespace, name, "True", log=operator.log_tail)
        wait_for(lambda: _token_env(kubectl, namespace, name, "hf-shared"), 30, f"the token in {name}", operator.log_tail)
        # no kopf timer or daemon: kopf puts no finalizer on the object
        assert "finalizers" not in get_json(kubectl, "moed", name, "-n", namespace)["metadata"]
    time.sleep(INTERVAL + 1)  # a pass or more with the label on: the token stays
    assert all(_token_env(kubectl, namespace, n, "hf-shared") for n in names)

    t0 = time.monotonic()
    kubectl("-n", namespace, "label", "secret", "hf-shared", "moe.serving.dev/model-token-")
    wait_for(lambda: not any(_token_env(kubectl, namespace, n, "hf-shared") for n in names), 30,
             "the token out of both Deployments", operator.log_tail)
    took = time.monotonic() - t0
    print(f"token out of both Deployments {took:.1f}s after the label went (interval {INTERVAL:.0f}s)")
    # within one interval, plus a pass and kubectl's own polling (0.5 s) on a loaded machine
    assert took < 2 * INTERVAL + 4, took
    for name in names:
        assert "no longer labelled" in wait_event(kubectl, namespace, name, "TokenRevoked", log=operator.log_tail)["message"]
    assert "Timer 'token_revocation'" not in operator.log_path.read_text(errors="replace")


def test_the_finalizer_of_an_older_release_is_taken_away(kubectl, namespace, operator):
    """An object the previous release handled carries kopf's finalizer (its timer required one):
    this operator removes it, so a delete no longer waits for the operator."""
    doc = sample(namespace, "deepseek-v3-nvfp4-b200.yaml", "old-final")
    doc["spec"]["replicas"] = 0
    apply(kubectl, doc)
    planned_condition(kubectl, namespace, "old-final", "True", log=operator.log_tail)
    kubectl("-n", namespace, "patch", "moed", "old-final", "--type=merge",
            "-p", json.dumps({"metadata": {"finalizers": ["moe.serving.dev/finalizer"]}}))
    wait_for(lambda: not get_json(kubectl, "moed", "old-final", "-n", namespace)["metadata"].get("finalizers"), 30,
             "kopf to remove the finalizer it no longer needs", operator.log_tail)
    kubectl("-n", namespace, "delete", "moed", "old-final", "--wait=true", "--timeout=30s")
