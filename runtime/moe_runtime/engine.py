"""Scheduler: continuous batching with chunked prefill over a paged KV cache, in a background thread.

- Requests wait in a bounded queue (`max_queue`); a full queue raises QueueFull (HTTP 429).
- Admission (oldest first, at most `max_batch` running): the prompt's blocks are allocated at once
  (kv_cache.BlockManager), reusing the cached blocks of a shared prefix, whose tokens are then not
  computed again. A prompt that does not fit in the free blocks waits (never an OOM).
- Each step: one batched decode forward for every sequence with one token left to compute
  (B = decoding, S = 1), then prefill chunks of the others within the step's token budget
  (`max_prefill_tokens` minus the decode rows), batched into one right-padded forward; a long prompt
  takes several steps while the running sequences keep decoding. A chunk that completes a prompt
  yields its first token.
- A decode that needs a new block when none is free preempts the most recently admitted sequence
  (its blocks are freed, it goes back to the head of the queue and is recomputed from its prompt and
  the tokens it already produced, with the prefix cache's help).
- Tokens go back to the asyncio side through `loop.call_soon_threadsafe` onto a per-request queue.
- `drain()` stops admissions from the HTTP side and returns once nothing is queued or running.
torch releases the GIL inside kernels, so the HTTP event loop stays responsive while decoding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from . import sampling
from .errors import RuntimeFailure
from .kv_cache import BlockManager, OutOfBlocks, SeqBlocks, queue_limit, running_limit
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
    # None: off; k: every prompt token's logprob (after the first) and the k most likely there
    # (vLLM's SamplingParams.prompt_logprobs)
    prompt_logprobs: int | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    id: int = 0
    created: float = field(default_factory=time.time)
    blocks: SeqBlocks | None = None  # its KV blocks while admitted
    computed: int = 0  # leading tokens (prompt + generated) whose KV is in the cache
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    scheduled_at: float | None = None  # first admission (vLLM's scheduled_ts: queue time ends)
    first_token_at: float | None = None
    last_token_at: float | None = None  # for the inter-token latency histogram
    generator: torch.Generator | None = None
    done: bool = False
    # sampling.Sampled of prompt tokens 1.. (prompt_logprobs), complete before the first token is emitted
    prompt_logprobs: list = field(default_factory=list)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked and not all computed yet: every prompt position's logits are needed,
        so no prefix-cache hit may skip one (vLLM skips the cache for such requests:
        vllm/v1/core/kv_cache_manager.py KVCacheManager.get_computed_blocks, v0.11.0)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    def emit(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


@dataclass
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    # vLLM's stop_reason: the stop token id (or, set by the server, the stop string) that ended the
    # output; None for EOS, length and the rest (vllm/v1/core/sched/utils.py check_stop, v0.11.0)
    stop_reason: int | str | None = None


# prefill chunk of a request scoring its prompt (prompt_logprobs): every position's logits are kept,
# 512 x a 163k vocabulary in fp32 is 0.3 GiB
PROMPT_LOGPROBS_CHUNK = 512
CPU_KV_SEQS = 16  # CPU default KV budget without --max-batch: this many sequences of max_len


def device_seq_ceiling(device: str) -> int:
    """The device's bound on sequences decoded together, vLLM's default max_num_seqs for its OpenAI
    server (vllm/engine/arg_utils.py EngineArgs._set_default_args, v0.11.0): 1024 on a GPU of at
    least 70 GiB that is not an A100 (H100, H200, MI300x), 256 on other GPUs, 128 on CPU."""
    if not str(device).startswith("cuda"):
        return 128
    props = torch.cuda.get_device_properties(torch.device(device))
    return 1024 if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower() else 256


def kv_dtype_kwargs(kv_cache_dtype: str) -> dict:
    """The model's KV calls' dtype argument: none for "auto", so stand-in models without a cache
    dtype (tests' TableModel) keep working."""
    return {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}


def plan_kv_blocks(model, device: str, block_size: int, max_batch: int | None, max_len: int,
                   kv_blocks: int | None = None, kv_memory_bytes: int | None = None,
                   gpu_memory_utilization: float = 0.9, kv_cache_dtype: str = "auto") -> tuple[int, str]:
    """(number of KV blocks, how it was chosen). Explicit `kv_blocks` wins; else a byte budget:
    on CUDA, measured after the weights are loaded: `gpu_memory_utilization` x total memory minus what
    is already in use (weights, other processes), the rest of the GPU being the headroom for
    activations; on CPU `kv_memory_bytes` (default: enough for 2 x max_batch sequences of max_len,
    CPU_KV_SEQS without max_batch)."""
    per_block = model.kv_bytes_per_block(block_size, **kv_dtype_kwargs(kv_cache_dtype))  # fp8: half the bytes
    if kv_blocks:
        return kv_blocks, f"--kv-blocks {kv_blocks}"
    if str(device).startswith("cuda") and kv_memory_bytes is None:
        free, total = torch.cuda.mem_get_info(torch.device(device))
        budget = int(gpu_memory_utilization * total) - (total - free)
        how = (f"--gpu-memory-utilization {gpu_memory_utilization}: {budget / 2**30:.2f} GiB of {total / 2**30:.1f} GiB "
               f"({free / 2**30:.1f} GiB free after weights)")
    else:
        per_seq = math.ceil(max_len / block_size)
        seqs = 2 * max_batch if max_batch else CPU_KV_SEQS
        budget = kv_memory_bytes if kv_memory_bytes is not None else seqs * per_seq * per_block
        how = f"KV memory budget {budget / 2**20:.1f} MiB"
    return max(budget // per_block, 0), how


class Engine:
    """`max_batch` / `max_queue` None: sized from the KV cache and the device (kv_cache.running_limit,
    kv_cache.queue_limit, device_seq_ceiling)."""

    def __init__(self, model, device: str, max_batch: int | None, max_queue: int | None, max_len: int,
                 stop_ids: set[int],
                 metrics=None, max_prefill_tokens: int = 2048, cuda_graphs: bool = False, block_size: int = 16,
                 kv_blocks: int | None = None, kv_memory_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, prefix_caching: bool = True, kv_cache_dtype: str = "auto"):
        self.model, self.device = model, device
        self.max_prefill_tokens = max_prefill_tokens
        self.max_len = max_len
        self.stop_ids = stop_ids
        self.metrics = metrics
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.cv = threading.Condition()
        self.draining = False
        self.stopped = False
        self._ids = itertools.count(1)
        self.thread: threading.Thread | None = None
        self.prefill_computed = 0  # prompt tokens computed (prefix-cache hits are not)
        self.steps: deque[tuple[int, int]] = deque(maxlen=4096)  # (decode rows, prefill tokens) per step
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        n, how = plan_kv_blocks(model, device, block_size, max_batch, max_len, kv_blocks, kv_memory_bytes,
                                gpu_memory_utilization, kv_cache_dtype)
        per_seq = math.ceil(max_len / block_size)
        if n < per_seq:
            raise RuntimeFailure(f"KV cache too small: {how} gives {n} blocks of {block_size} tokens "
                                 f"({n * block_size} tokens), one sequence of --max-model-len {max_len} needs {per_seq}")
        self.kv = BlockManager(n, block_size, prefix_caching)
        self.max_batch = max_batch or running_limit(n, device_seq_ceiling(device))
        self.max_queue = max_queue or queue_limit(self.max_batch)
        log("scheduler", f"at most {self.max_batch} sequences running "
            f"({'--max-batch' if max_batch else f'from {n} KV blocks and the device'}), "
            f"{self.max_queue} waiting ({'--max-queue' if max_queue else 'default'})",
            max_batch=self.max_batch, max_queue=self.max_queue)
        self.scratch_block = n  # one block no sequence owns: CUDA-graph padding rows write there
        self.table_width = per_seq
        model.allocate_kv(n + 1, block_size, **kv_dtype_kwargs(kv_cache_dtype))
        nbytes = (n + 1) * model.kv_bytes_per_block(block_size, **kv_dtype_kwargs(kv_cache_dtype))
        log("kv_cache", f"{n} blocks x {block_size} tokens = {n * block_size} tokens, {nbytes / 2**20:.1f} MiB ({how}); "
            f"dtype {kv_cache_dtype}; prefix caching {'on' if prefix_caching else 'off'}", blocks=n,
            block_size=block_size, tokens=n * block_size, bytes=nbytes, kv_cache_dtype=kv_cache_dtype)
        if metrics:
            metrics.kv_blocks.set(n)
            metrics.kv_block_size.set(block_size)
            metrics.kv_bytes.set(nbytes)
        self.decoder = None
        if cuda_graphs and str(device).startswith("cuda"):
            from .cuda_graphs import GraphDecoder

            self.decoder = GraphDecoder(model, self.max_batch, max_len, self.table_width, self.scratch_block, device=device)

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
        m = self.metrics
        if m:
            m.queue_depth.set(len(self.waiting))
            m.running.set(len(self.running))
            m.kv_usage.set(self.kv.usage)
            m.prefix_hit_rate.set(self.kv.hit_rate)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopped and not self.waiting and not self.running:
                    self.cv.wait()
                if self.stopped:
                    return
            try:
                self.step()
            except Exception as e:  # a failing step must not kill the server: fail those requests
                log("engine_error", f"{type(e).__name__}: {e}")
                for r in list(self.running):
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
            with self.cv:
                self._gauges()
                self.cv.notify_all()

    def step(self) -> None:
        """One scheduler iteration: admit, decode the decoding rows, prefill chunks within the budget."""
        with self.cv:
            self._admit()
        for r in [r for r in self.running if r.cancelled]:
            self._finish(r, "cancelled")
        decode = self._reserve_decode([r for r in self.running if len(r.tokens) - r.computed == 1])
        if decode:
            self._decode_step(decode)
        budget = max(self.max_prefill_tokens - len(decode), self.block_size)
        chunks = []
        for r in self.running:
            left = len(r.tokens) - r.computed
            if left > 1 and r not in decode and budget > 0:
                n = min(left, budget)
                if r.needs_prompt_logprobs:  # its chunk's logits are all kept: [n, vocab] fp32 each
                    n = min(n, PROMPT_LOGPROBS_CHUNK)
                chunks.append((r, n))
                budget -= n
        if chunks:
            self._prefill(chunks)
        self.steps.append((len(decode), sum(n for _, n in chunks)))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            if r.cancelled:
                self.waiting.popleft()
                self._finish(r, "cancelled")
                continue
            reuse = not r.needs_prompt_logprobs
            if not self.kv.can_allocate(r.tokens, reuse):
                break  # waits for blocks to free up (finishing sequences), oldest first
            self.waiting.popleft()
            if r.scheduled_at is None:
                r.scheduled_at = time.time()
            q0, h0 = self.kv.queried_tokens, self.kv.hit_tokens
            r.blocks, r.computed = self.kv.allocate(r.tokens, reuse)
            if self.metrics:
                self.metrics.prefix_queries.inc(self.kv.queried_tokens - q0)
                self.metrics.prefix_hits.inc(self.kv.hit_tokens - h0)
                if not r.generated:
                    self.metrics.prompt_tokens.inc(len(r.prompt_ids))
            self.running.append(r)
        self._gauges()

    def _preempt(self, r: Request) -> None:
        self.kv.free_seq(r.blocks)
        r.blocks, r.computed = None, 0
        self.running.remove(r)
        with self.cv:
            self.waiting.appendleft(r)
        if self.metrics:
            self.metrics.preemptions.inc()
        log("preempt", f"request {r.id}: out of KV blocks, recomputed later ({len(r.tokens)} tokens)", request=r.id)

    def _reserve_decode(self, rows: list[Request]) -> list[Request]:
        """Each decoding row's block for its next token; the newest sequences are preempted for it."""
        out = []
        for r in rows:
            while r.blocks is not None:
                try:
                    self.kv.ensure(r.blocks, r.computed + 1)
                    out.append(r)
                    break
                except OutOfBlocks:
                    victim = self.running[-1]
                    if victim in out:  # only rows already served remain: this one waits
                        victim = r
                    self._preempt(victim)
                    if victim in out:
                        out.remove(victim)
        return out

    def _tables(self, reqs: list[Request]) -> torch.Tensor:
        bt = torch.full((len(reqs), self.table_width), self.scratch_block, dtype=torch.long)
        for i, r in enumerate(reqs):
            bt[i, : len(r.blocks.table)] = torch.tensor(r.blocks.table)
        return bt

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[tuple[int, Any]]:
        """logits fp32 [B, V] -> (next token, logprobs or None) per request (greedy at temperature 0)."""
        return sampling.sample(logits, reqs, self.stop_ids)

    def _prefill(self, chunks: list[tuple[Request, int]]) -> None:
        """The step's prefill chunks: one forward for those that need only their last logits, one
        (all positions' logits) for those computing prompt logprobs."""
        full = [c for c in chunks if c[0].needs_prompt_logprobs]
        last = [c for c in chunks if not c[0].needs_prompt_logprobs]
        if last:
            self._prefill_forward(last, False)
        if full:
            self._prefill_forward(full, True)

    def _prefill_forward(self, chunks: list[tuple[Request, int]], all_logits: bool) -> None:
        """One right-padded forward over every row's next chunk of tokens (positions computed..+n).

        Padding is harmless: a padded token sits at a position after its row's real tokens, so it
        is written either into the row's own last (private, partly filled) block, at a slot decoding
        overwrites before any query attends to it, or into the scratch block; no real token attends
        to it (causal mask)."""
        n = max(k for _, k in chunks)
        reqs = [r for r, _ in chunks]
        ids = torch.zeros(len(chunks), n, dtype=torch.long)
        pos = torch.zeros(len(chunks), n, dtype=torch.long)
        for i, (r, k) in enumerate(chunks):
            ids[i, :k] = torch.tensor(r.tokens[r.computed:r.computed + k])
            pos[i] = torch.arange(r.computed, r.computed + n).clamp(max=self.max_len - 1)
        last = torch.tensor([k - 1 for _, k in chunks])
        kv_len = max(r.computed + k for r, k in chunks)
        d = self.device
        if all_logits:  # [B, n, V]: the prompt logprobs of every chunk position, then each row's last
            every = self.model(ids.to(d), pos.to(d), self._tables(reqs).to(d), kv_len=kv_len)
            for i, (r, k) in enumerate(chunks):
                self._prompt_logprobs(r, every[i, :k])
            logits = every[torch.arange(len(chunks), device=every.device), last.to(every.device)]
        else:
            logits = self.model(ids.to(d), pos.to(d), self._tables(reqs).to(d), last_index=last.to(d),
                                kv_len=kv_len)[:, -1]
        done = []
        for i, (r, k) in enumerate(chunks):
            r.computed += k
            self.prefill_computed += k
            if self.metrics:
                self.metrics.prefill_computed.inc(k)
            self.kv.register(r.blocks, r.tokens, r.computed)
            if r.computed == len(r.tokens):
                done.append(i)
        if done:
            finished = [reqs[i] for i in done]
            for r, (tok, lp) in zip(finished, self._sample(logits[done], finished)):
                self._accept(r, tok, lp)

    def _prompt_logprobs(self, r: Request, logits: torch.Tensor) -> None:
        """logits [k, V] at positions computed..computed+k-1 of the chunk: each predicts the next
        prompt token; positions already scored (a recompute after preemption) are not scored again."""
        start = r.computed + 1  # the first target position
        have = len(r.prompt_logprobs) + 1  # targets 1..have-1 are scored
        first = max(start, have)
        end = min(r.computed + logits.shape[0], len(r.prompt_ids) - 1) + 1  # exclusive target bound
        if first < end:
            r.prompt_logprobs += sampling.prompt_logprobs(logits[first - start:end - start],
                                                          r.prompt_ids[first:end], r.params.prompt_logprobs)

    def _decode_step(self, reqs: list[Request]) -> None:
        d = self.device
        ids = torch.tensor([[r.tokens[r.computed]] for r in reqs], device=d)
        pos = torch.tensor([[r.computed] for r in reqs], device=d)
        bt = self._tables(reqs).to(d)
        if self.decoder is not None:
            try:
                logits = self.decoder(ids, pos, bt)[:, -1]
            except Exception as e:  # capture failed (e.g. a kernel that syncs): stay correct, run eager
                log("cuda_graph", f"disabled: {type(e).__name__}: {e}")
                self.decoder = None
                logits = self.model(ids, pos, bt, kv_len=max(r.computed for r in reqs) + 1)[:, -1]
        else:
            logits = self.model(ids, pos, bt, kv_len=max(r.computed for r in reqs) + 1)[:, -1]
        if self.metrics:
            self.metrics.decode_steps.inc()
        for r in reqs:
            r.computed += 1
            self.kv.register(r.blocks, r.tokens, r.computed)
        for r, (tok, lp) in zip(reqs, self._sample(logits, reqs)):
            self._accept(r, tok, lp)

    def _accept(self, r: Request, tok: int, lp: Any = None) -> None:
        now = time.time()
        if r.first_token_at is None:
            r.first_token_at = now
            if self.metrics:
                self.metrics.ttft.observe(r.first_token_at - r.created)
        elif self.metrics and r.last_token_at is not None:
            self.metrics.tpot.observe(now - r.last_token_at)
        r.last_token_at = now
        r.generated.append(tok)
        if self.metrics:
            self.metrics.generation_tokens.inc()
        # vLLM's order (vllm/v1/core/sched/utils.py check_stop, v0.11.0): the length cap first (an EOS
        # as the last allowed token is "length", decoded as text), then EOS, then stop_token_ids
        length = len(r.generated) >= r.params.max_tokens or len(r.tokens) >= self.max_len
        eos = not length and tok in self.stop_ids and not r.params.ignore_eos
        stop = eos or (not length and tok in r.params.stop_token_ids)
        if not stop:
            r.emit(tok if lp is None else lp)  # a sampling.Sampled when the client asked for logprobs
        elif lp is not None:  # not text, but its logprob is the client's (vLLM's output keeps the token)
            r.emit(dataclasses.replace(lp, stop=True))
        if stop:
            self._finish(r, "stop", stop_reason=None if eos else tok)
        elif length:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str, error: str | None = None, stop_reason: int | None = None) -> None:
        if r.done:
            return
        r.done = True
        if r in self.running:
            self.running.remove(r)
        if r.blocks is not None:
            self.kv.free_seq(r.blocks)
            r.blocks = None
        # the EOS / stop token counts, as in vLLM (its output token_ids keep it; only the text drops it)
        r.emit(Finished(reason, len(r.prompt_ids), len(r.generated), error, stop_reason))
        if self.metrics:
            self.metrics.latency.observe(time.time() - r.created)
            times = None
            if r.first_token_at is not None:
                s, f, last = r.scheduled_at, r.first_token_at, r.last_token_at
                times = (s - r.created, f - s, last - f, last - s)
            self.metrics.request_finished(reason, len(r.prompt_ids), len(r.generated), times)
