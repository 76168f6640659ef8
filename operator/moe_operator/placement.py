"""Placement: choose the GPU class for a MoEDeployment and plan for it. Pure.

Candidates: the allowed architectures (all if unset), the pinned product if any, enough GPUs per
node for the parallelism, enough nodes for one replica, enough GPU memory for the weights and the
KV cache (moe_core.sizing: the smallest layout that fits when the spec leaves it unset, passing over
a layout whose MoE split the chosen engine version refuses: planner.split_refusal, K40/WK40); each
candidate is planned and a class whose plan has errors is rejected with the planner's message.
Among the rest, most free GPUs wins.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from moe_core import sizing
from moe_core.checkpoint import CheckpointInfo
from moe_core.plan import Decision, Plan, PlanLayout

from .api import MoEDeploymentSpec
from .engines import registry as engines
from .inventory import ClassInventory
from .planner import Choices, plan, split_refusal


@dataclass
class Placement:
    inventory: ClassInventory | None
    plan: Plan | None
    rejected: dict[str, str] = field(default_factory=dict)  # class key -> why not
    spec: MoEDeploymentSpec | None = None  # the spec with the sized layout filled in (what render() gets)

    @property
    def ok(self) -> bool:
        return self.plan is not None and not self.plan.errors

    def explain(self) -> str:
        return "; ".join(f"{k}: {v}" for k, v in self.rejected.items()) or "no GPU nodes in the cluster"


def choices_from_spec(spec: MoEDeploymentSpec, tp: int | None = None) -> Choices:
    return Choices(runner_backend=spec.moe.runnerBackend, a2a_backend=spec.moe.a2aBackend,
                   deferred_finalize=spec.moe.deferredFinalize, env=spec.env_dict(), tp=tp or spec.gpus_per_replica(),
                   ep=spec.parallelism.ep, dp=spec.parallelism.dp, flashinfer_version=spec.engine.flashinferVersion,
                   nodes=spec.nodesPerReplica)


@dataclass(frozen=True)
class Layout:
    gpus: int  # per replica (= tp)
    nodes: int
    rule: str  # Z1 sized, Z2 explicit and fits, Z0 not sized
    reason: str
    warning: str | None = None


def size_layout(spec: MoEDeploymentSpec, ckpt: CheckpointInfo, inv: ClassInventory) -> Layout | str:
    """The replica's layout on one class, or why the class cannot hold the model (with the numbers).

    Explicit (parallelism.tp or gpusPerReplica set): checked, never changed. Unset: the smallest
    tensor-parallel size that fits (powers of two up to one node's GPUs, then whole nodes when the
    engine runs multi-node replicas and nodesPerReplica is left at 1) and whose MoE split the chosen
    sglang/vLLM version accepts (planner.split_refusal, the predicate of the planner's K40/WK40 rows):
    a split it refuses is passed over for the next layout that fits, and the reason says so."""
    g = inv.gpu_class
    per_node_avail = inv.gpus_per_node or max(inv.free_per_node.values(), default=0)
    memory = sizing.memory_bytes(g)
    knobs = dict(max_len=spec.engine.maxModelLen, concurrency=spec.engine.maxConcurrency)
    if spec.layout_given():
        gpus, nodes = spec.gpus_per_replica(), spec.nodesPerReplica
        if memory is None or not ckpt.totalBytes:
            why = "GPU memory unknown (no nvidia.com/gpu.memory label)" if memory is None else \
                "checkpoint size unknown (inspection skipped)"
            return Layout(gpus, nodes, "Z0", f"tp={gpus} as given; not sized: {why}", f"[Z0] layout not sized: {why}")
        fit = sizing.estimate(ckpt, memory, gpus, nodes, **knobs)
        if not fit.fits:
            return (f"[Z2] tp={gpus} as given does not fit {sizing.gib(ckpt.totalBytes)} of weights on {g.key()}: "
                    f"{fit.numbers()}; leave parallelism.tp and gpusPerReplica unset to size it, or use more GPUs")
        return Layout(gpus, nodes, "Z2", f"tp={gpus} as given fits {sizing.gib(ckpt.totalBytes)} of weights: {fit.numbers()}")
    multiple = math.lcm(spec.parallelism.ep, spec.parallelism.dp)
    if memory is None or not ckpt.totalBytes:
        why = "GPU memory unknown (no nvidia.com/gpu.memory label)" if memory is None else \
            "checkpoint size unknown (inspection skipped)"
        gpus = max(multiple, 1) * spec.nodesPerReplica
        return Layout(gpus, spec.nodesPerReplica, "Z0", f"tp={gpus}: not sized ({why})",
                      f"[Z0] layout not sized: {why}; set parallelism.tp to choose it")
    if spec.nodesPerReplica > 1:  # nodes given, GPUs per node not: the whole nodes
        per_node = per_node_avail
        fit = sizing.estimate(ckpt, memory, per_node * spec.nodesPerReplica, spec.nodesPerReplica, **knobs)
        if not fit.fits:
            return (f"[Z1] does not fit on {spec.nodesPerReplica} nodes x {per_node} GPUs: "
                    f"{sizing.gib(ckpt.totalBytes)} of weights, {fit.numbers()}")
        return Layout(fit.gpus, fit.nodes, "Z1", f"tp={fit.gpus} ({spec.nodesPerReplica} nodes x {per_node} GPUs): {fit.numbers()}")
    max_nodes = max(len(inv.nodes), 1)
    more = " (one node of this class; engines sglang and vllm span nodes when there are more)" if max_nodes == 1 else ""
    engine = engines.get(spec.engine.name)
    if (caps := engine.replica_limits) is not None:  # what the runtime runs in one replica (moe_core.runtime)
        per_node_avail = min(per_node_avail, caps.max_gpus_per_node, caps.max_tp)
        max_nodes = min(max_nodes, caps.max_nodes, max(caps.max_tp // max(per_node_avail, 1), 1))
        more = (f" (the {engine.name} runtime serves at most {caps.max_gpus_per_node} GPUs per node, {caps.max_tp} per "
                f"replica and {caps.max_nodes} nodes per replica; engines sglang and vllm shard further)")
    refuses = None
    if caps is None:  # an engine that shards as far as asked: its split rules pass over the sizes it refuses
        def refuses(fit: sizing.Fit) -> str | None:  # K40 / WK40's own predicate (planner.moe_split_refusal)
            c = dataclasses.replace(choices_from_spec(spec, tp=fit.gpus), nodes=fit.nodes)
            return split_refusal(ckpt, g, c, spec.engine.name, spec.engine.version)
    choice = sizing.smallest_fit(ckpt, g, per_node_avail, max_nodes, multiple_of=multiple, refuses=refuses, **knobs)
    if choice.fit is None:
        return f"[Z1] {choice.reason}{more}"
    return Layout(choice.fit.gpus, choice.fit.nodes, "Z1", choice.reason)


def _with_layout(spec: MoEDeploymentSpec, layout: Layout) -> MoEDeploymentSpec:
    return spec.model_copy(update={"gpusPerReplica": layout.gpus, "nodesPerReplica": layout.nodes,
                                   "parallelism": spec.parallelism.model_copy(update={"tp": layout.gpus})})


def _record_layout(p: Plan, layout: Layout, spec: MoEDeploymentSpec) -> None:
    p.decisions.insert(0, Decision(key="layout.tp", value=str(layout.gpus),
                                   rule="user" if spec.layout_given() else layout.rule, reason=layout.reason))
    p.reasons.insert(0, layout.reason)
    p.layout = PlanLayout(tp=layout.gpus, gpusPerNode=layout.gpus // layout.nodes, nodes=layout.nodes)
    if layout.warning:
        p.warnings.append(layout.warning)


def place(spec: MoEDeploymentSpec, ckpt: CheckpointInfo, classes: dict[str, ClassInventory],
          current: str | None = None) -> Placement:
    """`current` is the class chosen before: it is kept while it still fits (placement is sticky,
    so free-capacity churn never moves running pods)."""
    engine = spec.engine.name  # the CRD defaults it (bundled)
    allowed = set(spec.gpu.allowedArchitectures)
    rejected: dict[str, str] = {}
    fits: list[tuple[ClassInventory, Plan, MoEDeploymentSpec]] = []
    for key, inv in sorted(classes.items()):
        g = inv.gpu_class
        if allowed and g.family not in allowed:
            rejected[key] = f"architecture {g.family} not in gpu.allowedArchitectures {sorted(allowed)}"
            continue
        if spec.gpu.product and g.product != spec.gpu.product:
            rejected[key] = f"product {g.product} is not the requested {spec.gpu.product}"
            continue
        if spec.layout_given():
            per_node = spec.gpus_per_node()
            if inv.gpus_per_node and inv.gpus_per_node < per_node:
                rejected[key] = f"{inv.gpus_per_node} GPUs per node < {per_node} needed per node"
                continue
        if len(inv.nodes) < spec.nodesPerReplica:
            rejected[key] = f"{len(inv.nodes)} nodes < {spec.nodesPerReplica} nodes per replica"
            continue
        layout = size_layout(spec, ckpt, inv)
        if isinstance(layout, str):
            rejected[key] = layout
            continue
        sized = _with_layout(spec, layout)
        p = plan(ckpt, g, choices_from_spec(sized), engine=engine, engine_version=spec.engine.version)
        if p.errors:
            rejected[key] = " ".join(p.errors)
            continue
        _record_layout(p, layout, spec)
        fits.append((inv, p, sized))
    if not fits:
        return Placement(None, None, rejected)
    # Most free capacity first (in whole replicas' worth of per-node GPUs), then most free GPUs.
    fits.sort(key=lambda f: (f[0].gpu_class.key() != current, -f[0].nodes_with_free(f[2].gpus_per_node()),
                             -f[0].free_gpus, f[0].gpu_class.key()))
    inv, p, sized = fits[0]
    return Placement(inv, p, rejected, sized)


def settle_hold(spec: MoEDeploymentSpec, current: str | None, placement: Placement, running: bool,
                leaving_for: float, settle: float) -> str | None:
    """Why a running workload stays on its class for now (issue 34 item 3), or None to follow
    `placement`. A GPU Feature Discovery restart removes a node's GPU labels for seconds: the
    class looks gone (or short of nodes) and a re-plan would roll every workload on it. A workload
    with ready pods keeps its class until it has looked unfit for `settle` seconds (`leaving_for`:
    how long so far); a new or idle one, or one whose spec no longer allows the class, follows
    placement at once."""
    if not running or not current or leaving_for >= settle:
        return None
    family, _, product = current.partition("/")
    if (spec.gpu.allowedArchitectures and family not in spec.gpu.allowedArchitectures) or (
            spec.gpu.product and product != spec.gpu.product):
        return None  # the spec no longer allows the class: nothing to wait for
    if placement.ok and placement.inventory is not None and placement.inventory.gpu_class.key() == current:
        return None
    why = placement.rejected.get(current) or "its nodes are gone from the GPU inventory (labels removed?)"
    return (f"GPU class {current} no longer fits ({why[:300]}); the running pods stay on it for "
            f"{settle - leaving_for:.0f}s more in case the labels come back (settle period {settle:.0f}s)")


def sized_for_cli(ckpt: CheckpointInfo, gpu, engine: str, kw: dict, gpus_per_node: int, nodes: int,
                  max_len: int | None, concurrency: int | None, version: str | None = None,
                  env: dict[str, str] | None = None):
    """`moe-operator plan`: the layout on `nodes` nodes of `gpus_per_node` GPUs of this class (the
    same size_layout the operator runs, with the engine version, backends, image FlashInfer and env the
    plan gets, so the layouts the engine refuses are the same). Returns (tp or None, a function that
    records it in the plan)."""
    from pydantic import ValidationError

    from .inventory import ClassInventory

    base = {"model": {"uri": "file:///cli"}, "engine": {"name": engine, "maxModelLen": max_len, "maxConcurrency": concurrency},
            "parallelism": {k: v for k, v in (("tp", kw.get("tp")), ("ep", kw.get("ep", 1)), ("dp", kw.get("dp", 1))) if v}}
    full = {**base, "engine": {**base["engine"], **({"version": version} if version else {}),
                               **({"flashinferVersion": kw["flashinfer_version"]} if kw.get("flashinfer_version") else {})},
            "moe": {k: kw[c] for k, c in (("runnerBackend", "runner_backend"), ("a2aBackend", "a2a_backend")) if kw.get(c)},
            "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}
    try:
        spec = MoEDeploymentSpec.model_validate(full)
    except ValidationError:  # a value the CRD refuses (the plan reports it): size without the choices
        spec = MoEDeploymentSpec.model_validate(base)
    g = gpu.model_copy(update={"count": gpus_per_node})
    inv = ClassInventory(g, nodes=[f"node-{i}" for i in range(nodes)], total_gpus=gpus_per_node * nodes,
                         free_gpus=gpus_per_node * nodes, free_per_node={f"node-{i}": gpus_per_node for i in range(nodes)})
    layout = size_layout(spec, ckpt, inv)
    if isinstance(layout, str):
        return None, lambda p: p.errors.append(layout)
    if layout.nodes > 1:
        kw["nodes"] = layout.nodes  # the planner's choices: the bundled runtime's flags depend on the node count
    return layout.gpus, lambda p: _record_layout(p, layout, spec)


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
        messages.append(f"{g.key()}: {' '.join(p.errors)}")
    return "; ".join(messages) if messages else None
