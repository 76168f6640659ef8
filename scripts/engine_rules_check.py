"""Check engine_rules rows against an unpacked engine wheel (maintenance; not run by the tests).

Recording a release is scripts/engine_rules_extract.py's job (it writes engine_rules/data/, which the
rows read); this prints, per row, whether the release has its check (its marker, or the functions it
reads, by qualified name), whether that code is what was recorded (digests), and whether the row's cited
line numbers still hold; and, for the release, whether what was extracted (choices, oracle maps, pins)
is what was recorded and every check that reads differently from every other release was reviewed.
"nothing to look at" (0) means the rows for that release were checked against its wheel.

    mkdir -p /tmp/wheels && cd /tmp/wheels && pip download --no-deps sglang==0.5.24
    unzip -q sglang-0.5.24-*.whl 'sglang/srt/*' -d sg0.5.24
    .venv/bin/python scripts/engine_rules_check.py sglang 0.5.24 /tmp/wheels/sg0.5.24

"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_rules_extract as extract  # noqa: E402
from moe_operator import engine_rules  # noqa: E402
from moe_operator.engine_rules import judge, recorded  # noqa: E402


def _in_range(line: int, lines: str) -> bool:
    for part in lines.split(","):
        lo, _, hi = part.partition("-")
        if int(lo) <= line <= int(hi or lo):
            return True
    return False


def main(engine: str, version: str, root: str) -> int:
    base = Path(root)
    got = extract.extract(engine, version, base)
    have = recorded.release(engine, version)
    bad = 0
    if have is None:
        print(f"{engine} {version} is not recorded (scripts/engine_rules_extract.py --write): its rows are not judged")
        bad += 1
    else:  # what the rows read from this release is what the wheel has
        for k in ("runner_choices", "a2a_choices", "fused_funcs", "oracles", "flashinfer_pin", "hand_kept"):
            if extract._comparable(have.get(k), k) != extract._comparable(got.get(k), k):
                print(f"{'':24} DIFFERS {k}: recorded {extract._comparable(have.get(k), k)!r} "
                      f"vs wheel {extract._comparable(got.get(k), k)!r}"[:600])
                bad += 1
        others = {v: r for v, r in recorded.releases(engine).items() if v != version}
        unread = set(extract.flagged(engine, version, got, others)) - set(have.get("reviewed", ()))
        for key in sorted(unread):
            print(f"{'':24} NOT REVIEWED {key}: reads differently from every other release recorded")
            bad += 1
    rules = judge._rules(engine)
    checked = 0
    for r in rules:
        src = r.source
        rec = recorded.has_check(engine, version, r.id, src.reads) if have is not None else None
        if src.marker:
            m = got["markers"][r.id]
            where = m["at"] or "absent"
            if version == src.version and m["at"]:
                f = base / src.file
                hits = [i for i, line in enumerate(f.read_text(errors="ignore").splitlines(), 1)
                        if src.marker in line] if f.is_file() else []
                if hits and not any(_in_range(h, src.lines) for h in hits):
                    where += f"  OUTSIDE cited {src.lines}"
                    bad += 1
            mine = (have or {}).get("markers", {}).get(r.id) or {}
            if have is not None and mine.get("digest") != m["digest"]:
                where += "  DIFFERS from the recorded digest"
                bad += 1
            print(f"{r.id:24} {'applies' if m['at'] else 'absent '} marker {where}")
        elif src.reads:
            parts = []
            for q in src.reads:
                f = got["functions"][q]
                mine = ((have or {}).get("functions", {}).get(q) or {}).get("digest")
                flag = "" if have is None or mine == f["digest"] else " DIFFERS from the recorded digest"
                bad += bool(flag)
                parts.append(f"{q} {f['at'] or 'absent'}{flag}")
            present = any(got["functions"][q]["at"] for q in src.reads)
            print(f"{r.id:24} {'applies' if present else 'absent '} reads " + "; ".join(parts))
        else:
            applies = engine_rules.vt(src.since) <= engine_rules.vt(version)
            print(f"{r.id:24} {'applies' if applies else 'absent '} from {src.since} (no marker, no function read: the data it reads is the release's)")
            rec = applies
        checked += rec is not None
    print(f"{engine} {version}: {len(rules)} rows ({checked} checked against the recorded release), {bad} to look at")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
