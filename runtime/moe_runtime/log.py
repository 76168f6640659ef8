"""Structured logs: one JSON line per decision/event on stderr (what the operator's log tooling reads)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def log(event: str, msg: str = "", **fields: Any) -> None:
    rec = {"ts": round(time.time(), 3), "event": event}
    if msg:
        rec["msg"] = msg
    rec.update(fields)
    print(json.dumps(rec, default=str), file=sys.stderr, flush=True)
