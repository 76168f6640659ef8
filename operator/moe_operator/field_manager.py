"""The operator's field manager.

Below render (kube.py imports it from there), so that no module needs another for a
constant. Whether the operator made an object is never read from managedFields (a tenant can name
any field manager): what it adopts by UID it creates with Kube.create, which fails on a taken name."""

from __future__ import annotations

FIELD_MANAGER = "moe-operator"
