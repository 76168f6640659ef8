"""The runtime's models, by job: `common` (the shared model top: causal LM, decoder-layer assembly,
rope, norms, attention helpers), `moe` (router -> experts backend -> finalize), and one module per
architecture (`deepseek_v3`, `qwen3_moe`, `gpt_oss`) holding only its attention and its routing. No
architecture imports another's module; which module serves which config.json architecture is the
runtime capability table (moe_core.runtime.BUNDLED.architectures).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch


class Weights:
    """The loaded dense tensors as the model builders read them: `w(name)`, `w.has(name)`."""

    def __init__(self, dense: dict[str, torch.Tensor]):
        self._dense = dense

    def __call__(self, name: str) -> torch.Tensor:
        return self._dense[name]

    def has(self, name: str) -> bool:
        return name in self._dense


# modules whose MoE layers compute their experts themselves: their build() gets each layer's
# ExpertWeights, not a kernel backend over them (gpt-oss: expert biases and a clamped SwiGLU that no
# backend computes)
OWN_EXPERTS = frozenset({"gpt_oss"})


def build(module: str, cfg: dict[str, Any], dense: dict[str, torch.Tensor], experts: Callable[[int], Any],
          deferred: bool):
    """The CausalLM of `module` (a BUNDLED.architectures value) over loaded tensors; experts(layer) is
    that MoE layer's experts backend (its ExpertWeights for OWN_EXPERTS modules)."""
    return importlib.import_module(f"{__name__}.{module}").build(cfg, Weights(dense), experts, deferred)
