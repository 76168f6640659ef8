"""Bounded thread pools for blocking I/O, and background work with a deadline (issue 27 item 6).

Reconciles (Kubernetes calls) run on one pool and hub calls on another, each of fixed size: a hub
that never answers fills only the hub pool, never the threads that repair other tenants' objects.
(`asyncio.to_thread` shares one default pool among everything in the process.)
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Hashable, TypeVar

T = TypeVar("T")


class Pending(Exception):
    """The work runs in the background; ask again shortly."""

    def __init__(self, elapsed: float):
        self.elapsed = elapsed
        super().__init__(f"running in the background for {elapsed:.0f}s")


class DeadlineExceeded(Exception):
    """The work has run past its deadline (it may still finish; its thread cannot be stopped)."""

    def __init__(self, elapsed: float, deadline: float):
        self.elapsed, self.deadline = elapsed, deadline
        super().__init__(f"no answer after {elapsed:.0f}s (deadline {deadline:.0f}s)")


@dataclass
class _Entry:
    future: Future
    started: float
    finished: float | None = None


class Background:
    """One run of `fn` per key at a time on a bounded pool. `run` returns its result when it is
    done within `wait` seconds, else raises Pending (or DeadlineExceeded past `deadline`) and the
    work goes on. `fn` stores its result where callers look before calling `run` (a cache), so a
    success is forgotten at once; a failure is kept for `hold` seconds so that every caller waiting
    on the key sees it (the hub is not asked again by each waiter), then the next call starts anew."""

    def __init__(self, workers: int, name: str, hold: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self.hold, self.clock = hold, clock
        self._entries: dict[Hashable, _Entry] = {}
        self._lock = threading.Lock()

    def run(self, key: Hashable, fn: Callable[[], T], *, wait: float, deadline: float) -> T:
        with self._lock:
            now = self.clock()
            e = self._entries.get(key)
            if e is not None and e.finished is not None and (
                    now - e.finished > self.hold or e.future.exception() is None):
                e = None  # a success is not held: `fn` leaves its result where callers look first
            if e is None:
                e = self._entries[key] = _Entry(self.pool.submit(fn), now)
                e.future.add_done_callback(lambda _f, e=e: setattr(e, "finished", self.clock()))
        try:
            return e.future.result(timeout=wait)
        except FutureTimeout:
            elapsed = self.clock() - e.started
            if elapsed > deadline:
                raise DeadlineExceeded(elapsed, deadline) from None
            raise Pending(elapsed) from None

    def running(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if not e.future.done())

