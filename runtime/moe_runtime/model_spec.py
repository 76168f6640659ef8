"""What a checkpoint of a supported architecture must contain: tensor names, shapes and dtypes.

Pure functions of config.json (+ the expert weight format), each answered by the architecture's
`Arch` (moe_runtime.models): the checkpoint writer generates exactly these tensors and the loader
validates a checkpoint's safetensors headers against them, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from . import models
from .models.common.arch import num_experts
from .models.common.spec import FLOAT_DTYPES, Spec, is_fp8_linear, is_routed_expert_weight

__all__ = ["FLOAT_DTYPES", "Spec", "arch_of", "dense_shapes", "fused_expert_layers", "is_fp8_linear", "is_moe_layer",
           "is_routed_expert_weight", "num_experts", "tensor_specs"]


def arch_of(cfg: dict[str, Any]) -> str:
    """The runtime module serving config.json's architecture (a RuntimeFailure when none does)."""
    return models.module_of(cfg)


def is_moe_layer(cfg: dict[str, Any], i: int) -> bool:
    return models.arch_for(cfg).is_moe_layer(cfg, i)


def dense_shapes(cfg: dict[str, Any]) -> list[tuple[int | None, dict[str, tuple[int, ...]]]]:
    """[(layer or None, {name: shape})] of the unquantized model, in checkpoint order."""
    return models.arch_for(cfg).dense_shapes(cfg)


def fused_expert_layers(cfg: dict[str, Any], names) -> set[int]:
    """MoE layers whose routed experts are stored fused (models.common.arch.ArchBase.fused_expert_layers)."""
    return models.arch_for(cfg).fused_expert_layers(cfg, names)


def tensor_specs(cfg: dict[str, Any], expert_format: str, quantized_linears: set[str] | None = None,
                 fused_layers: set[int] = frozenset()) -> dict[str, Spec]:
    """Expected tensors (models.common.spec.per_expert_specs says how quantized linears are accepted)."""
    return models.arch_for(cfg).tensor_specs(cfg, expert_format, quantized_linears, fused_layers)
