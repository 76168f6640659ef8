"""Check engine_rules rows against an unpacked engine wheel (maintenance; not run by the tests).

Recording a release is scripts/engine_rules_extract.py's job (it writes engine_rules/data/, which the
rows read); this prints, per row, where its marker is in one wheel and whether the row's cited line
numbers still hold, for moving the citations to a new release.

    mkdir -p /tmp/wheels && cd /tmp/wheels && pip download --no-deps sglang==0.5.24
    unzip -q sglang-0.5.24-*.whl 'sglang/srt/*' -d sg0.5.24
    .venv/bin/python scripts/engine_rules_check.py sglang 0.5.24 /tmp/wheels/sg0.5.24

For every row with a marker it reports whether the wheel has the marker anywhere under the engine's
package (the check exists in that release) and, in the row's own file, the line it is on (for the
release the row's line numbers refer to, whether that line is inside the cited range). Use it to set
`since` for a new release, to move line numbers, and to add the release to VERSIONS_READ.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from moe_operator import engine_rules  # noqa: E402


def _in_range(line: int, lines: str) -> bool:
    for part in lines.split(","):
        lo, _, hi = part.partition("-")
        if int(lo) <= line <= int(hi or lo):
            return True
    return False


def main(engine: str, version: str, root: str) -> int:
    base = Path(root)
    pkg = base / engine
    texts = {p: p.read_text(errors="ignore") for p in pkg.rglob("*.py")}
    bad = 0
    rules = engine_rules._rules(engine)
    for r in rules:
        src = r.source
        if not src.marker:
            print(f"{r.id:24} (no marker)")
            continue
        anywhere = any(src.marker in t for t in texts.values())
        f = base / src.file
        where = ""
        if f.is_file():
            hits = [i for i, line in enumerate(f.read_text(errors="ignore").splitlines(), 1) if src.marker in line]
            where = f"{src.file}:{','.join(map(str, hits)) or '-'}"
            if version == src.version and hits and not any(_in_range(h, src.lines) for h in hits):
                where += f"  OUTSIDE cited {src.lines}"
                bad += 1
        present = "present" if anywhere else "absent "
        expect = engine_rules.vt(src.since) <= engine_rules.vt(version)
        flag = "" if anywhere == expect else "  MISMATCH with since=" + src.since
        bad += bool(flag)
        print(f"{r.id:24} {present} {where}{flag}")
    print(f"{len(rules)} rows, {bad} to look at")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
