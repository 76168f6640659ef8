"""docs/architecture.md names every module of the four packages, so a new module cannot go undocumented."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = {"moe_core": "operator/moe_core", "moe_operator": "operator/moe_operator",
            "moe_runtime": "runtime/moe_runtime", "moe_kernels": "kernels/moe_kernels"}


def modules() -> list[tuple[str, str]]:
    """(dotted name, path inside its package without .py) of every module and subpackage."""
    out = []
    for pkg, root in PACKAGES.items():
        for f in sorted((ROOT / root).rglob("*.py")):
            parts = f.relative_to(ROOT / root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            if parts:
                out.append((pkg + "." + ".".join(parts), "/".join(parts)))
    return out


def named(doc: str, dotted: str, path: str) -> bool:
    """Named as `pkg.mod`, as its path (`http/app.py`, `models/common`), as `mod`/`mod.py` in backticks, or as mod.py."""
    name = path.rsplit("/", 1)[-1]
    return any(re.search(p, doc) for p in (
        r"\b" + re.escape(dotted) + r"\b",
        r"(?<![\w.])" + re.escape(path) + r"(\.py)?\b" if "/" in path else r"(?!x)x",
        r"`" + re.escape(name) + r"(\.py)?`",
        r"\b" + re.escape(name) + r"\.py\b"))


def test_every_module_is_named_in_the_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [dotted for dotted, path in modules() if not named(doc, dotted, path)]
    assert not missing, f"add a line for each to docs/architecture.md: {missing}"


def test_the_check_can_fail():
    assert len(modules()) > 100 and ("moe_runtime.http.app", "http/app") in modules()
    assert not named("nothing here", "moe_runtime.http.app", "http/app")
    assert named("see `moe_runtime.http.app`", "moe_runtime.http.app", "http/app")
    assert not named("moe_runtime.http.application", "moe_runtime.http.app", "http/app")
