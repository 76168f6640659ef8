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

from dataclasses import dataclass, field
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
