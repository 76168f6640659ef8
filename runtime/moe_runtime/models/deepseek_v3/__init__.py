"""DeepseekV3ForCausalLM: `arch` (checkpoint layout, config, writer config) and `model` (MLA
attention over a paged latent cache, grouped routing with shared experts)."""

from .arch import ARCH

__all__ = ["ARCH"]
