"""CRDs of optional integrations, from their released Go modules (lws_crd.py names LWS the same way).

- KEDA's ScaledObject (github.com/kedacore/keda/v2): spec.autoscaling.provider keda.
- The Gateway API Inference Extension's InferencePool (sigs.k8s.io/gateway-api-inference-extension,
  the v1 API inference.networking.k8s.io): spec.gateway.inferencePool.
- prometheus-operator's PodMonitor and PrometheusRule (github.com/prometheus-operator/prometheus-operator):
  the chart's podMonitor.enabled and prometheusRule.enabled.

Only the CRDs are installed (the local control plane validates what the operator renders); no KEDA
operator or endpoint picker runs locally.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModuleCrd:
    module: str
    version: str
    path: str  # the CRD file inside the module
    name: str  # metadata.name of the CRD


KEDA = ModuleCrd("github.com/kedacore/keda/v2", "v2.17.2", "config/crd/bases/keda.sh_scaledobjects.yaml",
                 "scaledobjects.keda.sh")
INFERENCE_POOL = ModuleCrd("sigs.k8s.io/gateway-api-inference-extension", "v1.0.1",
                           "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
                           "inferencepools.inference.networking.k8s.io")
# The chart's optional PodMonitor (values podMonitor.enabled) scrapes the inference pods.
POD_MONITOR = ModuleCrd("github.com/prometheus-operator/prometheus-operator", "v0.85.0",
                        "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml",
                        "podmonitors.monitoring.coreos.com")
# The chart's optional alert rules (values prometheusRule.enabled), from the same release.
PROMETHEUS_RULE = ModuleCrd("github.com/prometheus-operator/prometheus-operator", "v0.85.0",
                            "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml",
                            "prometheusrules.monitoring.coreos.com")
ALL = {"keda": KEDA, "inferencepool": INFERENCE_POOL, "podmonitor": POD_MONITOR, "prometheusrule": PROMETHEUS_RULE}


def crd_file(crd: ModuleCrd) -> Path:
    """Path of the CRD in the Go module cache (downloaded once through the Go module proxy)."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(["go", "mod", "download", "-json", f"{crd.module}@{crd.version}"], cwd=tmp,
                           capture_output=True, text=True, env={**os.environ, "GOFLAGS": "-mod=mod"}, timeout=600)
    info = json.loads(r.stdout or "{}")
    if r.returncode != 0 or "Dir" not in info:
        raise RuntimeError(f"cannot fetch {crd.module}@{crd.version} from the Go module proxy: "
                           f"{info.get('Error') or r.stderr.strip()}")
    return Path(info["Dir"]) / crd.path


def install(kubectl, crd: ModuleCrd) -> None:
    """Apply the CRD with a `kubectl(*args)` callable and wait until it is established."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_file(crd)))
    deadline = time.monotonic() + 60
    while True:  # `kubectl wait` fails at once while the new CRD is not yet visible to it
        r = kubectl("wait", "--for", "condition=established", f"crd/{crd.name}", "--timeout=10s", check=False)
        if r.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{crd.name} not established: {r.stderr.strip()}")
        time.sleep(1)
