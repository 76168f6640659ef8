"""The bundled runtime's plan: moe_core.resolve_bundled over the runtime capability table and the kernel-backend
registry (the same call the runtime's plan check makes), its parallel flags (B6), and where its automatic backend
choice falls back (B3). Pure."""

from __future__ import annotations

import dataclasses

from moe_core import registry
from moe_core.bundled import parallel_args, resolve_bundled
from moe_core.formats import expert_format
from moe_core.gpu import GpuClass
from moe_core.plan import Plan, PlanMoE

from ...images import bundled_image_flashinfer, bundled_image_packages
from ...selection import Builder, Choices, truthy


def choices(c: Choices) -> Choices:
    """The runtime's own env switch is an explicit choice too: validated like the spec field."""
    if c.runner_backend == "auto" and c.env.get("MOE_RUNNER_BACKEND"):
        return dataclasses.replace(c, runner_backend=c.env["MOE_RUNNER_BACKEND"])
    return c


def default_flashinfer(version: str, gpu: GpuClass) -> str | None:
    """flashinfer-python in the runtime image for this GPU (images.bundled_image_flashinfer)."""
    return bundled_image_flashinfer(gpu)


def plan_moe(b: Builder) -> PlanMoE:
    """The bundled runtime's rules: moe_core.resolve_bundled over the runtime capability table and the
    kernel-backend registry, the same call the runtime's plan check makes. The plan (plan.json) is
    the only channel to the pod: no MOE_* env is rendered for the runtime, the user's env passes
    through as it is."""
    f = b.f
    # the image's kernel packages (moe_core.image_contents; flashinfer as the spec or the image has it): the
    # plan records them, and the pod re-resolves only where it has others installed
    installed = {**bundled_image_packages(f.gpu), "flashinfer-python": f.flashinfer}
    env_df = f.env("MOE_DEFERRED_FINALIZE")
    if env_df is not None:
        deferred, deferred_from = ("on" if truthy(env_df) else "off"), "MOE_DEFERRED_FINALIZE set explicitly by the user"
    else:
        deferred, deferred_from = f.choices.deferred_finalize, None
    user = f.choices.runner_backend
    r = resolve_bundled(family=f.fam, where=f.gpu_name, architecture=f.arch, checkpoint_format=f.fmt,
                        shared_experts=f.ckpt.numSharedExperts or 0, installed=installed, backend=user,
                        explicit=user != "auto", deferred=deferred, deferred_from=deferred_from,
                        tp=f.choices.tp, dp=f.choices.dp, ep=f.choices.ep, a2a=f.a2a, rocm=f.rocm,
                        nodes=f.choices.nodes)
    b.errors += r.errors
    b.warnings += r.warnings
    for d in r.decisions:
        b.decide(d.key, d.value, d.rule, d.reason)
    b.reasons += r.notes
    b.provenance.update(r.provenance)
    b.image_packages = installed
    tp, ep, nodes = f.choices.tp, f.choices.ep, f.choices.nodes
    if max(tp, ep) > 1 and not r.errors:
        # moe-runtime serve --tp/--ep: one process per GPU (moe_runtime.parallel), over the nodes of a
        # LeaderWorkerSet group when nodes > 1
        args, why = parallel_args(tp, ep, nodes)
        b.args += args
        b.decide("parallel", f"tp={tp} ep={ep}" + (f" nodes={nodes}" if nodes > 1 else ""), "B6", why)
    return PlanMoE(runnerBackend=r.backend or user, a2aBackend=f.a2a, deferredFinalize=r.deferred)



def auto_fallbacks(p: Plan) -> list[str]:
    """B3: a backend that ranks above the automatic choice for these experts on this GPU but is not used here."""
    auto = [d for d in p.decisions if d.key == "moe.runnerBackend" and d.rule == "B2"]
    if not auto:
        return []
    out = []
    wfmt = expert_format(p.checkpoint.format)
    ranked = [b.name for b in registry.candidates(p.gpu.family, wfmt)] if wfmt else []
    chosen = auto[-1].value
    better = ranked[:ranked.index(chosen)] if chosen in ranked else []
    for r in p.reasons:  # "[B3] NAME not used: WHY" (moe_core.bundled.resolve_bundled)
        name, _, why = r.removeprefix("[B3] ").partition(" not used: ")
        if r.startswith("[B3] ") and name in better:
            out.append(f"[B3] moe.runnerBackend={chosen}: {name} ranks above it for {wfmt} experts but is not "
                       f"used here: {why}")
    return out


# What the user's env already chooses (moe-operator plan warns where --set contradicts it; the env wins in the pod).
DEFERRED_ENV = "MOE_DEFERRED_FINALIZE"


def env_runner(env: dict[str, str], family: str) -> list[tuple[str, str]]:
    """(env description, runner it selects): the runtime's MOE_RUNNER_BACKEND."""
    v = env.get("MOE_RUNNER_BACKEND")
    return [(f"MOE_RUNNER_BACKEND={v}", v.strip())] if v else []
