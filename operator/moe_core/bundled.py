"""resolve_bundled(): the one decision of the bundled runtime's MoE backend and deferred finalize.

The planner's bundled rules (moe_operator.planner) and the runtime's plan check
(moe_runtime.plan_check) both call it, so they share one candidate list (`registry.candidates`),
one set of "impossible here" problems (the runtime capability table, then the backend's
families / formats / requirements) and one deferred-finalize default. Pure, torch-free.

Rule ids: B0 format, B8 architecture, B5/B6 parallelism (moe_core.runtime), B1 an impossible
explicit backend, B2 the auto choice, B3 a candidate left out for a missing package, B4 deferred
finalize, DF1 deferred finalize requested but impossible, B7 ROCm warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import registry, runtime
from .formats import expert_format
from .plan import Decision, Provenance


@dataclass
class BundledResolution:
    expert_format: str | None
    backends: list[str]  # to self-test in order; the first is the choice; [] when nothing can run
    explicit: bool  # an explicit choice: never replaced by another backend
    deferred: bool
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # candidates left out, and why
    decisions: list[Decision] = field(default_factory=list)
    provenance: dict[str, Provenance] = field(default_factory=dict)  # by decision key (Plan.provenance)
    activation: str = "silu"  # the architecture's expert activation and biases (the self-test's problem)
    bias: bool = False

    @property
    def backend(self) -> str | None:
        return self.backends[0] if self.backends else None

    @property
    def reasons(self) -> list[str]:
        return [f"[{d.rule}] {d.reason}" for d in self.decisions] + self.notes


def _unverified(spec: registry.BackendSpec, auto: bool) -> str:
    if spec.verified:
        return ""
    return " (unverified: it has never run the GPU tests here" + (
        "; chosen because no verified backend fits)" if auto else ")")


def resolve_bundled(*, family: str, where: str, architecture: str, checkpoint_format: str, shared_experts: int,
                    installed: dict[str, str | None], backend: str = "auto", explicit: bool = False,
                    backend_source: str = "moe.runnerBackend", deferred: str = "auto",
                    deferred_from: str | None = None, deferred_rule: str = "user",
                    tp: int = 1, dp: int = 1, ep: int = 1, a2a: str = "none", rocm: bool = False, nodes: int = 1,
                    backends: tuple[registry.BackendSpec, ...] = registry.BACKENDS) -> BundledResolution:
    """Resolve the bundled MoE backend for (GPU family, checkpoint, parallelism).

    backend: "auto" or a registry name; `explicit` means the user chose it (no fallback), else it is
      a planner's pick the runtime may fall back from.
    deferred: "auto" | "on" | "off". With `deferred_from` (e.g. "MOE_DEFERRED_FINALIZE=1 set by the
      user", "the plan"), "on" is honoured when the backend can defer and is otherwise off, with the
      reason; without it (the spec field), an impossible "on" is an error (DF1).
    where: the GPU in words for messages, e.g. "sm90 (NVIDIA-H200)".
    """
    wfmt = expert_format(checkpoint_format)
    res = BundledResolution(wfmt, [], explicit, False)
    res.errors += runtime.problems(architecture, checkpoint_format, tp=tp, dp=dp, ep=ep, a2a=a2a, nodes=nodes)
    if runtime.format_problem(checkpoint_format, architecture=architecture) or wfmt is None:
        return res
    # an architecture whose experts have another activation or biases gets only the backends computing them
    act, bias = runtime.BUNDLED.experts_for(architecture)
    res.activation, res.bias = act, bias
    what = f"{architecture}'s experts ({act}{' with biases' if bias else ''})"
    fits = registry.candidates(family, wfmt, installed, backends=backends, activation=act, bias=bias)
    alt = ", ".join(c.name for c in fits) or "none"
    if backend != "auto":
        by_name = {b.name: b for b in backends}
        if backend not in by_name:
            res.errors.append(f"[B1] unknown MoE backend {backend!r} ({backend_source}); known: {', '.join(by_name)}")
            return res
        spec = by_name[backend]
        problems = []
        if family not in spec.families:
            problems.append(f"it runs on {', '.join(sorted(spec.families))}, not {where}")
        if wfmt not in spec.weight_formats:
            problems.append(f"it does not load {wfmt} experts (only {', '.join(sorted(spec.weight_formats))})")
        if not spec.runs_experts(act, bias):
            problems.append(f"it does not compute {what}")
        if not problems:
            problems += spec.missing_requirements(family, installed)
        if problems:
            res.errors.append(f"[B1] MoE backend {backend} ({backend_source}) is impossible here: {'; '.join(problems)}. "
                              f"Backends that can: {alt} ({wfmt} experts on {where})")
        chosen = spec
        if explicit:
            res.backends = [backend]
            why = f"MoE backend {backend} set explicitly by the user ({backend_source}; validated, never changed, no fallback)"
        else:
            res.backends = [backend] + [c.name for c in fits if c.name != backend]
            why = f"MoE backend {backend} from {backend_source}" + (
                f"; self-test fallbacks {', '.join(res.backends[1:])}" if len(res.backends) > 1 else "")
        res.decisions.append(Decision(key="moe.runnerBackend", value=backend, rule="user" if explicit else "B2",
                                      reason=why + _unverified(spec, False)))
    else:
        if not fits:
            have = ", ".join(f"{k} {v or 'absent'}" for k, v in sorted(installed.items()))
            res.errors.append(f"[B2] no bundled MoE backend runs {wfmt} experts on {where} with the installed "
                              f"packages ({have})")
            return res
        chosen = fits[0]
        res.backends = [c.name for c in fits]
        why = f"best registry backend for {wfmt} experts on {where}: {chosen.summary}"
        if len(fits) > 1:
            why += f" (runtime self-test falls back to: {', '.join(res.backends[1:])})"
        if (act, bias) != ("silu", False):
            why += f"; among the backends that compute {what}"
        res.decisions.append(Decision(key="moe.runnerBackend", value=chosen.name, rule="B2",
                                      reason=f"Use {chosen.name} as MoE runner backend for {architecture}: {why}"
                                      + _unverified(chosen, True)))
        for s in registry.candidates(family, wfmt, backends=backends, activation=act, bias=bias):
            if s not in fits:
                res.notes.append(f"[B3] {s.name} not used: {'; '.join(s.missing_requirements(family, installed))}")
    if rocm and chosen.name == "torch":
        res.warnings.append("[B7] on ROCm the bundled runtime only has the torch reference experts (correct, slow); "
                            "prefer engine sglang with aiter")

    res.provenance["moe.runnerBackend"] = Provenance(value=chosen.name if backend == "auto" else backend,
                                                     explicit=explicit, source=backend_source if backend != "auto"
                                                     else "default", candidates=list(res.backends))

    def decide(value: bool, rule: str, reason: str) -> None:
        res.deferred = value
        res.decisions.append(Decision(key="moe.deferredFinalize", value=str(value).lower(), rule=rule, reason=reason))
        res.provenance["moe.deferredFinalize"] = Provenance(
            value=str(value).lower(), explicit=deferred_from is not None or deferred != "auto",
            source=deferred_from or ("moe.deferredFinalize" if deferred != "auto" else "default"),
            candidates=["true", "false"] if can else ["false"])

    can = chosen.deferred_finalize
    if deferred_from is not None and deferred in ("on", "off"):
        on = deferred == "on" and can
        decide(on, deferred_rule, f"deferred finalize {'on' if on else 'off'}: {deferred_from}"
               + (f" ({chosen.name} cannot defer)" if deferred == "on" and not can else ""))
    elif deferred == "on" and not can:
        res.errors.append(f"[DF1] moe.deferredFinalize=on is impossible: backend {chosen.name} cannot stop before finalize; "
                          f"backends that can: {', '.join(c.name for c in fits if c.deferred_finalize) or 'none'}")
    elif deferred == "on" or (deferred == "auto" and can and shared_experts > 0):
        decide(True, "B4", f"deferred finalize on: {chosen.name} hands (gemm2_out, expert_weights, perm) to the fused "
                           "moe_finalize_fuse_shared kernel, which adds the shared expert in the same pass")
    elif deferred == "auto" and shared_experts <= 0:
        decide(False, "B4", f"{architecture} has no shared expert: nothing to fuse into finalize")
    else:
        decide(False, "B4", "deferred finalize off" + (" (moe.deferredFinalize=off)" if deferred == "off"
                                                       else f" ({chosen.name} cannot defer)"))
    return res


def parallel_args(tp: int, ep: int, nodes: int = 1) -> tuple[list[str], str]:
    """`moe-runtime serve` flags for a replica of `tp` GPUs (the API's convention: tp = the replica's GPU
    count, ep divides it) on `nodes` nodes, and the reason. The runtime runs max(--tp, --ep) ranks; its
    attention (and vocab) tensor parallel spans --tp consecutive ranks, replicated over the rest. On
    several nodes with ep = tp (whole experts per rank) --tp is one node's GPUs, so the attention
    all-reduce never leaves a node (NVLink) and only the MoE combine crosses nodes; otherwise --tp spans
    the replica and the attention all-reduce crosses nodes too (said in the reason). Pure."""
    per_node = tp // max(nodes, 1)
    where = f"{nodes} nodes x {per_node} GPUs (LeaderWorkerSet: rank = LWS_WORKER_INDEX x {per_node} + local GPU)" \
        if nodes > 1 else f"{tp} GPU(s) of one node"
    if nodes > 1 and ep == tp and per_node > 1:
        return (["--tp", str(per_node), "--ep", str(ep)],
                f"bundled runtime on {where}: attention and vocab tensor-parallel over the {per_node} GPUs of each node "
                f"(replicated per node: its all-reduce stays on NVLink), routed experts split over all {ep} ranks, "
                f"dense layers over all {tp}; {tp} processes, NCCL; only the MoE combine and dense all-reduce cross nodes")
    cross = " (the attention all-reduce crosses nodes; ep = tp keeps it inside a node)" if nodes > 1 else ""
    return (["--tp", str(tp), "--ep", str(ep)],
            f"bundled runtime on {where}: attention and dense layers tensor-parallel over {tp} GPU(s){cross}, routed "
            f"experts split over {ep} expert-parallel group(s) ({max(tp, ep)} processes, NCCL, all-reduce or "
            f"all-to-all combine by batch size)")


def deferred_for(backend: str, want: bool) -> tuple[bool, str | None]:
    """A fallback backend that cannot stop before finalize runs the plain path (and says so)."""
    if want and not registry.get(backend).deferred_finalize:
        return False, f"{backend} cannot defer finalize: shared expert added after the routed sum"
    return want, None
