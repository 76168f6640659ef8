"""Engine names appear as string literals only inside operator/moe_operator/engines/ (one folder per engine) and in
the CRD's source (api.py: the engine enum and the CEL rules that tie each engine to its accepted values). Anything
else asks the engine (engines.registry) or its vocabulary (engines.vocabulary). The allow-list below is what is
left to move, each with why; an entry that no longer has a literal fails too, so the list only shrinks."""

from __future__ import annotations

import re
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[3] / "operator" / "moe_operator"
LITERAL = re.compile(r"""(?<![\w.])(["'])(sglang|vllm|bundled)\1""")

# path (relative to moe_operator/) -> why it may still name an engine
ALLOWED = {
    "api.py": "the CRD enum source: engine.name's enum and the CEL rules per engine (the CRD must not change)",
}


def literals(path: Path) -> list[str]:
    return [f"{path.relative_to(OPERATOR)}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if LITERAL.search(line)]


def test_engine_names_only_inside_engines():
    found = {}
    for path in sorted(OPERATOR.rglob("*.py")):
        rel = path.relative_to(OPERATOR).as_posix()
        if rel.startswith("engines/"):
            continue
        if hits := literals(path):
            found[rel] = hits
    unexplained = [h for rel, hits in found.items() if rel not in ALLOWED for h in hits]
    assert not unexplained, "engine names outside engines/ (ask engines.registry / engines.vocabulary):\n" + \
        "\n".join(unexplained)
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"no engine literal left in {stale}: drop them from ALLOWED"


def test_the_grep_can_fail():
    assert LITERAL.search('if engine == "sglang":') and LITERAL.search("name != 'vllm'") and LITERAL.search('("bundled",)')
    assert not LITERAL.search('"vllm:num_requests_waiting"') and not LITERAL.search("sglang.launch_server")
    assert not LITERAL.search("vocab.NAME")
