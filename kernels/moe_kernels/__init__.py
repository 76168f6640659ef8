"""MoE kernels: FP4 formats, routing, expert GEMMs and the fused finalize.

Importing this package must not import torch. The backend capabilities (data) live in
`moe_core.registry`; `moe_kernels.backends` instantiates them. Kernel modules import torch themselves."""
