"""The Plan: what the planner decided for one (checkpoint, GPU class, engine) and why.

Serialised as JSON into `status.plan`, into an Event, and into a file mounted in the pod that the
runtime re-checks. Keys are stable (the CLI's `-o json` prints exactly this shape).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_serializer


class PlanGpu(BaseModel):
    family: str
    product: str = ""


class PlanCheckpoint(BaseModel):
    architecture: str
    format: str


class PlanEngine(BaseModel):
    name: str
    version: str | None = None


class PlanMoE(BaseModel):
    runnerBackend: str = Field(description="MoE runner backend; 'auto' means the engine decides at load")
    a2aBackend: str = "none"
    deferredFinalize: bool = False


class PlanLayout(BaseModel):
    """GPUs of one replica, from the spec or sized from the checkpoint's bytes (moe_core.sizing)."""

    tp: int
    gpusPerNode: int
    nodes: int = 1


class Decision(BaseModel):
    """One decision: which output, which value, by which rule, why."""

    key: str  # e.g. "moe.runnerBackend", "env.SGLANG_ENABLE_MOE_DEFERRED_FINALIZE"
    value: str
    rule: str  # rule id (S2, V1, B1, ...; "user" for explicit values)
    reason: str


class Provenance(BaseModel):
    """Where one decided value came from, for the pod to verify rather than dig out of the decisions."""

    value: str
    explicit: bool  # the user chose it: validated, never replaced (no fallback)
    source: str  # "spec moe.runnerBackend", "env MOE_RUNNER_BACKEND", "default" (the planner's rules), ...
    candidates: list[str] = Field(default_factory=list)  # what could run here, in order (the pod's self-test order)


class PlanImage(BaseModel):
    """The image's kernel packages as the operator assumed them (moe_core.image_contents); the pod
    re-resolves only where what it has installed differs."""

    packages: dict[str, str]  # package -> version; a package the image lacks is left out (no nulls in status)


class Plan(BaseModel):
    gpu: PlanGpu
    checkpoint: PlanCheckpoint
    engine: PlanEngine
    moe: PlanMoE
    layout: PlanLayout | None = Field(None, description="set by placement (the planner alone does not size)")
    env: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    errors: list[str] = Field(default_factory=list)
    decisions: list[Decision] = Field(default_factory=list)
    # by decision key (moe.runnerBackend, moe.deferredFinalize): set by the engines whose pod verifies the plan
    provenance: dict[str, Provenance] = Field(default_factory=dict)
    image: PlanImage | None = None

    @model_serializer(mode="wrap")
    def _without_empty_provenance(self, handler) -> dict[str, Any]:
        """A plan without provenance serialises as before it existed (status.plan, plan.json and the
        inputs hash of the engines that set none do not change)."""
        out = handler(self)
        if isinstance(out, dict):
            if not self.provenance:
                out.pop("provenance", None)
            if self.image is None:
                out.pop("image", None)
        return out

    @property
    def ok(self) -> bool:
        return not self.errors
