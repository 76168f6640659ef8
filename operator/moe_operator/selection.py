"""The planner's engine-free machinery: the facts a row looks at, the row types (select, validate), the
plan builder, the select-table walk, the validate-row run and the start-up checks of explicit choices
(engine_rules), and the layout helpers both engines' split rules share. Pure: no I/O, no torch.

  * Rule 0: an explicit user value is never changed; it is validated, and an impossible one
    becomes an error that says why and what would work.
  * select rows (S*, W*, B*) fill values the user left at `auto`; first matching row wins;
  * validate rows (V*, K*) run on the final values, explicit or selected;
  * env rows (E*) for engine environment variables.
Each engine's rows are in engines/<engine>/plan.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from moe_core import registry, sizing
from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import GpuClass
from moe_core.plan import Decision, Provenance

from . import engine_rules
from .engine_rules import judge
from .engines.vocabulary import ALL_A2A, ALL_RUNNERS


def vtuple(v: str | None) -> tuple[int, ...]:
    return registry.version_tuple(v) if v else ()


def truthy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Choices:
    """What the user set in the MoEDeployment spec (or on the CLI)."""

    runner_backend: str = "auto"
    a2a_backend: str = "none"
    deferred_finalize: str = "auto"  # auto | on | off
    env: dict[str, str] = field(default_factory=dict)
    tp: int = 1
    ep: int = 1
    dp: int = 1
    flashinfer_version: str | None = None  # the image's flashinfer; "none" = not installed
    nodes: int = 1  # nodes per replica (a LeaderWorkerSet group when > 1)


@dataclass(frozen=True)
class Facts:
    """Everything a rule predicate may look at."""

    ckpt: CheckpointInfo
    gpu: GpuClass
    choices: Choices
    engine: str
    version: str
    flashinfer: str | None  # version in the image, None if absent/unknown

    @property
    def fam(self) -> str: return self.gpu.family
    @property
    def arch(self) -> str: return self.ckpt.architecture
    @property
    def fmt(self) -> str: return self.ckpt.format
    @property
    def a2a(self) -> str: return self.choices.a2a_backend
    @property
    def rocm(self) -> bool: return self.gpu.is_rocm
    @property
    def ver(self) -> tuple[int, ...]: return vtuple(self.version)
    def env(self, key: str) -> str | None: return self.choices.env.get(key)
    def fi_below(self, v: str) -> bool: return self.flashinfer is not None and vtuple(self.flashinfer) < vtuple(v)
    @property
    def gpu_name(self) -> str: return f"{self.gpu.family} ({self.gpu.product})" if self.gpu.product else self.gpu.family


Pred = Callable[[Facts], bool]


@dataclass(frozen=True)
class Select:
    """A select row: when `when` holds and the user left the value at auto, choose `value`."""

    id: str
    when: Pred
    value: str | Callable[[Facts], str] | None  # None: the row rejects (error = reason)
    reason: str  # formatted with arch, fmt, gpu, value, version, fi, a2a (and `fields`)
    args: Callable[[Facts], list[str]] | None = None
    fields: Callable[[Facts], dict] | None = None  # more reason fields, computed from the facts


@dataclass(frozen=True)
class Check:
    """A validate row: runs on the final value (explicit or selected)."""

    id: str
    when: Callable[[Facts, str], bool]  # (facts, runner)
    verdict: str  # "reject" | "warn"
    message: str




class Builder:
    def __init__(self, f: Facts):
        self.f = f
        self.env: dict[str, str] = {}
        self.args: list[str] = []
        self.reasons: list[str] = []
        self.warnings: list[str] = []
        self.errors: list[str] = []
        self.decisions: list[Decision] = []
        # where the pod verifies the plan (the bundled runtime): each decision's provenance by key, and the
        # image's kernel packages as the engine's rules assumed them (moe_core.image_contents)
        self.provenance: dict[str, Provenance] = {}
        self.image_packages: dict[str, str | None] | None = None

    def explain(self, reasons: dict[str, str]) -> None:
        """Rule id -> the engine's own reason: appended to that rule's refusal, before 'Works instead'."""
        for rule, why in reasons.items():
            for i, e in enumerate(self.errors):
                if e.startswith(f"[{rule}] "):
                    head, sep, tail = e.partition(" Works instead:")
                    self.errors[i] = f"{head}: {why}{sep}{tail}"

    def decide(self, key: str, value: str, rule: str, reason: str) -> None:
        self.decisions.append(Decision(key=key, value=value, rule=rule, reason=reason))
        self.reasons.append(f"[{rule}] {reason}")

    def set_env(self, key: str, value: str, rule: str, reason: str) -> None:
        """Planner env; a user value for the same key wins (Rule 0) and is reported instead."""
        if key in self.f.choices.env:
            self.decide(f"env.{key}", self.f.choices.env[key], "user",
                        f"{key}={self.f.choices.env[key]} set explicitly by the user (planner would set {value}: {reason})")
            return
        self.env[key] = value
        self.decide(f"env.{key}", value, rule, reason)


PassesOver = Callable[[Facts, "str | None"], bool]  # an engine's reason to pass over a select row's value


def select(rows: tuple[Select, ...], f: Facts, skipped: list | None = None,
           passes_over: PassesOver | None = None) -> tuple[Select, str | None]:
    for row in rows:
        if row.when(f):
            value = row.value(f) if callable(row.value) else row.value
            if skipped is not None and passes_over is not None and passes_over(f, value):
                skipped.append((row, value))
                continue
            return row, value
    raise AssertionError("select tables end with a catch-all row")



def run_checks(b: Builder, checks: tuple[Check, ...], runner: str, flag: str) -> None:
    """The validate rows on the final runner, the ER0 note, then the engine's start-up checks of explicit
    choices (`flag`: the engine's runner flag, for the "works instead" text)."""
    f = b.f
    first_error = len(b.errors)
    fired: set[str] = set()
    for c in checks:
        if c.when(f, runner):
            msg = c.message.format(value=runner, gpu=f.gpu_name, a2a=f.a2a, fmt=f.fmt, version=f.version,
                                   fi=f.flashinfer or "none", arch=f.arch)
            (b.errors if c.verdict == "reject" else b.warnings).append(f"[{c.id}] {msg}")
            if c.verdict == "reject":
                fired.add(c.id)
    # explicit: the spec's runner/a2a, or a runner translated from the user's own env (E2 SGLANG_CUTLASS_MOE, W7 VLLM_*)
    from_env = any(d.key == "moe.runnerBackend" and d.rule in ("E2", "W7") for d in b.decisions)
    note = engine_rules.coverage_note(f.engine, f.version)
    if note:  # every plan for a release not read says its start-up checks are not judged (no rule is guessed)
        b.warnings.append(f"[ER0] {note}")
    if f.choices.runner_backend != "auto" or f.a2a != "none" or from_env:
        _engine_start_checks(b, checks, runner, frozenset(fired), first_error, flag)


def _engine_case(f: Facts, runner: str, args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> engine_rules.Case:
    """The start-up rows' case. `env`: what the plan renders so far (Builder.env); the rows see it merged with the
    user's env, the user's value winning as in the pod (planner.plan: {**b.env, **choices.env}), so a variable the
    planner renders for an engine gate (SGLANG_USE_AITER for the FP8 aiter path) passes the row that reads it."""
    args = args or []
    deepep_mode = args[args.index("--deepep-mode") + 1] if "--deepep-mode" in args[:-1] else "auto"
    return engine_rules.Case(
        engine=f.engine, version=f.version, fmt=f.fmt, arch=f.arch, family=f.fam, runner=runner, a2a=f.a2a,
        tp=f.choices.tp, ep=f.choices.ep, dp=f.choices.dp, cc=f.gpu.computeCapability,
        driver=getattr(f.gpu, "driverVersion", None) or (str(f.gpu.driverMajor) if f.gpu.driverMajor else None),
        flashinfer="none" if f.choices.flashinfer_version == "none" else f.flashinfer,
        quant_method=f.ckpt.quantMethod, env={**(env or {}), **f.choices.env},
        hidden=f.ckpt.hiddenSize, moe_inter=f.ckpt.moeIntermediateSize, deepep_mode=deepep_mode)


def _engine_start_checks(b: Builder, checks: tuple[Check, ...], runner: str, fired: frozenset[str],
                         first_error: int, flag: str) -> None:
    """Explicit sglang/vLLM choices against the engine version's own start-up checks (engine_rules),
    then every refusal of the explicit choice says what works instead (issue 16)."""
    f = b.f
    case = _engine_case(f, runner, b.args, b.env)
    b.errors.extend(r.text for r in judge.check(case, skip_same_as=fired))
    if len(b.errors) == first_error:
        return

    def planner_ok(c: engine_rules.Case) -> bool:  # a value the spec can hold and the planner's own rows accept
        if c.runner not in ALL_RUNNERS or c.a2a not in ALL_A2A:
            return False
        g = f if c.a2a == f.a2a else dataclasses.replace(f, choices=dataclasses.replace(f.choices, a2a_backend=c.a2a))
        return not any(k.verdict == "reject" and k.when(g, c.runner) for k in checks)

    alts = judge.describe_alternatives(case, judge.alternatives(case, planner_ok), flag)
    for i in range(first_error, len(b.errors)):
        b.errors[i] = f"{b.errors[i]} {alts}"


def _reason(row: Select, f: Facts, value: str) -> str:
    return row.reason.format(arch=f.arch, fmt=f.fmt, gpu=f.gpu_name, value=value, version=f.version,
                             fi=f.flashinfer or "none", a2a=f.a2a, **(row.fields(f) if row.fields else {}))


def choose_runner(b: Builder, rows: tuple[Select, ...], flag_name: str,
                  passes_over: PassesOver | None = None) -> tuple[str, Select | None]:
    """Rule 0, then the select table. Returns (runner, row that chose it or None for user)."""
    f = b.f
    user = f.choices.runner_backend
    if user != "auto":
        b.decide("moe.runnerBackend", user, "user", f"{flag_name} {user} set explicitly by the user (validated, never changed)")
        return user, None
    skipped: list = []
    row, value = select(rows, f, skipped, passes_over)
    for r, v in skipped:
        b.warnings.append(f"[FI0] {r.id} would pick {v}, but the image has no FlashInfer (engine.flashinferVersion "
                          f"none): passed over, {row.id} decides")
    if value is None:
        b.errors.append(f"[{row.id}] {_reason(row, f, '')}")
        return "auto", row
    b.decide("moe.runnerBackend", value, row.id, _reason(row, f, value))
    if row.args:
        b.args.extend(row.args(f))
    return value, row




def fits_tps(f: Facts, tps: list[int]) -> tuple[list[int], str]:
    """The tps of a "works instead" list whose weights fit the GPU (moe_core.sizing.estimate at one KV token, so a
    layout is left out only when its weights and workspace alone exceed the usable memory), and a note naming those
    left out. Unknown GPU memory or checkpoint size: every tp is kept (nothing is judged)."""
    memory = sizing.memory_bytes(f.gpu)
    if memory is None or not f.ckpt.totalBytes:
        return tps, ""
    fits = {t: sizing.estimate(f.ckpt, memory, t, max_len=1, concurrency=1) for t in tps}
    out = [t for t in tps if fits[t].fits]
    gone = [t for t in tps if not fits[t].fits]
    if not gone:
        return out, ""
    worst = fits[gone[-1]]
    return out, (f" (left out: tp {', '.join(map(str, gone))}, whose weights do not fit {f.gpu_name}: tp {worst.gpus} "
                 f"needs {sizing.gib(worst.need)} per GPU before any KV cache > {sizing.gib(worst.usable)} usable)")



def heads_problem(ck: CheckpointInfo, attn_tp: int, kv: bool) -> str | None:
    heads, kv_heads = ck.numAttentionHeads, ck.numKeyValueHeads
    if attn_tp <= 1 or not heads:
        return None
    if heads % attn_tp:
        return f"{heads} attention heads % {attn_tp} (attention tensor-parallel size) != 0"
    if kv and kv_heads and not ck.kvLoraRank and (kv_heads % attn_tp if kv_heads >= attn_tp else attn_tp % kv_heads):
        return (f"{kv_heads} KV heads neither split over nor replicate evenly on {attn_tp} attention tensor-parallel "
                f"ranks")
    return None

