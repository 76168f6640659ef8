"""The security context of every pod the operator renders (engine pods and inspection Jobs).

Kubernetes' "restricted" Pod Security profile where the image allows it: the project's runtime image
runs as 65532 (deploy/Dockerfile.runtime), so pods that run it (an engine whose Engine.runs_runtime_image,
the operator's own Jobs) run as non-root. The sglang and vLLM images run as root and write under /root
(caches, compiled kernels), so for them only non-root is left out; privilege escalation, capabilities
and the seccomp profile are restricted for every engine.
"""

from __future__ import annotations

from typing import Any

from .engines import registry as engines

RUNTIME_UID = 65532  # USER of deploy/Dockerfile.runtime


def runtime_pod_security() -> dict[str, Any]:
    """A pod that runs the project's runtime image (the bundled engine, inspection and model cache Jobs)."""
    return {"seccompProfile": {"type": "RuntimeDefault"},
            "runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID, "fsGroup": RUNTIME_UID}


def pod_security(engine: str) -> dict[str, Any]:
    if engines.get(engine).runs_runtime_image:
        return runtime_pod_security()
    return {"seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": {"drop": ["ALL"]}}
