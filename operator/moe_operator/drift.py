"""Field-by-field comparison of a rendered object with its live copy. Pure.

What we render must be what runs. The live object carries more than we rendered (defaults the
API server fills in, annotations other controllers add), so a map compares only the keys we set;
a list must match item for item, so an env var or an argument someone added to an owned object
counts as drift (server-side apply alone would keep it: another field manager owns it).
"""

from __future__ import annotations

from typing import Any

_EMPTY = (None, "", [], {}, False, 0)


def _quantity(v: str):
    from kubernetes.utils.quantity import parse_quantity

    try:
        return parse_quantity(v)
    except ValueError:
        return v


def differences(desired: Any, live: Any, path: str = "", limit: int = 20) -> list[str]:
    out: list[str] = []
    _diff(desired, live, path, out, limit)
    return out


def _diff(desired: Any, live: Any, path: str, out: list[str], limit: int) -> None:
    if len(out) >= limit:
        return
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            if not (desired == {} and live in _EMPTY):
                out.append(f"{path or '.'}: expected an object, live has {type(live).__name__}")
            return
        for k, v in desired.items():
            _diff(v, live.get(k), f"{path}.{k}", out, limit)
        return
    if isinstance(desired, list):
        live_list = live if isinstance(live, list) else ([] if live is None else None)
        if live_list is None:
            out.append(f"{path}: expected a list, live has {type(live).__name__}")
        elif len(live_list) != len(desired):
            out.append(f"{path}: {len(desired)} items rendered, live has {len(live_list)}")
        else:
            for i, (d, lv) in enumerate(zip(desired, live_list)):
                _diff(d, lv, f"{path}[{i}]", out, limit)
        return
    if live is None and desired in _EMPTY:
        return
    if desired == live:
        return
    if isinstance(desired, str) and isinstance(live, str) and ".resources." in path + ".":
        if _quantity(desired) == _quantity(live):  # 1000m and 1 are the same CPU
            return
    out.append(f"{path}: rendered {desired!r}, live {live!r}")
