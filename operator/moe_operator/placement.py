"""Placement: choose the GPU class for a MoEDeployment and plan for it. Pure.

Candidates: the allowed architectures (all if unset), the pinned product if any, enough GPUs per
node for the parallelism, enough nodes for one replica; each candidate is planned and a class
whose plan has errors is rejected with the planner's message. Among the rest, most free GPUs wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_core.checkpoint import CheckpointInfo
from moe_core.plan import Plan

from .api import MoEDeploymentSpec
from .inventory import ClassInventory
from .planner import Choices, plan


@dataclass
class Placement:
    inventory: ClassInventory | None
    plan: Plan | None
    rejected: dict[str, str] = field(default_factory=dict)  # class key -> why not

    @property
    def ok(self) -> bool:
        return self.plan is not None and not self.plan.errors

    def explain(self) -> str:
        return "; ".join(f"{k}: {v}" for k, v in self.rejected.items()) or "no GPU nodes in the cluster"


def choices_from_spec(spec: MoEDeploymentSpec) -> Choices:
    return Choices(runner_backend=spec.moe.runnerBackend, a2a_backend=spec.moe.a2aBackend,
                   deferred_finalize=spec.moe.deferredFinalize, env=spec.env_dict(), tp=spec.parallelism.tp,
                   ep=spec.parallelism.ep, dp=spec.parallelism.dp, flashinfer_version=spec.engine.flashinferVersion)


def place(spec: MoEDeploymentSpec, ckpt: CheckpointInfo, classes: dict[str, ClassInventory],
          current: str | None = None) -> Placement:
    """`current` is the class chosen before: it is kept while it still fits (placement is sticky,
    so free-capacity churn never moves running pods)."""
    engine = spec.engine.name  # the CRD defaults it (bundled)
    choices = choices_from_spec(spec)
    per_node = spec.gpus_per_node()
    allowed = set(spec.gpu.allowedArchitectures)
    rejected: dict[str, str] = {}
    fits: list[tuple[ClassInventory, Plan]] = []
    for key, inv in sorted(classes.items()):
        g = inv.gpu_class
        if allowed and g.family not in allowed:
            rejected[key] = f"architecture {g.family} not in gpu.allowedArchitectures {sorted(allowed)}"
            continue
        if spec.gpu.product and g.product != spec.gpu.product:
            rejected[key] = f"product {g.product} is not the requested {spec.gpu.product}"
            continue
        if inv.gpus_per_node and inv.gpus_per_node < per_node:
            rejected[key] = f"{inv.gpus_per_node} GPUs per node < {per_node} needed per node"
            continue
        if len(inv.nodes) < spec.nodesPerReplica:
            rejected[key] = f"{len(inv.nodes)} nodes < {spec.nodesPerReplica} nodes per replica"
            continue
        p = plan(ckpt, g, choices, engine=engine, engine_version=spec.engine.version)
        if p.errors:
            rejected[key] = " ".join(p.errors)
            continue
        fits.append((inv, p))
    if not fits:
        return Placement(None, None, rejected)
    # Most free capacity first (in whole replicas' worth of per-node GPUs), then most free GPUs.
    fits.sort(key=lambda ip: (ip[0].gpu_class.key() != current, -ip[0].nodes_with_free(per_node),
                              -ip[0].free_gpus, ip[0].gpu_class.key()))
    inv, p = fits[0]
    return Placement(inv, p, rejected)


def impossible_everywhere(spec: MoEDeploymentSpec, ckpt: CheckpointInfo, families: list) -> str | None:
    """Admission: an explicit backend that the planner rejects on every allowed GPU class.

    `families` are GpuClass objects to consider (the allowed architectures, or every known family).
    Returns the planner's message, or None if at least one class accepts it.
    """
    engine = spec.engine.name
    choices = choices_from_spec(spec)
    messages = []
    for g in families:
        p = plan(ckpt, g, choices, engine=engine, engine_version=spec.engine.version)
        if not p.errors:
            return None
        messages.append(f"{g.key()}: {p.errors[0]}")
    return "; ".join(messages) if messages else None
