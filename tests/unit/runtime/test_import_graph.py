"""The import graph of moe_core, moe_operator, moe_runtime and moe_kernels has no cycle among its
module-level imports, and no function-level import closes one either: such an import exists only
to keep the cycle from breaking the import (issue 33 items 2 and 4), so it is refused like the cycle
itself, in all four packages. None is known (`KNOWN_LAZY` is empty); any fails.

The graph is read from the source (ast), not by importing: every `import` / `from ... import`
statement, resolved to the package's own modules (a name imported from a package is its submodule
when one exists). Importing a.b.c runs the package __init__ of a.b too, so that is an edge as well.
`if TYPE_CHECKING:` imports never run and are left out. importlib calls are not statements and are
not seen (the model registry loads architectures by name on purpose).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = {"moe_core": ROOT / "operator", "moe_operator": ROOT / "operator", "moe_runtime": ROOT / "runtime",
            "moe_kernels": ROOT / "kernels"}


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    out = {}
    for pkg, base in packages.items():
        for f in sorted((base / pkg).rglob("*.py")):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return isinstance(t, ast.Name) and t.id == "TYPE_CHECKING" or isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"


def _imports(tree: ast.AST):
    """(node, inside a function) for every import statement that can run."""
    def walk(node, in_func):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for c in child.orelse:
                    yield from walk(ast.Module(body=[c], type_ignores=[]), in_func)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_func
            yield from walk(child, in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    yield from walk(tree, False)


def edges(mods: dict[str, Path]) -> list[tuple[str, str, bool, int]]:
    """(importer, imported, inside a function, line) over the modules of `mods`."""
    out = []
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        for node, in_func in _imports(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    pkg_parts = package.split(".")
                    pkg_parts = pkg_parts[: len(pkg_parts) - (node.level - 1)]
                    base = ".".join(pkg_parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import moe_kernels.x.y` names a module; an attribute path is cut back
                    t = t.rpartition(".")[0]
                if not t:
                    continue
                # importing a.b.c runs a.b's __init__ first (the packages above the importer already run)
                parts = t.split(".")
                for k in range(1, len(parts) + 1):
                    mod = ".".join(parts[:k])
                    if mod in mods and mod != name and not (name + ".").startswith(mod + "."):
                        out.append((name, mod, in_func, node.lineno))
    return out


def cycles(graph_edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    adj: dict[str, set[str]] = {}
    for a, b, *_ in graph_edges:
        adj.setdefault(a, set()).add(b)
        adj.setdefault(b, set())
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(adj[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            strong(v)
    return out


def lazy_cycles(mods: dict[str, Path], within: str = "", known: frozenset[str] = frozenset()) -> list[str]:
    """Cycles closed only by function-level imports whose importer is under `within` (all: ""). A
    function-level import named in `known` ("importer imports imported") is taken out of the graph first."""
    e = [x for x in edges(mods) if not (x[2] and f"{x[0]} imports {x[1]}" in known)]
    out = []
    for c in cycles(e):
        lazy = sorted({f"{a}:{line} imports {b} inside a function" for a, b, f, line in e
                       if f and a in c and b in c and (a + ".").startswith(within)})
        if lazy:
            out.append(f"function-level import kept to avoid a cycle of {', '.join(c)}: {'; '.join(lazy)}")
    return out


def problems(mods: dict[str, Path], within: str = "", known: frozenset[str] = frozenset()) -> list[str]:
    e = edges(mods)
    out = [f"import cycle: {' <-> '.join(c)}" for c in cycles([x for x in e if not x[2]])]
    return out or lazy_cycles(mods, within, known)


KNOWN_LAZY: frozenset[str] = frozenset()  # none left: a lazy import that closes a cycle is fixed, not listed


def test_the_four_packages_have_no_import_cycle():
    mods = modules(PACKAGES)
    assert len(mods) > 100 and "moe_runtime.dist.group" in mods
    assert {"moe_kernels.paged_attention", "moe_operator.render", "moe_core.plan"} <= set(mods)
    assert problems(mods, known=KNOWN_LAZY) == []


def test_a_known_lazy_import_excuses_only_itself(tmp_path):
    mods = _write(tmp_path, {"__init__.py": "", "a.py": "from . import b\n", "b.py": "def f():\n    from . import a\n",
                             "c.py": "from . import d\n", "d.py": "def f():\n    from . import c\n"})
    got = problems(mods, known=frozenset({"pkg.b imports pkg.a"}))
    assert len(got) == 1 and "pkg.d:2 imports pkg.c inside a function" in got[0]
    assert problems(mods, known=frozenset({"pkg.b imports pkg.a", "pkg.d imports pkg.c"})) == []


def _write(tmp_path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        p = tmp_path / "pkg" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return modules({"pkg": tmp_path})


def test_a_cycle_and_a_lazy_import_that_hides_one_are_found(tmp_path):
    mods = _write(tmp_path, {"__init__.py": "", "a.py": "from . import b\n", "b.py": "from .c import x\n",
                             "c.py": "def f():\n    from .a import y\n", "d.py": "from pkg import a\n",
                             "sub/__init__.py": "from . import e\n", "sub/e.py": "from ..a import z\n"})
    assert problems(mods, within="other.") == []  # a lazy import outside the checked package is not refused
    got = problems(mods, within="pkg.")
    assert len(got) == 1 and got[0].startswith("function-level import kept to avoid a cycle of pkg.a, pkg.b, pkg.c")
    assert "pkg.c:2 imports pkg.a inside a function" in got[0]
    # made top-level, the same import is a cycle
    (tmp_path / "pkg" / "c.py").write_text("from .a import y\n")
    assert problems(modules({"pkg": tmp_path})) == ["import cycle: pkg.a <-> pkg.b <-> pkg.c"]


def test_a_package_init_that_imports_its_importer_is_a_cycle(tmp_path):
    # importing pkg.sub.e runs pkg/sub/__init__.py, which imports pkg.a back
    mods = _write(tmp_path, {"__init__.py": "", "a.py": "from .sub.e import q\n",
                             "sub/__init__.py": "from .. import a\n", "sub/e.py": "q = 1\n"})
    assert problems(mods) == ["import cycle: pkg.a <-> pkg.sub"]


def test_type_checking_imports_do_not_count(tmp_path):
    mods = _write(tmp_path, {"__init__.py": "", "a.py": "from . import b\n",
                             "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"})
    assert problems(mods) == []
