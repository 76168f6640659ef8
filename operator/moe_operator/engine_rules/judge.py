"""Judging a Case against its engine's start-up rows: `check(case)` (the refusals), `alternatives(case)` (what
passes instead for the same checkpoint, GPU and engine version), `catalogue` (the values the release accepts).

Above both the rule machinery (engine_rules: Case, Rule, Source, the releases read) and the engines' start-up rows
(engines/<engine>/startup.py, built from that machinery), so neither imports the other back: the rows come from
engines.startups, not from the engine registry (which imports the planner). Pure, no I/O."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..engines import startups
from . import Case, Refusal, Rule, _applies, coverage_note, read_as, recorded


def _startup(engine: str):
    """The engine's start-up rows (engines/<engine>/startup.py: RULES, choices(version), A2A_FLAG, quant(case)),
    or None (the bundled runtime has none)."""
    return startups.get(engine)


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
