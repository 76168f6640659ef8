"""Loading progress: bytes/s, a bar on a terminal and a structured log line per file (the loader's
whole-checkpoint read and each rank's sharded read)."""

from __future__ import annotations

import sys
import time
from typing import Callable


class Progress:
    """Bytes/s progress: a bar on a terminal, a structured log line per file always."""

    def __init__(self, total: int, log: Callable[..., None]):
        self.total, self.done, self.t0, self.log = total, 0, time.time(), log
        self.tty = sys.stderr.isatty()

    def advance(self, n: int) -> None:
        self.done += n
        if self.tty:
            el = max(time.time() - self.t0, 1e-9)
            pct = 100 * self.done / max(self.total, 1)
            print(f"\rloading weights {pct:5.1f}% {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                  f"{self.done / el / 1e9:.2f} GB/s", end="", file=sys.stderr, flush=True)

    def file_done(self, name: str, i: int, n: int) -> None:
        el = max(time.time() - self.t0, 1e-9)
        if self.tty:
            print(file=sys.stderr)
        self.log("load_progress", f"shard {i}/{n} {name}", bytes_done=self.done, bytes_total=self.total,
                 gb_per_s=round(self.done / el / 1e9, 3), elapsed_s=round(el, 2))
