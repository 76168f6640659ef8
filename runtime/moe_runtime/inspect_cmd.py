"""`moe-runtime inspect DIR`: the operator's CheckpointInfo as JSON (same code as the planner's).

The operator's inspection Job reads the result from the container's termination message, so the
JSON is also written to `--termination-log` (default /dev/termination-log when that is writable).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_core.checkpoint import InspectionError, inspect_dir

from .errors import BadInput, RuntimeFailure

DEFAULT_TERMINATION_LOG = "/dev/termination-log"
_TERMINATION_LIMIT = 4096  # Kubernetes truncates termination messages at 4 KiB


def inspect_checkpoint(path: str | Path):
    try:
        return inspect_dir(path)
    except InspectionError as e:
        raise BadInput(f"checkpoint inspection failed: {e}") from None


def _writable(path: str) -> bool:
    p = Path(path)
    return (p.exists() and os.access(p, os.W_OK)) or (not p.exists() and p.parent.is_dir() and os.access(p.parent, os.W_OK))


def run_inspect(path: str, termination_log: str | None) -> str:
    info = inspect_checkpoint(path)
    text = info.model_dump_json()
    target = termination_log
    if target is None and _writable(DEFAULT_TERMINATION_LOG):
        target = DEFAULT_TERMINATION_LOG
    if target:
        compact = text
        if len(compact.encode()) > _TERMINATION_LIMIT:  # drop the notes first, they are the long part
            d = json.loads(text)
            d["notes"] = d.get("notes", [])[:1]
            compact = json.dumps(d, separators=(",", ":"))
        Path(target).write_text(compact)
    return text
