"""The API server refuses, through the operator's validating webhook, a tp that cannot hold the
checkpoint on the GPU the spec asks for, with the numbers (kubectl apply shows them); a layout that
fits, or none given, is admitted. The checkpoint is DeepSeek-V3 NVFP4 at its real size (sparse file)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from moe_operator.sample_checkpoints import write_full_size

from .operator_fixture import get_json, wait_for

pytestmark = pytest.mark.integration


def test_webhook_refuses_a_tp_that_does_not_fit_with_the_numbers(kubectl, kubeconfig, namespace, crd, tmp_path):
    from .operator_fixture import start_webhook_operator

    models = Path(tempfile.mkdtemp(prefix="moe-adm-"))  # under the operator's allowed host paths
    write_full_size("deepseek-v3-nvfp4", models / "dsv3")
    op, _ = start_webhook_operator(kubeconfig, tmp_path / "admission.log")
    try:
        wait_for(lambda: get_json(kubectl, "validatingwebhookconfiguration", "validate.moe.serving.dev"), 30,
                 "managed ValidatingWebhookConfiguration", op.log_tail)
        doc = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
               "metadata": {"name": "too-small", "namespace": namespace},
               "spec": {"model": {"uri": f"file://{models}/dsv3"}, "engine": {"name": "sglang"},
                        "gpu": {"product": "NVIDIA-H200"}, "parallelism": {"tp": 2}, "replicas": 0}}

        def refused():
            r = kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
            return r.stderr if r.returncode != 0 and "denied the request" in r.stderr else None
        err = wait_for(refused, 30, "webhook refusal", op.log_tail)
        assert "tp=2 (2 GPUs per replica) cannot hold 380.8 GiB of weights" in err
        assert "per GPU 191.4 GiB weights" in err and "NVIDIA-H200 126.4 GiB" in err and "tp=4 would fit" in err
        assert get_json(kubectl, "moed", "too-small", "-n", namespace) is None
        doc["spec"]["parallelism"] = {"tp": 4}
        kubectl("apply", "-f", "-", input=json.dumps(doc))  # fits: admitted
        del doc["spec"]["parallelism"]
        doc["metadata"]["name"] = "sized"
        kubectl("apply", "-f", "-", input=json.dumps(doc))  # no layout: the operator sizes it
        # an UPDATE to a layout that does not fit is refused too, and the object keeps its tp
        doc["metadata"]["name"] = "too-small"
        doc["spec"]["gpusPerReplica"] = 1
        r = kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
        assert r.returncode != 0 and "tp=1 (1 GPU per replica) cannot hold" in r.stderr
        assert get_json(kubectl, "moed", "too-small", "-n", namespace)["spec"]["parallelism"]["tp"] == 4
    finally:
        op.stop()
        kubectl("delete", "validatingwebhookconfiguration", "validate.moe.serving.dev", "--ignore-not-found")
        shutil.rmtree(models, ignore_errors=True)
