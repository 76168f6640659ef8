"""Engine name -> its start-up rows module (engines/<engine>/startup.py: RULES, choices(version), A2A_FLAG,
quant(case)), for engine_rules.judge. Below the registry (it imports no planning code), so the rule machinery can
ask for an engine's rows without importing the planner; the bundled runtime has none (resolve_bundled judges it)."""

from __future__ import annotations

from types import ModuleType

from .sglang import startup as _sglang, vocab as _sglang_vocab
from .vllm import startup as _vllm, vocab as _vllm_vocab

STARTUP: dict[str, ModuleType] = {_sglang_vocab.NAME: _sglang, _vllm_vocab.NAME: _vllm}


def get(engine: str) -> ModuleType | None:
    return STARTUP.get(engine)
