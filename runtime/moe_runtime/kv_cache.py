"""Paged KV cache bookkeeping: fixed-size blocks, a block table per sequence, prefix reuse.

Only host-side state lives here (which block holds which tokens); the tensors are allocated by the
model (`CausalLM.allocate_kv`) as [num_blocks, block_size, ...] per layer, and attention reads them
through the block tables (moe_kernels.paged_attention).

- A sequence's token t lives in block `table[t // block_size]`, row `t % block_size`.
- Blocks are reference counted; a finished (or preempted) sequence drops its references.
- Prefix reuse: a *full* block whose KV has been computed is registered under
  hash(hash of the preceding block, its tokens), so equal hashes mean equal whole prefixes. A new
  prompt walks its full blocks from the start and takes every registered match (its ref count goes
  up; no compute), stopping at the first miss. The last prompt token is always computed (its logits
  are needed), so at most len(prompt) - 1 tokens come from the cache.
- Unreferenced blocks stay registered until their memory is needed: the free list is an LRU
  (blocks join its tail when their last reference goes, fresh allocations take its head, a hit
  takes the block back out), so the least recently used cached prefix is evicted first.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


def block_hash(prev: int, tokens) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(prev.to_bytes(8, "little", signed=True))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass
class Block:
    id: int
    ref: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()


@dataclass
class SeqBlocks:
    """One sequence's blocks: `table` (block ids in order) and how many leading full blocks are
    registered in the prefix cache (`registered`), with the hash of the last of them."""
    table: list[int] = field(default_factory=list)
    registered: int = 0
    last_hash: int = -1


class OutOfBlocks(Exception):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size, self.num_blocks, self.prefix_caching = block_size, num_blocks, prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU: head = oldest
        self.cached: dict[int, int] = {}  # hash -> block id
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which served from it

    # ---------------------------------------------------------------- capacity
    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a sequence (cached-but-free blocks count as free)."""
        return 1 - len(self.free) / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    # ---------------------------------------------------------------- allocation
    def _take_fresh(self) -> int:
        if not self.free:
            raise OutOfBlocks()
        bid, _ = self.free.popitem(last=False)
        b = self.blocks[bid]
        if b.hash is not None and self.cached.get(b.hash) == bid:  # evict its prefix entry
            del self.cached[b.hash]
        b.hash, b.tokens, b.ref = None, (), 1
        return bid

    def _ref(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref == 0:
            self.free.pop(bid)
        b.ref += 1

    def match_prefix(self, tokens: list[int], reuse: bool = True) -> list[int]:
        """Registered blocks covering the longest cached prefix of tokens[:-1] (read-only). `reuse`
        False: none (a request that needs every prompt position's logits: prompt logprobs)."""
        if not self.prefix_caching or not reuse:
            return []
        bs, out, prev = self.block_size, [], -1
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(prev, chunk)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].tokens != chunk:
                break
            out.append(bid)
            prev = h
        return out

    def can_allocate(self, tokens: list[int], reuse: bool = True) -> bool:
        hits = self.match_prefix(tokens, reuse)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref == 0)  # hits taken out of the free list
        return self.blocks_for(len(tokens)) - len(hits) <= self.num_free - reclaimed

    def allocate(self, tokens: list[int], reuse: bool = True) -> tuple[SeqBlocks, int]:
        """Blocks for all of `tokens` (a prompt): reused prefix blocks (unless not `reuse`) + fresh
        ones. Returns the sequence's blocks and how many leading tokens are already computed (cached)."""
        if not self.can_allocate(tokens, reuse):
            raise OutOfBlocks()
        hits = self.match_prefix(tokens, reuse)
        for b in hits:
            self._ref(b)
        seq = SeqBlocks(list(hits), len(hits), self.blocks[hits[-1]].hash if hits else -1)
        for _ in range(self.blocks_for(len(tokens)) - len(hits)):
            seq.table.append(self._take_fresh())
        n_cached = len(hits) * self.block_size
        self.queried_tokens += len(tokens)
        self.hit_tokens += n_cached
        return seq, n_cached

    def ensure(self, seq: SeqBlocks, n_tokens: int) -> None:
        """Grow the table to hold n_tokens (decode appends); raises OutOfBlocks."""
        need = self.blocks_for(n_tokens) - len(seq.table)
        if need > self.num_free:
            raise OutOfBlocks()
        for _ in range(need):
            seq.table.append(self._take_fresh())

    def register(self, seq: SeqBlocks, tokens: list[int], n_computed: int) -> None:
        """Publish the full blocks whose KV is now computed (tokens[:n_computed]) for prefix reuse."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        while seq.registered < n_computed // bs:
            i = seq.registered
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(seq.last_hash, chunk)
            b = self.blocks[seq.table[i]]
            if h not in self.cached:  # an equal block computed by another sequence stays the cached one
                b.hash, b.tokens = h, chunk
                self.cached[h] = b.id
            seq.registered, seq.last_hash = i + 1, h

    def free_seq(self, seq: SeqBlocks) -> None:
        """Drop the sequence's references; last blocks first, so its tail is evicted before its prefix."""
        for bid in reversed(seq.table):
            b = self.blocks[bid]
            b.ref -= 1
            if b.ref == 0:
                if b.hash is None:
                    self.free[bid] = None
                    self.free.move_to_end(bid, last=False)  # nothing to keep: reuse these first
                else:
                    self.free[bid] = None
        seq.table.clear()
        seq.registered, seq.last_hash = 0, -1


def running_limit(num_blocks: int, ceiling: int) -> int:
    """Default most sequences running at once over `num_blocks` KV blocks: every running sequence
    writes its next token into a block of its own, so more than `num_blocks` can never decode
    together (sglang bounds it by KV tokens // 2: kv_cache_configurator.py
    KVCacheConfigurator.resolve_max_num_reqs, 0.5.23), and at most `ceiling`, the device's batch
    bound (engine.device_seq_ceiling)."""
    return max(1, min(num_blocks, ceiling))


def queue_limit(max_running: int) -> int:
    """Default waiting requests before 429: a burst of many times the running set waits instead of
    being refused (vLLM's waiting queue has no bound at all; a bound still keeps a flood finite)."""
    return max(1024, 8 * max_running)
