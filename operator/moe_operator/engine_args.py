"""Extra engine arguments (spec.engine.args): which flags the operator owns, per engine, and the
spec field that sets each instead. Pure.

The owned flags (engines/<engine>/args.py, with their aliases read from the released wheels: sglang 0.5.23
sglang/srt/arg_groups/fields/{model,parallel}.py `aliases=`, vLLM 0.33.0 vllm/engine/arg_utils.py
EngineArgs.add_cli_args) are what render.py and the planner (planner.py, engine_rules/, moe_core.bundled
parallel_args) put on the engine's command line; a user copy would be appended after them and win
(argparse keeps the last value), silently undoing a sized or checked decision. A test scans the
planner's sources for every flag literal it emits and checks it is listed here.

Matching is on the flag's name before any '=', with '_' read as '-' (vLLM's FlexibleArgumentParser
accepts both) and with argparse's prefix abbreviations (allow_abbrev, on in both engines' parsers:
'--moe-runner' is taken as '--moe-runner-backend', '-t' as '-tp' when unambiguous, '-tp4' as '-tp 4'),
so no spelling gets around a refusal.
"""

from __future__ import annotations

from .engines.bundled import args as _bundled, vocab as _bundled_vocab
from .engines.owned import CONFIG, DP, EP, MODEL, NODES, PLANNER, PP, SERVED, SERVER, TP  # noqa: F401  (re-exported)
from .engines.sglang import args as _sglang, vocab as _sglang_vocab
from .engines.vllm import args as _vllm, vocab as _vllm_vocab

# engine -> owned flag -> what sets it instead (each engine's list is engines/<engine>/args.py)
OWNED: dict[str, dict[str, str]] = {_sglang_vocab.NAME: _sglang.OWNED, _vllm_vocab.NAME: _vllm.OWNED,
                                    _bundled_vocab.NAME: _bundled.OWNED}

MAX_ARGS = 128
MAX_ARG_CHARS = 4096


def _flag(arg: str) -> str | None:
    if not arg.startswith("-") or arg in ("-", "--") or arg[1:2].isdigit():  # a value (e.g. -1), not a flag
        return None
    name = arg.split("=", 1)[0]
    return name[:2] + name[2:].replace("_", "-") if name.startswith("--") else name


def refusal(engine: str, arg: str) -> str | None:
    """Why `arg` may not be in spec.engine.args for `engine`, or None."""
    if "\n" in arg or "\x00" in arg:
        return f"engine argument {arg[:40]!r} contains a newline or NUL"
    flag = _flag(arg)
    if flag is None:
        return None
    owned = OWNED[engine]
    if flag in owned:
        return f"engine argument {flag} is set by the operator for engine {engine}: use {owned[flag]}"
    for full, field in owned.items():
        if full.startswith("--") and flag.startswith("--") and len(flag) > 3 and full.startswith(flag):
            return (f"engine argument {flag} abbreviates {full}, which the operator sets for engine {engine}: "
                    f"use {field}")
        if not full.startswith("--") and not flag.startswith("--") and (full.startswith(flag) or flag.startswith(full)):
            # single-dash: an abbreviation (-t for -tp) or the value glued on (-tp4)
            return f"engine argument {arg[:40]} is read as {full}, which the operator sets for engine {engine}: use {field}"
    return None


def refusals(engine: str, args: list[str]) -> list[str]:
    return [why for a in args if (why := refusal(engine, a))]
