"""Extract, from an unpacked engine wheel, the facts the start-up rows depend on, as data
(maintenance; the tests read the committed data, they do not run this).

    mkdir -p /tmp/wheels && cd /tmp/wheels && pip download --no-deps sglang==0.5.24
    unzip -q sglang-0.5.24-*.whl 'sglang/srt/*' -d sg0.5.24
    .venv/bin/python scripts/engine_rules_extract.py sglang 0.5.24 /tmp/wheels/sg0.5.24          # show
    .venv/bin/python scripts/engine_rules_extract.py sglang 0.5.24 /tmp/wheels/sg0.5.24 --write  # record
    .venv/bin/python scripts/engine_rules_extract.py sglang 0.5.24 /tmp/wheels/sg0.5.24 --check  # compare

What is extracted (by parsing the code, never by running it):
  * the command-line choices of the runner and all-to-all flags (sglang `--moe-runner-backend` /
    `--moe-a2a-backend`: the argparse `choices` or the server-argument field's `Arg(choices=...)` /
    `Literal[...]`; vLLM: the `MoEBackend` and `All2AllBackend` Literals, minus what the CLI removes);
  * sglang's fused-function registrations (`@register_fused_func(a2a, runner)`);
  * vLLM's oracle maps (`map_<quant>_backend`'s `mapping` dict keys, per quantization method);
  * for every row with a marker: where the marker is (file:line, or absent), and a digest of the code
    around it (the enclosing statement), so a release whose check reads differently from the release
    the row was read in is flagged for a person to read, not taken on trust;
  * for every function a row reads (`Source.reads`: vLLM's device windows, quant-scheme and pairing
    checks, which have no marker string): where it is, located by qualified name anywhere in the
    package (`Class.method` or a module-level `function`; the row's file is only a hint), and a
    digest of its AST; a function that reads differently from every recorded release, or that is
    missing where another recorded release has it, is flagged the same way (sglang's hand-kept
    function digests, `hand_kept`, work as before).

`--write` records the release in operator/moe_operator/engine_rules/data/<engine>.json (the one
source the rows read: which releases were read, their choices, which rows they have). It refuses a
release whose flagged checks were not reviewed (`--reviewed ROW,ROW` after reading them), and
`--check` fails when the committed data and the wheel disagree (a new release changed something).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from moe_operator import engine_rules  # noqa: E402
from moe_operator.engine_rules import judge, recorded as rules_data  # noqa: E402

# Functions whose facts are hand-kept data (vLLM capability windows): their digest per release.
# (vLLM's are the functions its rows read: Source.reads, digested per function below.)
HAND_KEPT = {
    "vllm": {},
    "sglang": {
        # which runners are fused-only and how the fused function is looked up (SG-FUSED, SG-PERMUTE)
        "moe_runner_init": ("sglang/srt/layers/moe/moe_runner/runner.py", "MoeRunner.__init__"),
    },
}


class Tree:
    """Every module of the engine package, parsed once."""

    def __init__(self, root: Path, package: str):
        self.root = root
        self.text: dict[str, list[str]] = {}
        self.raw: dict[str, str] = {}
        for p in sorted((root / package).rglob("*.py")):
            rel = str(p.relative_to(root))
            self.raw[rel] = p.read_text(errors="ignore")
            self.text[rel] = self.raw[rel].splitlines()
        self._ast: dict[str, ast.Module | None] = {}

    def tree(self, rel: str) -> ast.Module | None:
        """Parsed on first use: parsing the whole package is slow, the facts sit in a few files."""
        if rel not in self._ast:
            try:
                self._ast[rel] = ast.parse(self.raw[rel])
            except (SyntaxError, KeyError):
                self._ast[rel] = None
        return self._ast[rel]

    def files_with(self, needle: str) -> list[str]:
        return [rel for rel, src in self.raw.items() if needle in src]

    @property
    def mods(self) -> dict[str, ast.Module]:  # every module (slow; only where a search needs all)
        return {rel: m for rel in self.raw if (m := self.tree(rel)) is not None}

    def _globals(self, name: str) -> list[tuple[str, ast.AST]]:
        out = []
        for rel in self.files_with(name):
            mod = self.tree(rel)
            for node in (mod.body if mod else []):
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    out.append((rel, node.value))
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                        and node.value is not None:
                    out.append((rel, node.value))
        return out

    def strings(self, node: ast.AST, where: str, depth: int = 0) -> list[str] | None:
        """A list/tuple/set of string constants, a Literal[...], a name bound to one, or a sum."""
        if depth > 5:
            return None
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            out = []
            for e in node.elts:
                if isinstance(e, ast.Constant) and isinstance(e.value, str):
                    out.append(e.value)
                elif isinstance(e, ast.Starred):
                    inner = self.strings(e.value, where, depth + 1)
                    if inner is None:
                        return None
                    out += inner
                else:
                    return None
            return out
        if isinstance(node, ast.Subscript) and _name(node.value) == "Literal":
            sl = node.slice
            return self.strings(sl if isinstance(sl, ast.Tuple) else ast.Tuple(elts=[sl]), where, depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            a, b = self.strings(node.left, where, depth + 1), self.strings(node.right, where, depth + 1)
            return a + b if a is not None and b is not None else None
        if isinstance(node, ast.Call) and _name(node.func) in ("list", "tuple", "get_args") and node.args:
            return self.strings(node.args[0], where, depth + 1)
        if isinstance(node, ast.Name):
            found = self._globals(node.id)
            same = [v for rel, v in found if rel == where] or [v for _, v in found]
            for v in same:
                got = self.strings(v, where, depth + 1)
                if got is not None:
                    return got
        return None

    def flag_choices(self, flag: str, field: str) -> tuple[list[str], str] | None:
        """The choices of `--flag` (argparse add_argument) or of the server-argument field `field`
        (an annotated field whose Arg(...) has choices=, else its Literal)."""
        for rel in self.files_with(flag):
            for node in ast.walk(self.tree(rel) or ast.Module(body=[])):
                if isinstance(node, ast.Call) and _name(node.func).endswith("add_argument") and node.args \
                        and isinstance(node.args[0], ast.Constant) and node.args[0].value == flag:
                    for kw in node.keywords:
                        if kw.arg == "choices":
                            got = self.strings(kw.value, rel)
                            if got is not None:
                                return got, f"{rel}:{node.lineno}"
        for rel in self.files_with(field + ":"):
            for node in ast.walk(self.tree(rel) or ast.Module(body=[])):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == field:
                    ann = node.annotation
                    lit = arg_choices = None
                    for sub in ast.walk(ann):
                        if isinstance(sub, ast.Call) and _name(sub.func) == "Arg":
                            for kw in sub.keywords:
                                if kw.arg == "choices":
                                    arg_choices = self.strings(kw.value, rel)
                        if isinstance(sub, ast.Subscript) and _name(sub.value) == "Literal" and lit is None:
                            lit = self.strings(sub, rel)
                    got = arg_choices if arg_choices is not None else lit
                    if got is not None:
                        return got, f"{rel}:{node.lineno}"
        return None

    def literal_alias(self, name: str) -> tuple[list[str], str] | None:
        """`Name = Literal[...]` at module level (vLLM's MoEBackend, All2AllBackend)."""
        for rel in self.files_with(name):
            for node in (self.tree(rel) or ast.Module(body=[])).body:
                value = None
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    value = node.value
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                    value = node.value
                elif isinstance(node, ast.TypeAlias) if hasattr(ast, "TypeAlias") else False:
                    if _name(node.name) == name:
                        value = node.value
                if value is not None:
                    got = self.strings(value, rel)
                    if got is not None:
                        return got, f"{rel}:{node.lineno}"
        return None

    def decorated_pairs(self, decorator: str) -> list[tuple[str, str]]:
        out = set()
        for rel in self.files_with("@" + decorator):
            for node in ast.walk(self.tree(rel) or ast.Module(body=[])):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    for d in node.decorator_list:
                        if isinstance(d, ast.Call) and _name(d.func) == decorator and len(d.args) >= 2 \
                                and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in d.args[:2]):
                            out.add((d.args[0].value, d.args[1].value))
        return sorted(out)

    def mapping_keys(self, rel: str, function: str) -> list[str] | None:
        mod = self.tree(rel) if rel in self.raw else None
        if mod is None:
            return None
        for node in ast.walk(mod):
            if isinstance(node, ast.FunctionDef) and node.name == function:
                for sub in ast.walk(node):
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, ast.AnnAssign) else []
                    if isinstance(getattr(sub, "value", None), ast.Dict) \
                            and any(isinstance(t, ast.Name) and t.id == "mapping" for t in targets):
                        keys = [k.value for k in sub.value.keys if isinstance(k, ast.Constant)]
                        return sorted(keys)
        for node in mod.body:  # oracles that keep the map at module level (mxfp8: _BACKEND_NAME_MAP)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if isinstance(getattr(node, "value", None), ast.Dict) \
                    and any(isinstance(t, ast.Name) and t.id == "_BACKEND_NAME_MAP" for t in targets):
                return sorted(k.value for k in node.value.keys if isinstance(k, ast.Constant))
        return None

    def function_digest(self, rel: str, function: str) -> str | None:
        mod = self.tree(rel) if rel in self.raw else None
        if mod is None:
            return None
        cls, _, function = function.rpartition(".")
        scopes = [n for n in ast.walk(mod) if isinstance(n, ast.ClassDef) and n.name == cls] if cls else [mod]
        for scope in scopes:
            for node in ast.walk(scope):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
                    return _digest(ast.dump(node, include_attributes=False))
        return None

    def locate(self, qual: str) -> list[tuple[str, int, str]]:
        """Every definition whose qualified name is `qual` ("Class.method", "Outer.Inner.method", a
        module-level "function" or, failing that, a module-level constant), anywhere in the package: (file, line, AST digest). Only the files
        that contain the last name are parsed."""
        parts = qual.split(".")
        out = []
        for rel in self.files_with(parts[-1]):
            mod = self.tree(rel)
            if mod is None:
                continue
            scope: list[ast.AST] = [mod]
            for i, name in enumerate(parts):
                last = i == len(parts) - 1
                kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
                scope = [n for s in scope for n in getattr(s, "body", []) if isinstance(n, kinds) and n.name == name]
            if not scope and len(parts) == 1:  # a module-level constant a check reads (a set of names)
                scope = [n for n in mod.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                         and any(isinstance(t, ast.Name) and t.id == qual
                                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
            out += [(rel, n.lineno, _digest(ast.dump(n, include_attributes=False))) for n in scope]
        return out

    def function(self, qual: str, hint: str = "") -> dict:
        """Where `qual` is and its digest: {"at": file:line, "digest"}; {"at": None, "digest": None}
        when the release has no such definition; several definitions: the one in `hint`'s file, else
        all of them (at: a list, digest: of the digests together) so the reader sees the ambiguity."""
        found = self.locate(qual)
        if hint:
            found = [f for f in found if f[0] == hint] or found
        if not found:
            return {"at": None, "digest": None}
        if len(found) == 1:
            rel, line, digest = found[0]
            return {"at": f"{rel}:{line}", "digest": digest}
        return {"at": [f"{rel}:{line}" for rel, line, _ in found], "digest": _digest("".join(d for *_, d in found))}

    def marker(self, text: str) -> tuple[str | None, str | None]:
        """(file:line of the first place the marker is, digest of its enclosing statement)."""
        for rel, lines in self.text.items():
            for i, line in enumerate(lines, 1):
                if text in line:
                    return f"{rel}:{i}", self._statement_digest(rel, i)
        return None, None

    def _statement_digest(self, rel: str, line: int) -> str:
        """The innermost `if` (its test and body, not its else) or `assert` holding `line`, else the
        innermost statement, as an AST dump: formatting and line numbers do not change it, a changed
        condition or message does."""
        best: tuple[int, int, ast.AST] | None = None
        for node in ast.walk(self.tree(rel) or ast.Module(body=[])):
            if not isinstance(node, ast.stmt) or not (node.lineno <= line <= (node.end_lineno or node.lineno)):
                continue
            rank = 0 if isinstance(node, (ast.If, ast.Assert)) else 1
            size = (node.end_lineno or node.lineno) - node.lineno
            if isinstance(node, ast.If) and node.orelse and line >= node.orelse[0].lineno:
                continue  # the line is in the else branch: the test is not this row's
            if best is None or (rank, size) < (best[0], best[1]):
                best = (rank, size, node)
        if best is None:
            return _digest(self.text[rel][line - 1].strip())
        node = best[2]
        if isinstance(node, ast.If):
            node = ast.If(test=node.test, body=node.body, orelse=[])
        return _digest(ast.dump(node, include_attributes=False))


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


ORACLES = ("fp8", "nvfp4", "mxfp4", "mxfp8", "unquantized")
# oracles that a release may lack (recorded as null: the rows that read it do not apply there)
OPTIONAL_ORACLES = {"wna16": ("int_wna16.py", "map_wna16_backend")}  # first in 0.25.0


def extract(engine: str, version: str, root: Path) -> dict:
    tree = Tree(root, engine)
    out: dict = {}
    if engine == "sglang":
        runner = tree.flag_choices("--moe-runner-backend", "moe_runner_backend")
        a2a = tree.flag_choices("--moe-a2a-backend", "moe_a2a_backend")
        if runner is None or a2a is None:
            raise SystemExit(f"sglang {version}: runner or a2a choices not found (runner={runner}, a2a={a2a})")
        out["runner_choices"] = {"values": list(dict.fromkeys(runner[0])), "at": runner[1]}
        out["a2a_choices"] = {"values": list(dict.fromkeys(a2a[0])), "at": a2a[1]}
        out["fused_funcs"] = [list(p) for p in tree.decorated_pairs("register_fused_func")]
    else:
        runner = tree.literal_alias("MoEBackend")
        a2a = tree.literal_alias("All2AllBackend")
        if runner is None or a2a is None:
            raise SystemExit(f"vllm {version}: MoEBackend or All2AllBackend not found")
        out["runner_choices"] = {"values": list(dict.fromkeys(runner[0])), "at": runner[1]}
        # the CLI removes "passthrough" (engine/arg_utils.py); "none" is the planner's word for no flag
        out["a2a_choices"] = {"values": list(dict.fromkeys(["none", *(x for x in a2a[0] if x != "passthrough")])), "at": a2a[1]}
        oracle = "vllm/model_executor/layers/fused_moe/oracle/"
        out["oracles"] = {q: tree.mapping_keys(f"{oracle}{q}.py", f"map_{q}_backend") for q in ORACLES}
        missing = [q for q, keys in out["oracles"].items() if keys is None]
        if missing:
            raise SystemExit(f"vllm {version}: oracle maps not found for {', '.join(missing)}: read them by hand")
        for q, (file, fn) in OPTIONAL_ORACLES.items():
            out["oracles"][q] = tree.mapping_keys(oracle + file, fn)
    out["flashinfer_pin"] = flashinfer_pin(root)
    out["hand_kept"] = {k: tree.function_digest(rel, fn) for k, (rel, fn) in HAND_KEPT[engine].items()}
    markers = {}
    for rule in judge._rules(engine):
        if rule.source.marker:
            where, digest = tree.marker(rule.source.marker)
            markers[rule.id] = {"at": where, "digest": digest}
    out["markers"] = markers
    functions = {}
    for rule in judge._rules(engine):
        for qual in rule.source.reads:
            functions.setdefault(qual, tree.function(qual, rule.source.file))
    if functions:
        out["functions"] = functions
    return out


_PIN = re.compile(r"^Requires-Dist: flashinfer[_-]python(?:\[[^\]]*\])?\s*==\s*([^\s;,]+)", re.M)


def flashinfer_pin(root: Path) -> str | None:
    """The flashinfer-python release the wheel pins (its METADATA; unzip '*.dist-info/METADATA' too)."""
    for meta in sorted(root.glob("*.dist-info/METADATA")):
        m = _PIN.search(meta.read_text(errors="ignore"))
        if m:
            return m.group(1)
    return None


def flagged(engine: str, version: str, got: dict, recorded: dict) -> list[str]:
    """Rows and hand-kept facts whose code differs from every release already recorded that has
    them: they must be read by a person before this release is recorded."""
    out = []
    for rid, m in got["markers"].items():
        if m["at"] is None:
            continue
        seen = [r["markers"].get(rid, {}).get("digest") for r in recorded.values()]
        seen = [d for d in seen if d]
        if seen and m["digest"] not in seen:
            out.append(rid)
    for key, digest in got["hand_kept"].items():
        seen = {r["hand_kept"].get(key) for r in recorded.values()} - {None}
        if seen and digest not in seen:
            out.append(key)
    for qual, f in got.get("functions", {}).items():
        seen = {(r.get("functions", {}).get(qual) or {}).get("digest") for r in recorded.values()} - {None}
        if f["digest"] is None and seen:  # gone (or renamed): does the row's check still exist?
            out.append(qual)
        elif f["digest"] is not None and f["digest"] not in seen and any("functions" in r for r in recorded.values()):
            out.append(qual)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=("sglang", "vllm"))
    ap.add_argument("version")
    ap.add_argument("root")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--reviewed", default="", help="rows/facts read by a person in this release (comma list)")
    ap.add_argument("--note", default="", help="what the person found (recorded with the release)")
    ap.add_argument("--note-file", default="", help="the same, from a file")
    a = ap.parse_args(argv)
    if a.note_file:
        a.note = Path(a.note_file).read_text().strip()
    got = extract(a.engine, a.version, Path(a.root))
    recorded = rules_data.releases(a.engine)
    prior = {v: r for v, r in recorded.items() if v != a.version}
    flags = flagged(a.engine, a.version, got, prior)
    present = sum(1 for m in got["markers"].values() if m["at"])
    print(f"{a.engine} {a.version}: {len(got['runner_choices']['values'])} runner choices "
          f"({got['runner_choices']['at']}), {len(got['a2a_choices']['values'])} a2a choices, "
          f"{present}/{len(got['markers'])} row markers present")
    for rid in flags:
        m = got["markers"].get(rid) or got.get("functions", {}).get(rid)
        where = f" ({m['at']})" if m and m["at"] else " (absent here)" if m else ""
        rows = sorted(r.id for r in judge._rules(a.engine) if rid in r.source.reads)
        print(f"  TO READ {rid}: the code differs from every recorded release{where}"
              + (f"; read by {', '.join(rows)}" if rows else ""))
    if a.check:
        have = recorded.get(a.version)
        if have is None:
            print(f"  {a.engine} {a.version} is not recorded")
            return 1
        diff = [k for k in ("runner_choices", "a2a_choices", "fused_funcs", "oracles", "flashinfer_pin", "hand_kept", "markers",
                                  "functions")
                if _comparable(have.get(k), k) != _comparable(got.get(k), k)]
        for k in diff:
            print(f"  DIFFERS {k}: recorded {have.get(k)!r} vs wheel {got.get(k)!r}"[:2000])
        return 1 if diff else 0
    if a.write:
        reviewed = {x for x in a.reviewed.split(",") if x}
        unread = [f for f in flags if f not in reviewed]
        if unread:
            print(f"  not recorded: read {', '.join(unread)} first (then --reviewed)")
            return 1
        got["reviewed"] = sorted(reviewed)
        got["note"] = a.note or (recorded.get(a.version) or {}).get("note", "")
        rules_data.write(a.engine, a.version, got)
        print(f"  recorded in {rules_data.path(a.engine)}")
    return 0


def _comparable(value, key):
    if key in ("markers", "functions") and isinstance(value, dict):
        return {k: (v or {}).get("digest") for k, v in value.items()}
    if key in ("runner_choices", "a2a_choices") and isinstance(value, dict):
        return value.get("values")
    return value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
