"""Programmatic dependent launch (PDL, SM90+) for the decode-path kernels.

A kernel launched with PDL may start while the previous kernel in the stream is still running; it
must call `gdc_wait` before its first global memory access (which waits for that kernel to finish
and makes its writes visible). The gain is the launch latency and the CTA ramp-up of each kernel
boundary, which matters when a whole MoE layer takes tens of microseconds (one decode token).
Kernels call `gdc_launch_dependents` once their main loop is done, so the next kernel's CTAs are
placed on SMs while they store their results.
"""

from __future__ import annotations

import os

import torch

try:  # Triton >= 3.4 (the device's 3.6 and CI's 3.9 have it)
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _TRITON_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # pragma: no cover - older Triton
    gdc_wait = gdc_launch_dependents = None
    _TRITON_PDL = False


def pdl_supported(device: torch.device | str | None = None) -> bool:
    """Triton can launch with PDL and the GPU is SM90+ (griddepcontrol is sm_90 PTX);
    MOE_PDL=0 turns it off."""
    if not _TRITON_PDL or os.environ.get("MOE_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not torch.cuda.is_available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False
    return torch.cuda.get_device_capability(dev)[0] >= 9
