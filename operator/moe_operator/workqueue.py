"""A work queue of object keys with N workers (issue 34 item 2), as controller-runtime's.

A key is queued at most once; a key added while a worker has it is done again right after, never by
two workers at once; `add(key, after=s)` queues it later (a retry). Whoever adds (the sweep, a watch
event) never waits for the work. `process(key)` returns the seconds after which to do it again, or
None; it handles its own failures (an exception is logged and retried after RETRY_SECONDS).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Hashable

log = logging.getLogger("moe_operator.workqueue")
RETRY_SECONDS = 10.0


class WorkQueue:
    def __init__(self, workers: int, process: Callable[[Hashable], Awaitable[float | None]]):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers, self.process = workers, process
        self._queue: asyncio.Queue | None = None
        self._queued: set[Hashable] = set()   # in the queue, not yet taken
        self._active: set[Hashable] = set()   # a worker has it
        self._again: set[Hashable] = set()    # added while active: queued when the worker is done
        self._timers: dict[Hashable, tuple[float, asyncio.TimerHandle]] = {}
        self._tasks: list[asyncio.Task] = []
        self.done = 0

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._worker(), name=f"moe-worker-{i}") for i in range(self.workers)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for _, h in self._timers.values():
            h.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._queued)

    def busy(self, key: Hashable) -> bool:
        return key in self._active

    def add(self, key: Hashable, after: float = 0.0) -> None:
        """Queue `key` (now, or in `after` seconds; an earlier time already set wins)."""
        if after > 0:
            at = time.monotonic() + after
            old = self._timers.get(key)
            if old is not None and old[0] <= at:
                return
            if old is not None:
                old[1].cancel()
            handle = asyncio.get_running_loop().call_later(after, self._due, key)
            self._timers[key] = (at, handle)
            return
        if key in self._active:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            assert self._queue is not None, "WorkQueue.start() first"
            self._queue.put_nowait(key)

    def _due(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def _worker(self) -> None:
        assert self._queue is not None
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            self._active.add(key)
            retry: float | None
            try:
                retry = await self.process(key)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one key's failure never stops the worker
                log.exception("work on %s failed; retried in %.0fs", key, RETRY_SECONDS)
                retry = RETRY_SECONDS
            finally:
                self._active.discard(key)
                self.done += 1
            if key in self._again:
                self._again.discard(key)
                self.add(key)
            elif retry:
                self.add(key, after=retry)
