"""Runtime image variants: the image follows the node (CPU arch, CUDA major, flashinfer on Blackwell).

One table, read by the planner (which flashinfer the bundled image has) and the renderer (which tag).
"""

from __future__ import annotations

from moe_core.gpu import GpuClass

RUNTIME_REPOSITORY = "ghcr.io/moe-operator/moe-runtime"
RUNTIME_VERSION = "0.1.0"
# flashinfer-python shipped in the Blackwell variants of the bundled image (pyproject extra `flashinfer`).
BUNDLED_FLASHINFER = "0.7.2"
# Families whose bundled image variant carries flashinfer (its MoE kernels target Blackwell; on
# Hopper our own Triton W4A16 kernels are the bundled choice).
FLASHINFER_FAMILIES = frozenset({"sm100", "sm120", "sm121"})


def bundled_image_flashinfer(gpu: GpuClass) -> str | None:
    return BUNDLED_FLASHINFER if gpu.family in FLASHINFER_FAMILIES else None


def cuda_major(gpu: GpuClass) -> int:
    """CUDA major of the image: what the node's driver supports (CUDA 13 needs driver >= 580)."""
    if gpu.cudaMajor:
        return min(gpu.cudaMajor, 13)
    if gpu.driverMajor:
        return 13 if gpu.driverMajor >= 580 else 12
    return 12 if gpu.family in ("sm80", "sm89") else 13


def runtime_image(gpu: GpuClass, repository: str = RUNTIME_REPOSITORY, version: str = RUNTIME_VERSION) -> str:
    """e.g. ghcr.io/moe-operator/moe-runtime:0.1.0-cu13-flashinfer-arm64 for a GB200 node."""
    if gpu.is_rocm:
        return f"{repository}:{version}-rocm"
    parts = [version, f"cu{cuda_major(gpu)}"]
    if gpu.family in FLASHINFER_FAMILIES:
        parts.append("flashinfer")
    if gpu.arch == "arm64":
        parts.append("arm64")
    return f"{repository}:{'-'.join(parts)}"
