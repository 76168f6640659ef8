"""The LeaderWorkerSet CRD (kubernetes-sigs/lws) for clusters that lack it, e.g. the local control plane.

Fetched from the Go module proxy (the module ships its CRD), so nothing is vendored. Only the CRD
is installed: multi-node replicas are accepted and validated by the API server, but no LWS
controller runs locally, so they get no pods there.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

LWS_MODULE = "sigs.k8s.io/lws"
LWS_VERSION = "v0.7.0"
CRD_IN_MODULE = "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"


def crd_file() -> Path:
    """Path of the CRD in the Go module cache (downloaded once)."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(["go", "mod", "download", "-json", f"{LWS_MODULE}@{LWS_VERSION}"], cwd=tmp,
                           capture_output=True, text=True, env={**os.environ, "GOFLAGS": "-mod=mod"}, timeout=300)
    info = json.loads(r.stdout or "{}")
    if r.returncode != 0 or "Dir" not in info:
        raise RuntimeError(f"cannot fetch {LWS_MODULE}@{LWS_VERSION} from the Go module proxy: "
                           f"{info.get('Error') or r.stderr.strip()}")
    return Path(info["Dir"]) / CRD_IN_MODULE


def install(kubectl) -> None:
    """Apply the CRD with a `kubectl(*args)` callable and wait until it is established."""
    import time

    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_file()))
    deadline = time.monotonic() + 60
    while True:  # `kubectl wait` fails at once while the new CRD is not yet visible to it
        r = kubectl("wait", "--for", "condition=established", "crd/leaderworkersets.leaderworkerset.x-k8s.io",
                    "--timeout=10s", check=False)
        if r.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"LeaderWorkerSet CRD not established: {r.stderr.strip()}")
        time.sleep(1)
