"""The flags the operator owns on `moe-runtime serve` and the spec field that sets each."""

from __future__ import annotations

from ..owned import MODEL, SERVER, SERVED, TP, EP, NODES

OWNED: dict[str, str] = {
    "--model": MODEL, "--plan": "the operator (the plan ConfigMap)", "--host": SERVER, "--port": SERVER,
    "--served-model-name": SERVED, "--max-model-len": "spec.engine.maxModelLen",
    "--tp": TP, "--ep": EP, "--dist-port": NODES,
}
