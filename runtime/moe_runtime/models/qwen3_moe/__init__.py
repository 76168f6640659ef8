"""Qwen3MoeForCausalLM: `arch` (checkpoint layout, config, writer config) and `model` (GQA with
per-head q/k norms, softmax top-k routing)."""

from .arch import ARCH

__all__ = ["ARCH"]
