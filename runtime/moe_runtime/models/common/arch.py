"""ArchBase: the conventions most architectures share, for their `Arch` (models.arch) to override
where they differ: MoE layers by `decoder_sparse_step` / `mlp_only_layers`, the per-expert Hugging
Face tensor layout (or the fused one transformers >= 5 holds), the shard plan's default rules, no
config checks of its own, experts on the backend the plan chose."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from .config import Key
from .experts import stack_per_expert
from .spec import Spec, per_expert_specs


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts under any spelling (n_routed_experts / num_experts / num_local_experts)."""
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def gqa_problems(cfg: dict[str, Any]) -> list[str]:
    """Grouped-query heads that share, and a head size rope can rotate."""
    out = []
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if nh % nkv:
        out.append(f"num_key_value_heads = {nkv}: does not divide num_attention_heads = {nh}")
    hd = cfg.get("head_dim")
    if hd is None and cfg["hidden_size"] % nh:
        out.append(f"hidden_size = {cfg['hidden_size']}: not a multiple of num_attention_heads = {nh} (and no head_dim)")
    elif (hd or cfg["hidden_size"] // nh) % 2:
        out.append(f"head_dim = {hd or cfg['hidden_size'] // nh}: must be even (rope rotates pairs)")
    return out


class ArchBase(ABC):
    name: str = ""
    hf_class: str = ""
    aliases: dict[str, tuple[str, ...]] = {}
    default_theta: float = 10000.0
    required: tuple[str, ...] = ()
    experts_key: str = "num_experts"
    config_keys: dict[str, Key] = {}  # its own config.json keys and their types (beyond config.COMMON_KEYS)

    def is_moe_layer(self, cfg: dict[str, Any], i: int) -> bool:
        step = int(cfg.get("decoder_sparse_step") or 1)
        return i not in (cfg.get("mlp_only_layers") or []) and num_experts(cfg) > 0 and (i + 1) % step == 0

    @abstractmethod
    def dense_shapes(self, cfg: dict[str, Any]):
        """Shapes of the non-expert tensors, by name (each architecture its own)."""

    def fused_expert_layers(self, cfg: dict[str, Any], names) -> set[int]:
        """MoE layers whose routed experts are stored fused, as transformers >= 5 holds them in memory
        (`experts.gate_up_proj` [E, 2I, H] with gate rows first, `experts.down_proj` [E, H, I]) rather
        than per expert (`experts.{e}.gate_proj.weight`, what save_pretrained writes back through its
        conversion mapping and what the hub has)."""
        names = set(names)
        return {i for i in range(cfg["num_hidden_layers"])
                if self.is_moe_layer(cfg, i) and f"model.layers.{i}.mlp.experts.gate_up_proj" in names}

    def tensor_specs(self, cfg: dict[str, Any], expert_format: str, quantized_linears: set[str] | None = None,
                     fused_layers: set[int] = frozenset()) -> dict[str, Spec]:
        return per_expert_specs(self.dense_shapes(cfg), expert_format, quantized_linears, fused_layers,
                                (num_experts(cfg), cfg.get("moe_intermediate_size") or 0, cfg["hidden_size"]))

    def stack_experts(self, raw: dict[str, torch.Tensor], prefix: str, num_experts: int, fmt: str,
                      dtype: torch.dtype, log: Callable[..., None], expert_rank0: bool = True) -> dict[str, torch.Tensor]:
        return stack_per_expert(raw, prefix, num_experts, fmt, log)

    def config_problems(self, cfg: dict[str, Any], moe_layers: list[int]) -> list[str]:
        return []

    def dense_intermediate(self, cfg: dict[str, Any]) -> int:
        """The dense MLP's intermediate size the layout must divide (0: none)."""
        return cfg.get("intermediate_size") or 0

    def shard_rule(self, plan, name: str):
        return plan.default_rule(name)

    def shard_problems(self, plan) -> list[str]:
        """What splitting the routed experts over the layout must divide."""
        return plan.even_expert_split_problems("moe_intermediate_size")

    @abstractmethod
    def writer_config(self, size: str, common: dict[str, Any]) -> dict[str, Any]:
        """config.json of a checkpoint this architecture writes at `size` (checkpoint_writer)."""

    def quantize_tensor(self, name: str, tensor: torch.Tensor, fmt: str) -> dict[str, torch.Tensor] | None:
        """This architecture's own on-disk layout of `name` in `fmt` (None: the writer's default)."""
        return None

    def quant_config(self, fmt: str):
        """(config.json quantization_config, hf_quant_config.json) of its own release (None: the default)."""
        return None

    def experts(self, cfg: dict[str, Any], weights, factory: Callable[[Any], Any]):
        """One MoE layer's experts backend over its ExpertWeights."""
        return factory(weights)

    @abstractmethod
    def build(self, cfg: dict[str, Any], w, experts: Callable[[int], Any], deferred: bool, group=None):
        """The model (CausalLM) over loaded weights `w`, its MoE layers on `experts(i)`."""
