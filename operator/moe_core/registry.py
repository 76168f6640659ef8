"""The one registry of MoE kernel backends the bundled runtime can run.

Torch-free on purpose: the control plane's planner reads these capabilities to choose a backend
for a GPU class, and the runtime reads the same entries to instantiate, self-test and fall back.
No backend name is special-cased anywhere else.

Weight formats are the *expert* weight formats (`moe_core.formats.EXPERT_FORMATS`); the mapping
from a checkpoint format (e.g. `dsv4_fp4`) to its expert weight format is `moe_core.formats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .formats import EXPERT_FORMATS, expert_format
from .gpu import AMD_FAMILIES, NVIDIA_FAMILIES

ALL_NVIDIA = frozenset(NVIDIA_FAMILIES)
ALL_AMD = frozenset(AMD_FAMILIES)
CPU = "cpu"


def version_tuple(v: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in v.replace("-", ".").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():  # "15rc1", "post1" etc: stop after the numeric prefix
            break
    return tuple(out)


def version_at_least(have: str | None, need: str) -> bool:
    return have is not None and version_tuple(have) >= version_tuple(need)


@dataclass(frozen=True)
class Requirement:
    """A package the backend needs in the image, optionally only on some GPU families."""

    package: str  # distribution name, e.g. "flashinfer-python"
    min_version: str
    why: str
    families: frozenset[str] | None = None  # None: every family the backend supports

    def applies_to(self, family: str) -> bool:
        return self.families is None or family in self.families


@dataclass(frozen=True)
class BackendSpec:
    name: str
    summary: str
    families: frozenset[str]  # GPU families (`sm90`, ...) and/or "cpu"
    weight_formats: frozenset[str]
    deferred_finalize: bool  # can stop before finalize and hand over (gemm2_out, weights, perm)
    priority: int  # higher is preferred when several backends fit
    implementation: str  # "module:attr" the runtime imports (needs torch)
    requirements: tuple[Requirement, ...] = field(default_factory=tuple)
    a2a: frozenset[str] = frozenset({"none"})
    activation: str = "bf16"  # compute precision of the activations (W4A16 = weight-only)
    # When and where it ran and passed the GPU tests here (tests/gpu), or None: never run here.
    # An unverified backend never outranks a verified one (`candidates`).
    verified: str | None = None
    # expert activation functions it computes ("silu": silu(gate) * up; "swiglu_oai": gpt-oss's
    # clamped SwiGLU, moe_kernels.reference.activate) and whether it adds per-expert GEMM biases
    # (gpt-oss); the experts classes declare the same as class attributes (tests check they agree)
    expert_activations: frozenset[str] = frozenset({"silu"})
    expert_bias: bool = False

    def supports(self, family: str, weight_format: str) -> bool:
        return family in self.families and weight_format in self.weight_formats

    def runs_experts(self, activation: str = "silu", bias: bool = False) -> bool:
        """Whether it computes a model's experts with this activation (and biases, if it has them)."""
        return activation in self.expert_activations and (self.expert_bias or not bias)

    def requirements_for(self, family: str) -> tuple[Requirement, ...]:
        return tuple(r for r in self.requirements if r.applies_to(family))

    def missing_requirements(self, family: str, installed: dict[str, str | None]) -> list[str]:
        """Human-readable unmet requirements given {package: version or None}."""
        missing = []
        for r in self.requirements_for(family):
            have = installed.get(r.package)
            if not version_at_least(have, r.min_version):
                got = f"found {have}" if have else "not installed"
                missing.append(f"{r.package}>={r.min_version} ({got}): {r.why}")
        return missing


FLASHINFER = "flashinfer-python"

BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec(
        name="flashinfer_trtllm",
        summary="FlashInfer TRT-LLM-gen fused NVFP4 MoE (W4A4); SM100 only",
        families=frozenset({"sm100"}),
        # flashinfer also has FP8-block and BF16 trtllm-gen MoE; our wrapper covers NVFP4 only so far.
        weight_formats=frozenset({"nvfp4"}),
        deferred_finalize=True,
        priority=90,
        implementation="moe_kernels.flashinfer_backends:FlashinferTrtllmExperts",
        requirements=(
            Requirement(FLASHINFER, "0.6.15", "expert_weights must be allocated as bf16 for deferred finalize (flashinfer#3644)"),
        ),
        activation="nvfp4/fp8/bf16",
    ),
    BackendSpec(
        name="flashinfer_mxfp4",
        summary="FlashInfer CUTLASS W4A16 MXFP4 MoE on SM90",
        # flashinfer also runs MXFP4 on SM100 (TRT-LLM) and SM120 (CUTLASS MXFP8xMXFP4); our wrapper
        # covers the SM90 path only so far.
        families=frozenset({"sm90"}),
        weight_formats=frozenset({"mxfp4"}),
        deferred_finalize=False,
        priority=85,
        implementation="moe_kernels.flashinfer_backends:FlashinferMxfp4Experts",
        requirements=(
            Requirement(FLASHINFER, "0.6.11", "SM90 W4A16 interleave helpers (flashinfer#3084)", frozenset({"sm90"})),
        ),
    ),
    BackendSpec(
        name="flashinfer_cutlass",
        summary="FlashInfer CUTLASS NVFP4 MoE; SM100/SM110/SM120 (trtllm-gen is SM100-only)",
        families=frozenset({"sm100", "sm110", "sm120", "sm121"}),
        weight_formats=frozenset({"nvfp4"}),
        deferred_finalize=False,
        priority=80,
        implementation="moe_kernels.flashinfer_backends:FlashinferCutlassExperts",
        requirements=(Requirement(FLASHINFER, "0.6.15", "CUTLASS NVFP4 fused MoE"),),
        activation="nvfp4",
    ),
    BackendSpec(
        name="triton",
        summary="Our Triton grouped GEMM: weight-only FP4/FP8 dequantised in registers, bf16 math (W4A16/W8A16), fused SiLU and fused finalize; FP4 decode/small batches on a fragment-order mma.sync kernel (SM80+)",
        families=ALL_NVIDIA,
        weight_formats=frozenset(EXPERT_FORMATS),
        deferred_finalize=True,
        priority=50,
        implementation="moe_kernels.triton_moe:TritonExperts",
        requirements=(Requirement("triton", "3.0", "Triton JIT kernels"),),
        verified="2026-11-29 on H200 (tests/gpu, bench/README.md)",
        expert_activations=frozenset({"silu", "swiglu_oai"}),
        expert_bias=True,
    ),
    BackendSpec(
        name="torch",
        summary="Torch reference experts (dequantise, bf16 matmul per expert); correct everywhere, slow",
        families=ALL_NVIDIA | ALL_AMD | {CPU},
        weight_formats=frozenset(EXPERT_FORMATS),
        deferred_finalize=True,
        priority=10,
        implementation="moe_kernels.reference:TorchExperts",
        verified="2026-11-29 on H200 (the reference of tests/gpu) and on CPU in every unit-test run",
        expert_activations=frozenset({"silu", "swiglu_oai"}),
        expert_bias=True,
    ),
)

_BY_NAME = {b.name: b for b in BACKENDS}


def get(name: str) -> BackendSpec:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown MoE backend {name!r}; known: {', '.join(_BY_NAME)}") from None


def names() -> list[str]:
    return list(_BY_NAME)


def candidates(family: str, weight_format: str, installed: dict[str, str | None] | None = None,
               a2a: str = "none", backends: tuple[BackendSpec, ...] = BACKENDS, *, activation: str = "silu",
               bias: bool = False) -> list[BackendSpec]:
    """Backends able to run `weight_format` on `family`, best first: every verified backend (by
    priority) before any unverified one (by priority), so an unverified backend is chosen for `auto`
    only when nothing verified fits.

    With `installed` given ({package: version or None}), backends whose requirements are not met
    are left out; with None, requirements are not checked (the planner checks them against the image).
    activation / bias: the model's expert activation and whether its experts have biases (gpt-oss:
    "swiglu_oai", True); backends that cannot compute them are left out.
    """
    out = [b for b in backends if b.supports(family, weight_format) and a2a in b.a2a
           and b.runs_experts(activation, bias)]
    if installed is not None:
        out = [b for b in out if not b.missing_requirements(family, installed)]
    return sorted(out, key=lambda b: (b.verified is None, -b.priority))


def backends_for_format(checkpoint_format: str) -> list[str]:
    """Registry backends whose kernels run this checkpoint format's experts (any GPU family); the
    bundled runtime serves the checkpoint only if its loader reads it too (moe_core.runtime)."""
    wfmt = expert_format(checkpoint_format)
    return [b.name for b in BACKENDS if wfmt in b.weight_formats]
