"""MoE kernels: FP4 formats, routing, expert GEMMs and the fused finalize.

Importing this package must not import torch: the control plane reads `moe_kernels.registry`
(backend capabilities) without torch installed. Kernel modules import torch themselves."""
