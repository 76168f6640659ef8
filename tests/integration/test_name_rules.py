"""The MoEDeployment name rules (issue 32 item 3) as the API server evaluates them: the CRD
generated from api.py (installed under a test group, so it runs before the committed copy is
regenerated and touches nobody's MoEDeployments) admits exactly the names test_derived_names'
mirror admits, at the boundaries; and every object the operator renders for the longest admitted
name is accepted by the API server (server-side dry run: each kind's own name and label checks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration
GROUP = "names-test.moe.serving.dev"

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "operator"))
import test_derived_names as names  # noqa: E402


@pytest.fixture(scope="module")
def test_crd(kubectl, crd):
    from moe_operator.crd import crd as generated

    doc = generated()
    doc["metadata"]["name"] = f"{doc['spec']['names']['plural']}.{GROUP}"
    doc["spec"]["group"] = GROUP
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(doc))
    kubectl("wait", "--for", "condition=established", f"crd/{doc['metadata']['name']}", "--timeout=60s")
    yield
    kubectl("delete", "crd", doc["metadata"]["name"], "--wait=false", check=False)


def dry_run(kubectl, namespace: str, name: str, spec: dict):
    doc = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": name, "namespace": namespace},
           "spec": spec}
    return kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)


SPECS = {
    "single node": {"model": {"uri": "hf://org/m"}},
    "multi-node, 1000 replicas": {"model": {"uri": "hf://org/m"}, "engine": {"name": "sglang"}, "nodesPerReplica": 2,
                                  "replicas": 1000},
    "multi-node, autoscaled to 10": {"model": {"uri": "hf://org/m"}, "engine": {"name": "sglang"}, "nodesPerReplica": 2,
                                     "autoscaling": {"enabled": True, "maxReplicas": 10}},
}


@pytest.mark.parametrize("case", list(SPECS))
def test_the_api_server_admits_what_the_mirror_admits(kubectl, namespace, test_crd, case):
    from moe_operator.api import MoEDeploymentSpec

    name = names.longest(MoEDeploymentSpec.model_validate(SPECS[case]))
    ok = dry_run(kubectl, namespace, name, SPECS[case])
    assert ok.returncode == 0, (len(name), ok.stderr)
    refused = dry_run(kubectl, namespace, name + "m", SPECS[case])
    assert refused.returncode != 0 and "metadata.name" in refused.stderr, refused.stderr


def test_the_picker_name_rules(kubectl, namespace, test_crd):
    def picker(name):
        return {"model": {"uri": "hf://org/m"},
                "gateway": {"inferencePool": {"enabled": True, "endpointPicker": {"name": name, "deploy": True}}}}
    assert dry_run(kubectl, namespace, "m", picker("p" * 63)).returncode == 0
    for bad in ("p" * 64, "picker.example", "1picker"):
        r = dry_run(kubectl, namespace, "m", picker(bad))
        assert r.returncode != 0 and "endpointPicker.name" in r.stderr, (bad, r.stderr)
    r = dry_run(kubectl, namespace, "m", picker("m"))
    assert r.returncode != 0 and "must differ from metadata.name" in r.stderr, r.stderr


@pytest.mark.parametrize("case", ["single node, HPA", "multi-node, 1000 replicas"])
def test_every_rendered_object_at_the_longest_name_is_accepted(kubectl, namespace, crd, case, tmp_path):
    from moe_core.checkpoint import inspect_dir
    from moe_operator import optional_crds
    from moe_operator.sample_checkpoints import write_sample

    if kubectl("get", "crd", optional_crds.INFERENCE_POOL.name, check=False).returncode != 0:
        optional_crds.install(kubectl, optional_crds.INFERENCE_POOL)
    s = names.CASES[case]
    name = names.longest(s)
    objs = names.rendered(inspect_dir(write_sample("deepseek-v3-nvfp4", tmp_path)), name, s)
    for o in objs:
        o["metadata"]["namespace"] = namespace
        o["metadata"].pop("ownerReferences", None)  # the owner is not there; the names are what is tested
    r = kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(objs), check=False)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == len(objs), r.stdout
