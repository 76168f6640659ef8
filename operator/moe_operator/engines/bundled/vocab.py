"""The bundled runtime's accepted values: its kernel backends (moe_core.registry) and version."""

from __future__ import annotations

from moe_core import registry

NAME = "bundled"
DEFAULT_VERSION = "0.1.0"
RUNNERS = ("auto", *registry.names())
