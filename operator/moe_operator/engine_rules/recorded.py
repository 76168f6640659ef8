"""What was read from each engine release, as data (engine_rules/data/<engine>.json), written by
scripts/engine_rules_extract.py from the unpacked wheel: the command-line choices, sglang's
fused-function registrations, vLLM's oracle maps, and for every start-up row whether (and where)
the release has the row's check. The rows read it; a release that is not in it was not read.
Pure (one file read, cached)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"


def vt(v: str | None) -> tuple[int, ...]:
    """'0.5.23' -> (0, 5, 23); suffixes (rc, post, +local) are ignored."""
    if not v:
        return ()
    out = []
    for part in v.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out + [0] * (3 - len(out))) if out else ()


_RELEASE = re.compile(r"v?(\d+(?:\.\d+)*)(?:[.-]?(rc|post)(\d+))?(?:\+.*)?")


def release_key(v: str) -> tuple | None:
    """Sort key of a release string ('0.5.23' < '0.5.23.post1' < '0.5.24rc0' < '0.5.24'); None when
    the string is not a release number. A post release is a release of its own, not its base's."""
    m = _RELEASE.fullmatch((v or "").strip())
    if not m:
        return None
    tag = {"rc": 0, None: 1, "post": 2}[m.group(2)]
    return (vt(m.group(1)), tag, int(m.group(3) or 0))


def path(engine: str) -> Path:
    return DATA / f"{engine}.json"


@functools.lru_cache(maxsize=None)
def _load(engine: str) -> dict[str, Any]:
    p = path(engine)
    return json.loads(p.read_text()) if p.is_file() else {}


def releases(engine: str) -> dict[str, dict[str, Any]]:
    """release -> what was read from it."""
    return _load(engine).get("releases", {})


def release(engine: str, version: str) -> dict[str, Any] | None:
    return releases(engine).get(version)


def has_check(engine: str, version: str, rule_id: str, reads: tuple[str, ...] = ()) -> bool | None:
    """Whether this release has the row's check: its marker was found, or (a row without one) a
    function it reads (`reads`, by qualified name) is there (one backend's check may sit in several
    classes, not all of them in every release); None: not recorded."""
    r = release(engine, version)
    if r is None:
        return None
    if rule_id in r.get("markers", {}):
        return r["markers"][rule_id].get("at") is not None
    functions = r.get("functions", {})
    if reads and all(q in functions for q in reads):
        return any(functions[q].get("at") is not None for q in reads)
    return None


def first_with(engine: str, rule_id: str, reads: tuple[str, ...] = ()) -> str | None:
    """The first release read that has the row's check (None: no recorded release has it)."""
    return next((v for v in releases(engine) if has_check(engine, v, rule_id, reads)), None)


def write(engine: str, version: str, facts: dict[str, Any]) -> None:
    """Record one release (the extraction script; not used at run time)."""
    data = json.loads(path(engine).read_text()) if path(engine).is_file() else {"releases": {}}
    data.setdefault("releases", {})[version] = facts
    from . import release_key

    data["releases"] = dict(sorted(data["releases"].items(), key=lambda kv: release_key(kv[0]) or ()))
    DATA.mkdir(parents=True, exist_ok=True)
    path(engine).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    _load.cache_clear()
