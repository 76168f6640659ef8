"""The engines' own start-up validation of explicit MoE choices, as data rows. Pure, no I/O.

sglang validates `--moe-runner-backend` / `--moe-a2a-backend` while it resolves its server
arguments (`srt/arg_groups/moe_hook.py`) and again when each MoE layer's quantization method builds
its runner (`create_moe_runner`, the fused-function registry); vLLM validates `--moe-backend` in the
MoE oracle of the checkpoint's quantization (`model_executor/layers/fused_moe/oracle/`) and in each
experts class's `is_supported_config` (`_supports_current_device`, `_supports_quant_scheme`, ...).
A choice that fails there is a pod that crash-loops; here it is a refusal before the pod exists.

Each row is one upstream check: a predicate over a `Case`, the engine's own message, and its source
(file, lines, function, the release the line numbers refer to, and the first release read that has
the check). `check(case)` returns the refusals; `alternatives(case)` the values that pass for the
same checkpoint on the same GPU with the same engine version.

Versions read (released wheels from PyPI, unpacked outside the project): see `VERSIONS_READ`.
A rule applies to a version only when that very release was read and has the check (`since`). A
release not read (between two read ones, older or newer than all, a post release of a read one) is
never guessed from its neighbours: its start-up checks are "not judged", and the plan says so with
the nearest releases read named (`coverage_note`, warning ER0, also an admission warning).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from . import recorded
from .recorded import release_key, vt  # noqa: F401  (the version helpers, re-exported)

# Releases whose wheels were unpacked and read for these rows: the releases recorded in
# engine_rules/data/<engine>.json by scripts/engine_rules_extract.py (ascending), for every engine with a file.
VERSIONS_READ: dict[str, tuple[str, ...]] = {p.stem: tuple(recorded.releases(p.stem))
                                             for p in sorted(recorded.DATA.glob("*.json"))}


@dataclass(frozen=True)
class Source:
    """Where an engine performs a check. Line numbers refer to `version`'s released wheel."""

    file: str  # path inside the wheel, e.g. sglang/srt/arg_groups/moe_hook.py
    lines: str  # "76-88"
    function: str
    version: str  # the release the lines refer to
    since: str  # first release in VERSIONS_READ that has the check (found by its message)
    marker: str = ""  # a literal piece of the upstream code/message used to find it per release
    # the functions the row reads, by qualified name ("Class.method" or "function", anywhere in the
    # package): for checks without a marker string; each release records where they are and an AST
    # digest of each (scripts/engine_rules_extract.py), and the row applies where one of them is
    reads: tuple[str, ...] = ()

    def cite(self, engine: str) -> str:
        first = f"; present since {engine} {self.since} (releases read)" if self.since != self.version else ""
        return f"{self.file}:{self.lines} {self.function}, {engine} {self.version}{first}"


@dataclass(frozen=True)
class Case:
    """One explicit configuration as the engine sees it at start-up."""

    engine: str  # an engine with start-up rows (engines/<engine>/startup.py)
    version: str
    fmt: str  # checkpoint format (planner vocabulary, tuning-rules.md section 6)
    arch: str  # config.json architectures[0]
    family: str  # GPU family key: sm80 sm89 sm90 sm100 sm110 sm120 sm121 gfx942 gfx950
    runner: str  # the runner value the engine gets (explicit, or the planner's selection)
    a2a: str = "none"
    tp: int = 1
    ep: int = 1
    dp: int = 1  # attention data parallel (sglang --dp-size with --enable-dp-attention)
    cc: str | None = None  # compute capability "10.3"
    driver: str | None = None  # NVIDIA driver version "595.58.03"
    flashinfer: str | None = None
    quant_method: str | None = None  # config.json quantization_config.quant_method as written
    deepep_mode: str = "auto"  # sglang --deepep-mode as the planner passes it (auto | normal | low_latency)
    hidden: int | None = None  # config.json hidden_size
    moe_inter: int | None = None  # config.json moe_intermediate_size (per expert, before tensor-parallel split)
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def ver(self) -> tuple[int, ...]:
        return vt(self.version)

    @property
    def rocm(self) -> bool:
        return self.family.startswith("gfx")

    def truthy(self, key: str) -> bool:
        v = self.env.get(key)
        return v is not None and v.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Rule:
    id: str
    engine: str
    when: Callable[[Case], bool]
    message: str  # the engine's own words (str.format fields: runner, a2a, fmt, family, arch, tp, ep, dp)
    source: Source
    flag: str = "runner"  # which choice the rule is about: runner | a2a | both
    same_as: tuple[str, ...] = ()  # planner check ids that already express this upstream check
    extra: Callable[[Case], dict] | None = None  # more message fields, computed from the case


