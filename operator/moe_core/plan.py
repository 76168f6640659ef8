"""The Plan: what the planner decided for one (checkpoint, GPU class, engine) and why.

Serialised as JSON into `status.plan`, into an Event, and into a file mounted in the pod that the
runtime re-checks. Keys are stable (the CLI's `-o json` prints exactly this shape).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


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

    @property
    def ok(self) -> bool:
        return not self.errors
