"""What a tenant may ask for through a MoEDeployment, as the cluster admin configured it. Pure.

The trust model (charts/moe-operator/README.md): whoever may create a MoEDeployment in a namespace
gets pods in that namespace running an engine image on GPU nodes. They must not get more than
that: no host directory the admin did not list, no image outside the allowed registries when the
admin restricts them, no Secret that was not marked for model-token use. The schema (CEL) refuses
what needs no configuration (`..` in paths, dangerous env names); this module refuses what depends
on the admin's settings, in the reconcile and in the admission webhook alike.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from .api import MoEDeploymentSpec
from . import image_ref, pod_overlay
from .model_uri import ModelURI

# The label a Secret must carry before a MoEDeployment may mount it as a model token: a Secret
# in the namespace is not the tenant's to hand to an image of their choosing unless its owner
# says so.
TOKEN_SECRET_LABEL = "moe.serving.dev/model-token"


@dataclass(frozen=True)
class Policy:
    allowed_host_paths: tuple[str, ...] = ()  # file:// roots; empty: no host path at all
    allowed_registries: tuple[str, ...] = ()  # registry[/path] prefixes of spec.engine.image; empty: any image
    require_token_label: bool = True
    # Service types a MoEDeployment may ask for: NodePort and LoadBalancer expose the model outside
    # the cluster, which is the admin's decision (chart value policy.allowedServiceTypes)
    allowed_service_types: tuple[str, ...] = ("ClusterIP",)
    # What happens to a workload already running when the policy tightens under it (a registry or
    # host path taken off the lists): "keep" leaves it running, refusing only the next change;
    # "scaleToZero" scales it to 0 replicas with a PolicyEnforced Event (chart value
    # policy.onViolation). A revoked token Secret is always taken out (revocation.py).
    on_violation: str = "keep"

    def problems(self, spec: MoEDeploymentSpec) -> list[str]:
        out = []
        if spec.model.uri.startswith("file://"):
            out += host_path_problems(ModelURI.parse(spec.model.uri).path, self.allowed_host_paths)
        if spec.engine.image and self.allowed_registries and not image_allowed(spec.engine.image, self.allowed_registries):
            out.append(f"engine.image {spec.engine.image!r} is not from an allowed registry "
                       f"({', '.join(self.allowed_registries)}); leave engine.image unset for the default image")
        if spec.podTemplate and self.allowed_registries:  # sidecars and init containers the overlay adds
            for image in pod_overlay.images(spec.podTemplate.overlay()):
                if not image_allowed(image, self.allowed_registries):
                    out.append(f"podTemplate image {image!r} is not from an allowed registry "
                               f"({', '.join(self.allowed_registries)})")
        if spec.service.type not in self.allowed_service_types:
            out.append(f"service.type {spec.service.type} is not allowed on this cluster (allowed: "
                       f"{', '.join(self.allowed_service_types)}); ask the cluster admin (chart value policy.allowedServiceTypes)")
        return out


ON_VIOLATION = ("keep", "scaleToZero")


def host_path_problems(path: str, allowed: tuple[str, ...]) -> list[str]:
    if not path.startswith("/") or ".." in path.split("/"):
        return [f"model.uri file://{path}: the path must be absolute and contain no '..'"]
    norm = posixpath.normpath(path)
    if not allowed:
        return [f"model.uri file://{path}: host paths are not allowed on this cluster "
                "(the operator was started without --allow-host-path); use pvc:// or hf://"]
    for root in allowed:
        r = posixpath.normpath(root)
        if norm == r or norm.startswith(r.rstrip("/") + "/"):
            return []
    return [f"model.uri file://{path} is not under an allowed host path ({', '.join(allowed)}); "
            "use pvc:// or hf://, or ask the cluster admin to allow the directory"]


def image_allowed(image: str, registries: tuple[str, ...]) -> bool:
    """Registry and path components compared (image_ref), not a string prefix."""
    return image_ref.allowed(image, registries)
