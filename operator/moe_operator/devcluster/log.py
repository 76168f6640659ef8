"""Progress lines of the dev cluster: `[dev-cluster] ...` on stderr, flushed at once so they
interleave correctly with the build script's and pytest's output."""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(f"[dev-cluster] {msg}", file=sys.stderr, flush=True)
