"""Scheduler: continuous batching over one decode loop, in a background thread.

- Requests wait in a bounded queue (`max_queue`); a full queue raises QueueFull (HTTP 429).
- Each step: admit waiting requests into free KV-cache slots and prefill them together (right-padded,
  which yields their first tokens), then one batched decode step for every running sequence
  (B = running, S = 1).
- Tokens go back to the asyncio side through `loop.call_soon_threadsafe` onto a per-request queue.
- `drain()` stops admissions from the HTTP side and returns once nothing is queued or running.
torch releases the GIL inside kernels, so the HTTP event loop stays responsive while decoding.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from . import sampling
from .log import log


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    top_k: int = 0  # 0 (or -1 at the HTTP side): off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF rule on prompt + output tokens; 1 = off
    frequency_penalty: float = 0.0  # OpenAI rule on output tokens
    presence_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end the sequence (not emitted), like EOS
    min_tokens: int = 0  # EOS / stop_token_ids cannot be picked before this many tokens
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the k most likely


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    id: int = 0
    created: float = field(default_factory=time.time)
    slot: int = -1
    position: int = 0
    generated: list[int] = field(default_factory=list)
    last_token: int = 0
    cancelled: bool = False
    first_token_at: float | None = None
    generator: torch.Generator | None = None
    done: bool = False

    def emit(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


@dataclass
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


class Engine:
    def __init__(self, model, device: str, max_batch: int, max_queue: int, max_len: int, stop_ids: set[int],
                 metrics=None, max_prefill_tokens: int = 8192, cuda_graphs: bool = False):
        self.model, self.device = model, device
        self.max_prefill_tokens = max_prefill_tokens
        self.max_batch, self.max_queue, self.max_len = max_batch, max_queue, max_len
        self.stop_ids = stop_ids
        self.metrics = metrics
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_batch))
        self.cv = threading.Condition()
        self.draining = False
        self.stopped = False
        self._ids = itertools.count(1)
        self.thread: threading.Thread | None = None
        model.allocate_cache(max_batch + 1, max_len)  # + a scratch slot for CUDA-graph padding rows
        self.decoder = None
        if cuda_graphs and str(device).startswith("cuda"):
            from .cuda_graphs import GraphDecoder

            self.decoder = GraphDecoder(model, max_batch, max_len, scratch_slot=max_batch, device=device)

    # ------------------------------------------------------------------ called from the HTTP side
    def submit(self, req: Request) -> Request:
        if len(req.prompt_ids) + 1 > self.max_len:
            raise ValueError(f"prompt has {len(req.prompt_ids)} tokens; this server's context is {self.max_len}")
        with self.cv:
            if self.draining:
                raise Draining()
            if len(self.waiting) >= self.max_queue:
                if self.metrics:
                    self.metrics.rejected.inc()
                raise QueueFull()
            req.id = next(self._ids)
            if req.params.seed is not None:
                req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
            self.waiting.append(req)
            self._gauges()
            self.cv.notify()
        return req

    def cancel(self, req: Request) -> None:
        req.cancelled = True

    def busy(self) -> bool:
        with self.cv:
            return bool(self.waiting or self.running)

    def drain(self, timeout: float | None = None) -> bool:
        """Refuse new work; wait until queued and running requests have finished."""
        t0 = time.time()
        with self.cv:
            self.draining = True
            while self.waiting or self.running:
                left = None if timeout is None else timeout - (time.time() - t0)
                if left is not None and left <= 0:
                    return False
                self.cv.wait(timeout=0.05 if left is None else min(left, 0.05))
        return True

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="moe-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        if self.thread:
            self.thread.join(timeout=10)

    # ------------------------------------------------------------------ the engine thread
    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self.waiting))
            self.metrics.running.set(len(self.running))
            self.metrics.kv_usage.set(1 - len(self.free_slots) / self.max_batch if self.max_batch else 0.0)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopped and not self.waiting and not self.running:
                    self.cv.wait()
                if self.stopped:
                    return
                admit = []
                while self.waiting and self.free_slots:
                    r = self.waiting.popleft()
                    r.slot = self.free_slots.pop()
                    admit.append(r)
                self._gauges()
            try:
                # prefill in groups of at most `max_prefill_tokens` padded tokens
                group: list[Request] = []
                for r in sorted(admit, key=lambda r: len(r.prompt_ids)):
                    if group and (len(group) + 1) * len(r.prompt_ids) > self.max_prefill_tokens:
                        self._prefill(group)
                        group = []
                    group.append(r)
                if group:
                    self._prefill(group)
                if self.running:
                    self._decode_step()
            except Exception as e:  # a failing step must not kill the server: fail those requests
                log("engine_error", f"{type(e).__name__}: {e}")
                for r in list(self.running) + admit:
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
            with self.cv:
                self._gauges()
                self.cv.notify_all()

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[tuple[int, Any]]:
        """logits fp32 [B, V] -> (next token, logprobs or None) per request (greedy at temperature 0)."""
        return sampling.sample(logits, reqs, self.stop_ids)

    def _prefill(self, reqs: list[Request]) -> None:
        """One forward for all newly admitted prompts, right-padded to the longest.

        Padding is harmless: a padded position p of a row is never attended by that row's real
        tokens (causal mask), and decoding writes the row's token p into cache[slot, p] before any
        query attends to it."""
        for r in [r for r in reqs if r.cancelled]:
            self._finish(r, "cancelled")
        reqs = [r for r in reqs if not r.cancelled]
        if not reqs:
            return
        n = max(len(r.prompt_ids) for r in reqs)
        ids = torch.zeros(len(reqs), n, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
        pos = torch.arange(n).expand(len(reqs), n)
        last = torch.tensor([len(r.prompt_ids) - 1 for r in reqs])
        slots = torch.tensor([r.slot for r in reqs])
        d = self.device
        # kv_len from the host: no device->host sync to find the longest position
        logits = self.model(ids.to(d), pos.to(d), slots.to(d), last_index=last.to(d), kv_len=n)[:, -1]
        for r in reqs:
            r.position = len(r.prompt_ids)
            if self.metrics:
                self.metrics.prompt_tokens.inc(len(r.prompt_ids))
            self.running.append(r)
        for r, (tok, lp) in zip(reqs, self._sample(logits, reqs)):
            self._accept(r, tok, lp)

    def _decode_step(self) -> None:
        for r in [r for r in self.running if r.cancelled]:
            self._finish(r, "cancelled")
        if not self.running:
            return
        reqs = list(self.running)
        ids = torch.tensor([[r.last_token] for r in reqs], device=self.device)
        pos = torch.tensor([[r.position] for r in reqs], device=self.device)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        if self.decoder is not None:
            try:
                logits = self.decoder(ids, pos, slots)[:, -1]
            except Exception as e:  # capture failed (e.g. a kernel that syncs): stay correct, run eager
                log("cuda_graph", f"disabled: {type(e).__name__}: {e}")
                self.decoder = None
                logits = self.model(ids, pos, slots)[:, -1]
        else:
            logits = self.model(ids, pos, slots, kv_len=max(r.position for r in reqs) + 1)[:, -1]
        if self.metrics:
            self.metrics.decode_steps.inc()
        for r, (tok, lp) in zip(reqs, self._sample(logits, reqs)):
            r.position += 1
            self._accept(r, tok, lp)

    def _accept(self, r: Request, tok: int, lp: Any = None) -> None:
        if r.first_token_at is None:
            r.first_token_at = time.time()
            if self.metrics:
                self.metrics.ttft.observe(r.first_token_at - r.created)
        r.generated.append(tok)
        r.last_token = tok
        if self.metrics:
            self.metrics.generation_tokens.inc()
        stop = (tok in self.stop_ids and not r.params.ignore_eos) or tok in r.params.stop_token_ids
        if not stop:
            r.emit(tok if lp is None else lp)  # a sampling.Sampled when the client asked for logprobs
        if stop:
            self._finish(r, "stop")
        elif len(r.generated) >= r.params.max_tokens or r.position + 1 >= self.max_len:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.done:
            return
        r.done = True
        if r in self.running:
            self.running.remove(r)
        if r.slot >= 0:
            self.free_slots.append(r.slot)
            r.slot = -1
        n_out = len(r.generated) - (1 if reason == "stop" else 0)
        r.emit(Finished(reason, len(r.prompt_ids), max(n_out, 0), error))
        if self.metrics:
            self.metrics.latency.observe(time.time() - r.created)
