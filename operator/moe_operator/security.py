"""The security context of every pod the operator renders (engine pods and inspection Jobs).

Kubernetes' "restricted" Pod Security profile where the engine allows it: the bundled runtime image
runs as 65532 (deploy/Dockerfile.runtime), so its pods run as non-root. The sglang and vLLM images
run as root and write under /root (caches, compiled kernels), so for them only non-root is left
out; privilege escalation, capabilities and the seccomp profile are restricted for every engine.
"""

from __future__ import annotations

from typing import Any

RUNTIME_UID = 65532  # USER of deploy/Dockerfile.runtime
NON_ROOT_ENGINES = ("bundled",)


def pod_security(engine: str) -> dict[str, Any]:
    ctx: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if engine in NON_ROOT_ENGINES:
        ctx.update(runAsNonRoot=True, runAsUser=RUNTIME_UID, runAsGroup=RUNTIME_UID, fsGroup=RUNTIME_UID)
    return ctx


def container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": {"drop": ["ALL"]}}
