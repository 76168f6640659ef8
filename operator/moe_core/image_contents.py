"""What the bundled runtime image holds: the kernel packages of each variant, as the operator assumes
them when it plans (deploy/Dockerfile.runtime builds them; tests/unit/core/test_image_contents.py
reads its pins). The plan records them (Plan.image) and the pod compares them with what it has
installed (moe_runtime.plan_check), so an image built otherwise is re-resolved there, with a warning.

One table for the planner (which backends the image can run) and the renderer (which variant carries
flashinfer, moe_operator.images).
"""

from __future__ import annotations

from .registry import version_tuple

TORCH = "2.15.0"  # Dockerfile.runtime TORCH_VERSION
# Triton as the planner has assumed it with that torch (the wheel's own triton requirement): the
# registry's backends need triton >= 3.0, so only "none" against "some" changes a plan today.
TRITON = "3.6"
FLASHINFER = "0.7.2"  # Dockerfile.runtime FLASHINFER_VERSION: flashinfer-python of the -flashinfer variants
# Families whose image variant carries flashinfer (its MoE kernels target Blackwell; on Hopper our own
# Triton W4A16 kernels are the bundled choice).
FLASHINFER_FAMILIES = frozenset({"sm100", "sm120", "sm121"})
KERNEL_PACKAGES = ("flashinfer-python", "triton")  # moe_kernels.backends.KERNEL_PACKAGES: what the pod reads


def bundled_packages(family: str, rocm: bool = False) -> dict[str, str | None]:
    """{package: version or None} of the image variant for a GPU family (the -rocm variant has no Triton
    build of ours)."""
    return {"flashinfer-python": FLASHINFER if family in FLASHINFER_FAMILIES else None,
            "triton": None if rocm else TRITON}


def same_release(assumed: str | None, installed: str | None) -> bool:
    """The installed version is the assumed one ("3.6" is 3.6.0 and 3.6.1; absent is absent)."""
    if assumed is None or installed is None:
        return assumed is None and installed is None
    a = version_tuple(assumed)
    return version_tuple(installed)[:len(a)] == a


def differences(assumed: dict[str, str | None], installed: dict[str, str | None]) -> list[str]:
    """`package assumed X, installed Y` for each kernel package the image does not hold as assumed."""
    return [f"{p} assumed {assumed.get(p) or 'absent'}, installed {installed.get(p) or 'absent'}"
            for p in sorted(set(assumed) | set(installed))
            if not same_release(assumed.get(p), installed.get(p))]
