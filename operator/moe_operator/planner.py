"""The planner: (checkpoint, GPU class, user choices, engine) -> Plan. Pure: no I/O, no torch.

It only dispatches: each engine's rows live in its folder (engines/<engine>/plan.py: select rows S*/W*,
validate rows V*/K*, env rows E*, the split rules K40/K41/WK40/WK41; the bundled runtime's come from
`moe_core.resolve_bundled` over the kernel-backend registry), the engine-free machinery (Rule 0, the
select-table walk, the validate-row run, the start-up checks of explicit choices) in `selection`, and
the accepted values in `engines.vocabulary`. The engine is asked through `engines.registry`.
"""

from __future__ import annotations

from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import GpuClass
from moe_core.plan import Plan, PlanCheckpoint, PlanEngine, PlanGpu, PlanImage

from .engines import registry as engines
from .engines.archs import DSV4, GPT_OSS  # noqa: F401  (re-exported)
from .engines.sglang import vocab as _sglang
from .engines.sglang.plan import CHECKS as SGLANG_CHECKS, SELECT as SGLANG_SELECT  # noqa: F401  (re-exported)
from .engines.sglang.plan import sglang_moe_shape_errors  # noqa: F401  (re-exported)
from .engines.vllm import vocab as _vllm
from .engines.vllm.plan import CHECKS as VLLM_CHECKS, SELECT as VLLM_SELECT  # noqa: F401  (re-exported)
from .engines.vllm.plan import vllm_moe_shape_errors  # noqa: F401  (re-exported)
from .engines.vocabulary import ALL_A2A, ALL_RUNNERS, DEFAULT_ENGINE, DEFAULT_VERSIONS, ENGINES  # noqa: F401  (re-exported)
from .selection import Builder, Check, Choices, Facts, Select, truthy, vtuple  # noqa: F401  (re-exported)

# The accepted values under the names the planner's callers (and tests) have used; the lists are the vocab's.
SGLANG_FLASHINFER_PIN = _sglang.FLASHINFER_PIN
SGLANG_RUNNERS = _sglang.RUNNERS
SGLANG_A2A = _sglang.A2A
VLLM_MOE_BACKENDS = _vllm.MOE_BACKENDS
DEEPSEEK_FAMILY = _sglang.DEEPSEEK_FAMILY
QWEN3_FAMILY = _sglang.QWEN3_FAMILY

# Decision rule id -> (does this value fall back, what is given up), every engine's (rule ids are unique).
FALLBACKS = {k: v for e in engines.REGISTRY.values() for k, v in e.fallbacks.items()}


def auto_fallbacks(p: Plan) -> list[str]:
    """Where this plan's automatic choices fall back (pure: plan in, messages out). Explicit values
    are never fallbacks (Rule 0); a plan with errors has no choices to judge (the caller reports those)."""
    if p.errors:
        return []
    engine = engines.get(p.engine.name)
    out = []
    for d in p.decisions:
        fb = engine.fallbacks.get(d.rule)
        if fb and fb[0](d.value):
            out.append(f"[{d.rule}] {d.key}={d.value}: {fb[1]}")
    # the release was not read: its start-up checks are not judged (engine_rules.coverage_note)
    out += [w for w in p.warnings if w.startswith(("[FI0] ", "[ER0] "))]
    return out + engine.auto_fallbacks(p)


def default_flashinfer(engine: str, version: str, gpu: GpuClass) -> str | None:
    """flashinfer-python in the engine's image when the user did not say."""
    return engines.get(engine).default_flashinfer(version, gpu)


def _facts(checkpoint: CheckpointInfo, gpu: GpuClass, choices: Choices | None, engine: str,
           engine_version: str | None) -> Facts:
    e = engines.get(engine)
    choices = e.choices(choices or Choices())
    version = engine_version or e.default_version
    fi = choices.flashinfer_version
    fi = None if fi == "none" else (fi or e.default_flashinfer(version, gpu))
    return Facts(ckpt=checkpoint, gpu=gpu, choices=choices, engine=engine, version=version, flashinfer=fi)


def moe_split_refusal(f: Facts, runner: str = "auto") -> str | None:
    """The one predicate for an MoE tensor-parallel split that the chosen engine version refuses at start-up,
    whatever the runner: K40's text for sglang, WK40's for vLLM (with the --moe-backend value vLLM gets), None when
    the engine accepts the split (and for the bundled engine, whose own layout rules are resolve_bundled's). The
    engines' plans and placement's layout choice (split_refusal, placement.size_layout) both call it."""
    return engines.get(f.engine).moe_split_refusal(f, runner)


def split_refusal(checkpoint: CheckpointInfo, gpu: GpuClass, choices: Choices, engine: str,
                  engine_version: str | None = None) -> str | None:
    """moe_split_refusal, then the attention split refusal (K41/WK41), for a layout the planner has not planned yet
    (placement sizes tp with it): the runner is the one plan() would give the engine."""
    f = _facts(checkpoint, gpu, choices, engine, engine_version)
    return engines.get(engine).split_refusal(f)


def plan(checkpoint: CheckpointInfo, gpu: GpuClass, choices: Choices | None = None,
         engine: str = DEFAULT_ENGINE, engine_version: str | None = None) -> Plan:
    """Plan the MoE backend/env/args for one checkpoint on one GPU class. Pure."""
    f = _facts(checkpoint, gpu, choices, engine, engine_version)
    choices, version, e = f.choices, f.version, engines.get(engine)
    b = Builder(f)
    if not checkpoint.is_moe:
        b.warnings.append(f"[M0] {checkpoint.architecture} has no routed experts in config.json: MoE rules do not apply")
    moe = e.plan_moe(b)
    if choices.a2a_backend != "none" and choices.ep <= 1 and e.a2a_needs_ep:
        b.errors.append(f"[A1] moe.a2aBackend={choices.a2a_backend} needs expert parallelism (parallelism.ep > 1)")
    env = {**b.env, **choices.env}  # user env last: the user always wins
    return Plan(
        gpu=PlanGpu(family=gpu.family, product=gpu.product),
        checkpoint=PlanCheckpoint(architecture=checkpoint.architecture, format=checkpoint.format),
        engine=PlanEngine(name=engine, version=version),
        moe=moe, env=env, args=b.args, reasons=b.reasons, warnings=b.warnings,
        errors=list(dict.fromkeys(b.errors)), decisions=b.decisions, provenance=b.provenance,
        image=None if b.image_packages is None else PlanImage(
            packages={k: v for k, v in b.image_packages.items() if v is not None}),
    )
