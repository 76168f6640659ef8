"""The operator's field manager, and whether an object it applied was made by it alone.

Below render, model_cache and inspect_job (which all need it), so none of them has to import
another for a constant."""

from __future__ import annotations

from typing import Any

FIELD_MANAGER = "moe-operator"


def made_here(obj: dict[str, Any]) -> bool:
    """A create by our apply: no other field manager has touched it (a same-named object someone
    made between our get and our apply has theirs)."""
    managers = {f.get("manager") for f in (obj.get("metadata") or {}).get("managedFields") or []}
    return managers <= {FIELD_MANAGER}
