"""No runtime module outside models/<arch>/ names an architecture (issue 33 item 1): the loader, the
checkpoint writer, the specs, the config checks, the shard plan and the rest ask the `Arch`
registry (moe_runtime.models) instead of branching on a name.

"Names" means the code: identifiers, attribute and import names, and string literals (f-string
parts included). Docstrings and comments are prose that may cite a model as an example (the MoE
combine's cost model quotes DeepSeek-V3's sizes), so they are not read. The names looked for are
every architecture's module and config.json class from the capability table, and the family names
they are spelled with in prose and flags (gpt-oss, deepseek, qwen, kimi).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from moe_core.runtime import BUNDLED

RUNTIME = Path(__file__).resolve().parents[3] / "runtime" / "moe_runtime"
FAMILIES = ("gpt[-_ ]?oss", "deepseek", "qwen", "kimi")
PATTERN = re.compile("|".join([*FAMILIES, *map(re.escape, BUNDLED.architectures),
                               *map(re.escape, BUNDLED.architectures.values())]), re.I)

# Modules another helper owns, with the line that still names one, until its owner changes it.
PENDING: dict[str, str] = {}


def code_names(source: str) -> list[tuple[int, str]]:
    """(line, text) of every identifier and non-docstring string literal in `source`."""
    tree = ast.parse(source)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    out = []
    for n in ast.walk(tree):
        texts = []
        if isinstance(n, ast.Name):
            texts = [n.id]
        elif isinstance(n, ast.Attribute):
            texts = [n.attr]
        elif isinstance(n, ast.alias):
            texts = [n.name, n.asname or ""]
        elif isinstance(n, ast.ImportFrom):
            texts = [n.module or ""]
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            texts = [n.name]
        elif isinstance(n, ast.arg):
            texts = [n.arg]
        elif isinstance(n, ast.keyword):
            texts = [n.arg or ""]
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose:
            texts = [n.value]
        out += [(getattr(n, "lineno", 0), t) for t in texts if t]
    return out


def offenders(root: Path, arch_dirs) -> list[str]:
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if rel.parts[0] == "models" and len(rel.parts) > 2 and rel.parts[1] in arch_dirs:
            continue
        out += [f"{rel}:{line}: {text[:60]!r}" for line, text in code_names(f.read_text()) if PATTERN.search(text)]
    return out


def test_no_runtime_module_outside_models_arch_names_an_architecture():
    arch_dirs = set(BUNDLED.architectures.values())
    assert arch_dirs <= {p.name for p in (RUNTIME / "models").iterdir() if p.is_dir()}  # one folder each
    found = offenders(RUNTIME, arch_dirs)
    pending = [o for o in found if o.split(":")[0] in PENDING]
    assert [o for o in found if o not in pending] == []
    # a pending entry that no longer names one must be dropped from PENDING (so the list cannot rot)
    assert {o.split(":")[0] for o in pending} == set(PENDING)


def test_the_check_sees_names_strings_and_f_strings_but_not_prose(tmp_path):
    (tmp_path / "a.py").write_text('"""DeepSeek-V3 in a docstring is prose."""\n# gpt-oss in a comment\nx = 1\n')
    (tmp_path / "b.py").write_text('if arch == "gpt_oss":\n    pass\n')
    (tmp_path / "c.py").write_text('from .models.qwen3_moe import build\nmsg = f"{x} DeepseekV3ForCausalLM"\n')
    (tmp_path / "models" / "gpt_oss").mkdir(parents=True)
    (tmp_path / "models" / "gpt_oss" / "d.py").write_text('NAME = "gpt-oss"\n')
    (tmp_path / "models" / "e.py").write_text('KIND = "kimi"\n')
    got = offenders(tmp_path, {"gpt_oss"})
    assert [g.split(":")[0] for g in got] == ["b.py", "c.py", "c.py", "models/e.py"]
