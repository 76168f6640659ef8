"""The runtime's models: one folder per architecture (`deepseek_v3/`, `qwen3_moe/`, `gpt_oss/`), each
holding everything the runtime knows of it behind one `Arch` (models.arch): its checkpoint layout,
config keys and checks, shard rules, writer config and its model. The shared blocks are in
`common/`. No architecture imports another's folder, and no module outside models/<arch>/ names one:
it asks the registry here. Which folder serves which config.json architecture is the runtime
capability table (moe_core.runtime.BUNDLED.architectures); a folder is loaded by that name.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
from moe_core.runtime import BUNDLED

from ..errors import RuntimeFailure
from .arch import Arch


class Weights:
    """The loaded dense tensors as the model builders read them: `w(name)`, `w.has(name)`."""

    def __init__(self, dense: dict[str, torch.Tensor]):
        self._dense = dense

    def __call__(self, name: str) -> torch.Tensor:
        return self._dense[name]

    def has(self, name: str) -> bool:
        return name in self._dense


_LOADED: dict[str, Arch] = {}


def get(module: str) -> Arch:
    """The Arch of runtime module `module` (a BUNDLED.architectures value): its folder's ARCH."""
    if module not in _LOADED:
        if module not in BUNDLED.architectures.values():
            raise RuntimeFailure(f"unknown architecture module {module!r}; the bundled runtime has "
                                 f"{', '.join(BUNDLED.architectures.values())}")
        # by name, from the capability table: a new architecture is its folder plus the table's row
        _LOADED[module] = importlib.import_module(f"{__name__}.{module}").ARCH
    return _LOADED[module]


def names() -> tuple[str, ...]:
    """Every architecture module the runtime serves, in the capability table's order."""
    return tuple(BUNDLED.architectures.values())


def module_of(cfg: dict[str, Any]) -> str:
    """config.json architectures[0] -> its runtime module, or a RuntimeFailure naming what is served."""
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else None
    if name not in BUNDLED.architectures:
        raise RuntimeFailure(f"unsupported architecture {name!r}: the bundled runtime serves "
                             f"{', '.join(BUNDLED.architectures)}")
    return BUNDLED.architectures[name]


def arch_for(cfg: dict[str, Any]) -> Arch:
    return get(module_of(cfg))


def build(module: str, cfg: dict[str, Any], dense: dict[str, torch.Tensor], experts: Callable[[int], Any],
          deferred: bool, group=None):
    """The CausalLM of `module` over loaded tensors; experts(layer) is that MoE layer's experts backend."""
    return get(module).build(cfg, Weights(dense), experts, deferred, group)