@dataclass(frozen=True)
class Refusal:
    rule: Rule
    text: str


def read_as(engine: str, version: str) -> str | None:
    """The entry of VERSIONS_READ that is this very release, or None when it was not read."""
    key = release_key(version)
    return next((v for v in VERSIONS_READ.get(engine, ()) if key is not None and release_key(v) == key), None)


def read_floor(engine: str, version: str) -> str | None:
    """The newest release read at or below `version` (None: older than everything read)."""
    key = release_key(version)
    below = [v for v in VERSIONS_READ.get(engine, ()) if key is not None and release_key(v) <= key]
    return max(below, key=release_key) if below else None


def read_ceiling(engine: str, version: str) -> str | None:
    """The oldest release read above `version` (None: newer than everything read)."""
    key = release_key(version)
    above = [v for v in VERSIONS_READ.get(engine, ()) if key is not None and release_key(v) > key]
    return min(above, key=release_key) if above else None


def coverage_note(engine: str, version: str) -> str | None:
    """Why this version's start-up checks are not judged (with the nearest releases read named), or
    None when the version was read (or the engine has no start-up rows: bundled)."""
    read = VERSIONS_READ.get(engine, ())
    if not read or read_as(engine, version):
        return None
    lo, hi = read_floor(engine, version), read_ceiling(engine, version)
    tail = "; explicit choices are checked only by the planner's own rows (no rule is inferred across releases)"
    if lo is None and hi is None:
        return f"{engine} {version} is not a release number: its start-up checks are not judged{tail}"
    if lo is None:
        return (f"{engine} {version} is older than every release whose start-up checks were read "
                f"({', '.join(read)}): not judged; nearest release read: {hi}{tail}")
    if hi is None:
        return (f"{engine} {version} is newer than the newest release read ({lo}): its start-up checks are "
                f"not judged; nearest release read: {lo}{tail}")
    return (f"{engine} {version} was not read: its start-up checks are not judged; nearest releases read: "
            f"{lo} (older), {hi} (newer){tail}")


def _applies(rule: Rule, case: Case) -> bool:
    """The release was read and has the row's check: its marker (or every function it reads) was
    found in that very release (recorded data), so a check that appeared and went applies only where
    it is; rows with neither apply from `since`."""
    read = read_as(case.engine, case.version)
    if read is None:
        return False
    has = recorded.has_check(case.engine, read, rule.id, rule.source.reads)
    return has if has is not None else vt(rule.source.since) <= vt(case.version)


def _startup(engine: str):
    """The engine's start-up rows (engines/<engine>/startup.py: RULES, choices(version), A2A_FLAG, quant(case)),
    or None (the bundled runtime has none). Asked of the engine registry at call time: the startup modules build
    their rows from this module's Case/Rule, so it cannot import them at load."""
    from ..engines import registry
    return registry.get(engine).startup if engine in registry.REGISTRY else None


def _rules(engine: str) -> tuple[Rule, ...]:
    s = _startup(engine)
    return s.RULES if s is not None else ()


