"""Load an experts class by registry name; report the kernel packages installed (without importing them)."""

from __future__ import annotations

import importlib
from importlib import metadata

from moe_core import registry

KERNEL_PACKAGES = ("flashinfer-python", "triton")


def load_backend(name: str):
    """The experts class registered under `name` (imports its module, which needs torch)."""
    module, _, attr = registry.get(name).implementation.partition(":")
    return getattr(importlib.import_module(module), attr)


def installed_packages() -> dict[str, str | None]:
    """{distribution: version or None}, read from package metadata only."""
    out: dict[str, str | None] = {}
    for pkg in KERNEL_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out
