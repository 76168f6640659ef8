"""The Plan: what the planner decided for one (checkpoint, GPU class, engine) and why.

Serialised as JSON into `status.plan`, into an Event, and into a file mounted in the pod that the
runtime re-checks. Keys are stable (the CLI's `-o json` prints exactly this shape). Every field is
written by the operator's planner; the descriptions are what `kubectl explain moed.status.plan` shows.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_serializer


class PlanGpu(BaseModel):
    family: str = Field(description="GPU architecture key the plan is for (sm90, sm100, gfx942, ...)")
    product: str = Field("", description=(
        "GPU product name (e.g. NVIDIA-H200) when the class names one; empty: any GPU of the family"))


class PlanCheckpoint(BaseModel):
    architecture: str = Field(description="the checkpoint's config.json architectures[0] the plan was made for")
    format: str = Field(description="the checkpoint format the plan serves (bf16, fp8, nvfp4, mxfp4, gptq, ...)")


class PlanEngine(BaseModel):
    name: str = Field(description="inference engine the pods run (spec.engine.name)")
    version: str | None = Field(None, description=(
        "engine release whose start-up rules the plan was checked against (spec.engine.version, else the "
        "engine's default release)"))


class PlanMoE(BaseModel):
    runnerBackend: str = Field(description="MoE runner backend; 'auto' means the engine decides at load")
    a2aBackend: str = Field("none", description=(
        "all-to-all backend expert parallelism dispatches tokens with; 'none': no expert-parallel all-to-all"))
    deferredFinalize: bool = Field(False, description=(
        "whether the top-k reduction is fused with the shared-expert add (spec moe.deferredFinalize, 'auto' resolved)"))


class PlanLayout(BaseModel):
    """GPUs of one replica, from the spec or sized from the checkpoint's bytes (moe_core.sizing)."""

    tp: int = Field(description="tensor-parallel size: GPUs one replica's weights are split over")
    gpusPerNode: int = Field(description="GPUs each pod of the replica requests")
    nodes: int = Field(1, description="pods (nodes) per replica; above 1 the replica is a multi-node LeaderWorkerSet")


class Decision(BaseModel):
    """One decision: which output, which value, by which rule, why."""

    key: str = Field(description=(  # e.g. "moe.runnerBackend", "env.SGLANG_ENABLE_MOE_DEFERRED_FINALIZE"
        "what was decided: a plan field (moe.runnerBackend) or a rendered variable (env.NAME) or argument"))
    value: str = Field(description="the value chosen")
    rule: str = Field(description=(  # rule id (S2, V1, B1, ...; "user" for explicit values)
        "id of the planner rule that chose it (S2, V1, B1, ... in docs/tuning-rules.md); 'user': set in the spec"))
    reason: str = Field(description="why, in words, citing the engine code or measurement the rule rests on")


class Provenance(BaseModel):
    """Where one decided value came from, for the pod to verify rather than dig out of the decisions."""

    value: str = Field(description="the value decided")
    explicit: bool = Field(description=(  # the user chose it: validated, never replaced (no fallback)
        "true when the user chose it: validated, never replaced by a fallback at start-up"))
    source: str = Field(description=(  # "spec moe.runnerBackend", "env MOE_RUNNER_BACKEND", "default", ...
        "where the value came from: a spec field (spec moe.runnerBackend), an env variable, or 'default' (the "
        "planner's rules)"))
    candidates: list[str] = Field(default_factory=list, description=(  # the pod's self-test order
        "values that could run here, in the order the pod's self-test tries them"))


class PlanImage(BaseModel):
    """The image's kernel packages as the operator assumed them (moe_core.image_contents); the pod
    re-resolves only where what it has installed differs."""

    packages: dict[str, str] = Field(description=(  # a package the image lacks is left out (no nulls in status)
        "kernel package name -> version the plan assumed the image holds; a package the image lacks is left out"))


class Plan(BaseModel):
    gpu: PlanGpu = Field(description="the GPU class the plan is for")
    checkpoint: PlanCheckpoint = Field(description="the checkpoint facts the plan was made from")
    engine: PlanEngine = Field(description="the engine and release the plan was checked against")
    moe: PlanMoE = Field(description="the MoE kernel choices, after the planner resolved 'auto'")
    layout: PlanLayout | None = Field(None, description="set by placement (the planner alone does not size)")
    env: dict[str, str] = Field(default_factory=dict, description=(
        "environment the engine container gets: the planner's variables, then spec env (the user's value wins)"))
    args: list[str] = Field(default_factory=list, description="engine command-line arguments the planner renders")
    reasons: list[str] = Field(default_factory=list, description="why each choice was made, one line per choice")
    warnings: list[str] = Field(default_factory=list, description=(
        "what may not work as planned, but does not stop the deployment (also posted as Warning Events)"))
    errors: list[str] = Field(default_factory=list, description=(
        "why the plan is refused; non-empty: no pods are created (condition Planned=False)"))
    decisions: list[Decision] = Field(default_factory=list, description="each decided value with its rule and reason")
    # by decision key (moe.runnerBackend, moe.deferredFinalize): set by the engines whose pod verifies the plan
    provenance: dict[str, Provenance] = Field(default_factory=dict, description=(
        "decision key (moe.runnerBackend, ...) -> where its value came from; set by engines whose pod verifies "
        "the plan"))
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
