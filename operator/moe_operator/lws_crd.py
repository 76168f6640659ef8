"""The LeaderWorkerSet CRD (kubernetes-sigs/lws) for clusters that lack it, e.g. the local control plane.

Fetched from the Go module proxy (the module ships its CRD), so nothing is vendored. Only the CRD
is installed: multi-node replicas are accepted and validated by the API server, but no LWS
controller runs locally, so they get no pods there.
"""

from __future__ import annotations

from pathlib import Path

from . import optional_crds

LWS = optional_crds.ModuleCrd("sigs.k8s.io/lws", "v0.7.0",
                              "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml",
                              "leaderworkersets.leaderworkerset.x-k8s.io")
LWS_MODULE, LWS_VERSION = LWS.module, LWS.version


def crd_file() -> Path:
    """Path of the CRD in the Go module cache (downloaded once)."""
    return optional_crds.crd_file(LWS)


def install(kubectl) -> None:
    """Apply the CRD with a `kubectl(*args)` callable and wait until it is established."""
    optional_crds.install(kubectl, LWS)