def catalogue(engine: str, version: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(runner values, a2a values) the engine's command line accepts in this version."""
    s = _startup(engine)
    return s.choices(version) if s is not None else ((), ())


def _fields(case: Case) -> dict:
    return dict(runner=case.runner, a2a=case.a2a, fmt=case.fmt, family=case.family, arch=case.arch,
                tp=case.tp, ep=case.ep, dp=case.dp, version=case.version, fi=case.flashinfer or "none",
                driver=case.driver or "unknown", quant=_startup(case.engine).quant(case))


def check(case: Case, skip_same_as: frozenset[str] = frozenset()) -> list[Refusal]:
    """Every start-up check of `case.engine` `case.version` that this case fails.

    `skip_same_as`: planner check ids that already fired (rows that express the same upstream
    check are not repeated)."""
    out = []
    for rule in _rules(case.engine):
        if not _applies(rule, case) or (set(rule.same_as) & skip_same_as):
            continue
        if rule.when(case):
            msg = rule.message.format(**_fields(case), **(rule.extra(case) if rule.extra else {}))
            src = rule.source
            first = recorded.first_with(case.engine, rule.id, rule.source.reads)
            if first is not None and first != src.since:  # the releases read say where the check starts
                src = replace(src, since=first)
            out.append(Refusal(rule, f"[{rule.id}] {case.engine} {case.version} refuses this at start-up: {msg} "
                                     f"({src.cite(case.engine)})"))
    return out


# Values never offered as alternatives: they need a setup the spec cannot express here
# (LoRA adapters, Intel XPU, Ascend, CPU) or are the engine's own experimental/emulation paths.
_NOT_OFFERED = frozenset({"auto", "lora_cutedsl", "lora_triton", "lora_marlin", "intel_xpu", "experimental_sgl_trtllm",
                          "experimental_sgl_marlin", "emulation", "rdna3", "flydsl", "hpc", "megamoe"})


def alternatives(case: Case, also_ok: Callable[[Case], bool] | None = None) -> dict[str, list[str]]:
    """What works instead, for this checkpoint on this GPU with this engine version.

    Returns {"runner": [...]} (runner values that pass with the case's a2a), {"auto": ["auto"]} when
    the runner left at auto passes, and, when the a2a choice
    is itself refused or no runner passes with it, {"runner_without_a2a": [...]} (with a2a none), and
    with an a2a choice {"a2a": [...]}: the other a2a values that pass with the case's runner.
    `also_ok` adds the caller's own checks (the planner's validate rows). A release not read has no
    alternatives ({}): what it accepts is not judged."""
    if read_as(case.engine, case.version) is None:
        return {}
    runners, _ = catalogue(case.engine, case.version)

    def ok(c: Case) -> bool:
        # AMD's aiter library (SGLANG_USE_AITER / VLLM_ROCM_USE_AITER) exists only on ROCm images
        if not c.rocm and c.runner.startswith("aiter"):
            return False
        return not check(c) and (also_ok is None or also_ok(c))

    out: dict[str, list[str]] = {}
    out["runner"] = [r for r in runners if r not in _NOT_OFFERED and ok(replace(case, runner=r))]
    out["auto"] = ["auto"] if ok(replace(case, runner="auto")) else []
    if case.a2a != "none" and not out["runner"]:
        base = replace(case, a2a="none")
        out["runner_without_a2a"] = [r for r in runners if r not in _NOT_OFFERED and ok(replace(base, runner=r))]
    if case.a2a != "none":
        _, a2as = catalogue(case.engine, case.version)
        out["a2a"] = [a for a in a2as if a not in ("none", case.a2a) and ok(replace(case, a2a=a))]
    return out


def describe_alternatives(case: Case, alts: dict[str, list[str]], flag: str) -> str:
    where = f"{case.fmt} on {case.family} with {case.engine} {case.version}"
    if read_as(case.engine, case.version) is None:
        return f"Works instead: not judged ({coverage_note(case.engine, case.version)})."
    with_a2a = alts.get("runner") or []
    parts = []
    if with_a2a:
        a2a = f" and {_startup(case.engine).A2A_FLAG} {case.a2a}" if case.a2a != "none" else ""
        parts.append(f"{flag} values that pass its start-up checks for {where}{a2a}: {', '.join(with_a2a)}")
    elif case.a2a != "none":
        without = alts.get("runner_without_a2a") or []
        parts.append(f"no {flag} value passes with a2a {case.a2a} for {where}"
                     + (f"; without an all-to-all backend: {', '.join(without)}" if without else ""))
    else:
        parts.append(f"no explicit {flag} value passes for {where}; this checkpoint needs another GPU or format")
    if alts.get("a2a"):
        a2a_flag = _startup(case.engine).A2A_FLAG
        parts.append(f"{a2a_flag} values that pass with {flag} {case.runner}: {', '.join(alts['a2a'])}")
    return "Works instead: " + "; ".join(parts) + (" (or leave it at auto)." if alts.get("auto") else ".")
