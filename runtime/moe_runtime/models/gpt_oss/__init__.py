"""GptOssForCausalLM, every file of it: `arch` (checkpoint layout, config keys and checks, shard
rules, writer config and MXFP4 layout), `experts` (stacking its fused experts; the torch experts
backend with biases and the clamped SwiGLU) and `model` (attention with sinks and sliding windows,
its router and MoE block)."""

from .arch import ARCH
from .experts import Experts, stack_experts

__all__ = ["ARCH", "Experts", "stack_experts"]
