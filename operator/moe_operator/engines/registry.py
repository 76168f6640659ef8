"""Engine name -> Engine (engines/base.py): what the planner, placement and admission ask."""

from __future__ import annotations

from .base import Engine
from .bundled.engine import ENGINE as _BUNDLED
from .sglang.engine import ENGINE as _SGLANG
from .vllm.engine import ENGINE as _VLLM
from .vocabulary import ENGINES

REGISTRY: dict[str, Engine] = {e.name: e for e in (_BUNDLED, _SGLANG, _VLLM)}
assert tuple(REGISTRY) == ENGINES


def get(name: str) -> Engine:
    if name not in REGISTRY:
        raise ValueError(f"unknown engine {name!r}; one of {', '.join(REGISTRY)}")
    return REGISTRY[name]
