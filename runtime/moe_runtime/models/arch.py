"""The `Arch` protocol: everything the runtime outside models/<arch>/ needs to know about one
architecture, asked of it rather than branched on its name. The loader asks for the tensor specs and
how to stack the routed experts, the shard plan for each tensor's rule and what the layout must
divide, the config checks for the keys it requires and their consistency, config_keys for its
spellings, the checkpoint writer for its config and on-disk layout, and `build` for the model.
`models.common.arch.ArchBase` holds the conventions most architectures share; each folder's
`ARCH` is an instance of its subclass."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch


class Arch(Protocol):
    name: str  # the runtime's module name (moe_core.runtime.BUNDLED.architectures' value)
    hf_class: str  # config.json architectures[0]
    aliases: dict[str, tuple[str, ...]]  # canonical config key -> the other spellings transformers wrote
    default_theta: float  # rope_theta when config.json gives none
    required: tuple[str, ...]  # config keys it cannot be built without
    experts_key: str  # the routed-expert count under its own spelling (for messages)
    config_keys: dict[str, Any]  # its own config.json keys -> models.common.config.Key (the shared: COMMON_KEYS)

    # checkpoint layout
    def is_moe_layer(self, cfg: dict[str, Any], i: int) -> bool: ...
    def dense_shapes(self, cfg: dict[str, Any]) -> list[tuple[int | None, dict[str, tuple[int, ...]]]]: ...
    def fused_expert_layers(self, cfg: dict[str, Any], names) -> set[int]: ...
    def tensor_specs(self, cfg: dict[str, Any], expert_format: str, quantized_linears: set[str] | None,
                     fused_layers: set[int]) -> dict[str, Any]: ...
    def stack_experts(self, raw: dict[str, torch.Tensor], prefix: str, num_experts: int, fmt: str,
                      dtype: torch.dtype, log: Callable[..., None], expert_rank0: bool) -> dict[str, torch.Tensor]: ...

    # config.json
    def config_problems(self, cfg: dict[str, Any], moe_layers: list[int]) -> list[str]: ...
    def dense_intermediate(self, cfg: dict[str, Any]) -> int: ...

    # tensor / expert parallelism (plan: a moe_runtime.dist.shard.ShardPlan)
    def shard_rule(self, plan, name: str): ...
    def shard_problems(self, plan) -> list[str]: ...

    # checkpoint writer
    def writer_config(self, size: str, common: dict[str, Any]) -> dict[str, Any]: ...
    def quantize_tensor(self, name: str, tensor: torch.Tensor, fmt: str) -> dict[str, torch.Tensor] | None: ...
    def quant_config(self, fmt: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None] | None: ...

    # the model
    def experts(self, cfg: dict[str, Any], weights, factory: Callable[[Any], Any]): ...
    def build(self, cfg: dict[str, Any], w, experts: Callable[[int], Any], deferred: bool, group=None): ...
