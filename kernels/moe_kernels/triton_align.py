"""Sort (token, slot) pairs by expert and pad each expert's rows to a multiple of BLOCK_M.

Two small launches and no host synchronisation (CUDA-graph safe):
1. one program counts rows per expert, writes each expert's padded start (also as the atomic
   cursor), the expert of every BLOCK_M row block, the padded total, and fills the row map with a
   sentinel;
2. a grid over chunks of SCATTER_BLOCK pairs gives each pair the next row of its expert: the
   count kernel stored, per chunk, how many rows each expert got from earlier chunks, and a pair's
   rank among its chunk's pairs of the same expert does the rest.
Rows inside an expert are therefore in pair order, deterministically (no atomics): with align_split
an expert's last pairs go to tail blocks, computed by another kernel, and which ones must not change
between runs, or results would differ in the last bit from run to run.

`align_mixed` (fragment kernel, ~8 rows per expert) gives each expert either 16-row blocks (more
than 8 rows) or a single 8-row block, in one row space: the 16-row blocks first, then the 8-row ones.

`align_split` (large batches, tl.dot tiles of BIG rows) gives each expert the BIG-row blocks its
rows fill, and puts a remainder of at most TAIL_MAX rows into 16-row *tail* blocks (fragment kernel)
after them, instead of one more BIG-row block that is mostly padding: at ~128 rows per expert
(4096 tokens, top-8 of 256) about half the experts have a few rows more than 128, and a second
128-row tile costs as much as the first.

Buffers are sized for the worst case on the host, from T*K, E and BLOCK_M only:
blocks = sum_e ceil(c_e / BLOCK_M) <= m + (T*K - m) // BLOCK_M with m = min(E, T*K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class Alignment:
    sorted_ids: torch.Tensor      # int32 [P_max]: flat pair index t*K+k per padded row; num_pairs = padding
    expert_ids: torch.Tensor      # int32 [max_blocks]: expert of each BLOCK_M block (>= E past the end)
    num_post_pad: torch.Tensor    # int32 [1]: rows in use (multiple of BLOCK_M)
    perm: torch.Tensor            # int32 [T*K]: padded row of each pair, -1 when its id is not in [0, E)
    block_m: int
    max_blocks: int
    pairwise: bool = False        # fragment kernel only: block i = pair i, expert_ids = the flat topk_ids
    row_start: bool = False       # num_post_pad holds [end, start]: the blocks' rows begin at start

    @property
    def p_max(self) -> int:
        return self.max_blocks * self.block_m


@dataclass
class MixedAlignment:
    """Two block sizes in one row space, `big` blocks at rows [0, Rb), `small` ones at [Rb, Rb + Rs).
    align_mixed (fragment kernel): experts with more than SMALL_M rows get 16-row blocks, the others
    one SMALL_M-row block each; align_split: big tl.dot blocks and 16-row tail blocks.
    Both share sorted_ids and perm; finalize reads rows through perm as usual."""
    big: Alignment
    small: Alignment
    perm: torch.Tensor
    p_max: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    m = min(num_experts, num_pairs)
    return max(1, m + (num_pairs - m) // block_m)


SCATTER_BLOCK = 128   # pairs per scatter program (its rank computation is a [B, B] compare)
_SCATTER_BLOCK = tl.constexpr(SCATTER_BLOCK)


@triton.jit
def _expert_counts(ids_ptr, num_pairs, E, chunk_ptr, E_P2: tl.constexpr):
    """Rows per expert ([E_P2], zero past E). chunk_ptr[c, :] gets the rows per expert of the pairs
    before chunk c (SCATTER_BLOCK pairs per chunk): the scatter kernel's offsets."""
    CHUNK: tl.constexpr = _SCATTER_BLOCK
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        tl.store(chunk_ptr + (start // CHUNK) * E_P2 + tl.arange(0, E_P2), counts)
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        # Out-of-range ids (other ranks' experts, and the tail) go to the spare bin E_P2-1 >= E.
        e = tl.where((e >= 0) & (e < E), e, E_P2 - 1)
        counts += tl.histogram(e, E_P2)
    return tl.where(tl.arange(0, E_P2) < E, counts, 0)


@triton.jit
def _block_experts(ends, E, first_row, expert_ids_ptr, MAX_BLOCKS, BLOCK_M: tl.constexpr, E_P2: tl.constexpr,
                   CHUNK: tl.constexpr):
    """Expert of each BLOCK_M-row block starting at first_row = number of experts whose padded range
    (empty ones included) ends at or before the block's first row (E past the end)."""
    ends = tl.where(tl.arange(0, E_P2) < E, ends, 2147483647)
    for b0 in range(0, MAX_BLOCKS, CHUNK):
        blk = b0 + tl.arange(0, CHUNK)
        eid = tl.sum((ends[None, :] <= first_row + blk[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, eid, mask=blk < MAX_BLOCKS)


@triton.jit
def _fill_padding(sorted_ids_ptr, num_pairs, P_MAX, CHUNK: tl.constexpr):
    """Every row starts as padding (sorted id num_pairs); the scatter kernel claims the used ones."""
    for r0 in range(0, P_MAX, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + rows, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=rows < P_MAX)


@triton.jit
def _count_kernel(ids_ptr, chunk_ptr, num_pairs, E, cursor_ptr, expert_ids_ptr, num_post_pad_ptr, sorted_ids_ptr,
                  MAX_BLOCKS, P_MAX, BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    bins = tl.arange(0, E_P2)
    counts = _expert_counts(ids_ptr, num_pairs, E, chunk_ptr, E_P2)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(cursor_ptr + bins, starts, mask=bins < E)
    total = tl.sum(padded, 0)
    tl.store(num_post_pad_ptr, total)
    _block_experts(ends, E, 0, expert_ids_ptr, MAX_BLOCKS, BLOCK_M, E_P2, CHUNK)
    _fill_padding(sorted_ids_ptr, num_pairs, P_MAX, CHUNK)


@triton.jit
def _scatter_kernel(ids_ptr, chunk_ptr, num_pairs, E, cursor_ptr, sorted_ids_ptr, perm_ptr, E_P2: tl.constexpr,
                    BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """Pair i of chunk c gets row cursor[e] + chunk_ptr[c, e] + (its rank among the chunk's pairs of
    expert e). SPLIT: cursor_ptr holds [3, E]: the first row, the end of the expert's big rows, and
    the first row of its tail blocks; rows past the big ones continue in the tail."""
    c = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    offs = c * BLOCK + i
    inb = offs < num_pairs
    e = tl.load(ids_ptr + offs, mask=inb, other=-1)
    valid = inb & (e >= 0) & (e < E)
    rank = tl.sum(((e[None, :] == e[:, None]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    es = tl.where(valid, e, 0)
    row = tl.load(cursor_ptr + es, mask=valid, other=0) + tl.load(chunk_ptr + c * E_P2 + es, mask=valid, other=0) + rank
    if SPLIT:
        big_end = tl.load(cursor_ptr + E + es, mask=valid, other=0)
        tail = tl.load(cursor_ptr + 2 * E + es, mask=valid, other=0)
        row = tl.where(row >= big_end, tail + (row - big_end), row)
    tl.store(sorted_ids_ptr + row, offs, mask=valid)
    tl.store(perm_ptr + offs, tl.where(valid, row, -1), mask=inb)


SMALL_M = 8     # rows of a small block (mixed alignment), one per expert with 1..SMALL_M rows
BIG_M = 16      # rows of a big block


@triton.jit
def _two_part_blocks(end_big, tot_big, end_small, tot_small, E, bounds_ptr, expert_ids_ptr, sorted_ids_ptr, num_pairs,
                     MAX_BIG, MAX_SMALL, P_MAX, BIG: tl.constexpr, SMALL: tl.constexpr, E_P2: tl.constexpr,
                     CHUNK: tl.constexpr):
    """Bounds ([end, start] of the big blocks' rows, then of the small ones', which follow), the expert
    of every block of both parts, and the padding fill, for a MixedAlignment."""
    tl.store(bounds_ptr, tot_big)
    tl.store(bounds_ptr + 1, 0)
    tl.store(bounds_ptr + 2, tot_big + tot_small)
    tl.store(bounds_ptr + 3, tot_big)
    _block_experts(end_big, E, 0, expert_ids_ptr, MAX_BIG, BIG, E_P2, CHUNK)
    _block_experts(end_small, E, tot_big, expert_ids_ptr + MAX_BIG, MAX_SMALL, SMALL, E_P2, CHUNK)
    _fill_padding(sorted_ids_ptr, num_pairs, P_MAX, CHUNK)


@triton.jit
def _count_mixed_kernel(ids_ptr, chunk_ptr, num_pairs, E, cursor_ptr, expert_ids_ptr, bounds_ptr, sorted_ids_ptr,
                        MAX_BIG, MAX_SMALL, P_MAX, SMALL: tl.constexpr, BIG: tl.constexpr,
                        E_P2: tl.constexpr, CHUNK: tl.constexpr):
    bins = tl.arange(0, E_P2)
    counts = _expert_counts(ids_ptr, num_pairs, E, chunk_ptr, E_P2)
    big = counts > SMALL
    pad_big = tl.where(big, (counts + BIG - 1) // BIG * BIG, 0)
    pad_small = tl.where(big | (counts == 0), 0, SMALL)
    end_big = tl.cumsum(pad_big, 0)
    tot_big = tl.sum(pad_big, 0)
    end_small = tot_big + tl.cumsum(pad_small, 0)
    tot_small = tl.sum(pad_small, 0)
    tl.store(cursor_ptr + bins, tl.where(big, end_big - pad_big, end_small - pad_small), mask=bins < E)
    _two_part_blocks(end_big, tot_big, end_small, tot_small, E, bounds_ptr, expert_ids_ptr, sorted_ids_ptr, num_pairs,
                     MAX_BIG, MAX_SMALL, P_MAX, BIG, SMALL, E_P2, CHUNK)


TAIL_M = 16    # rows of a tail block (align_split)


@triton.jit
def _count_split_kernel(ids_ptr, chunk_ptr, num_pairs, E, meta_ptr, expert_ids_ptr, bounds_ptr, sorted_ids_ptr,
                        MAX_BIG, MAX_TAIL, P_MAX, TAIL_MAX, BIG: tl.constexpr, TAIL: tl.constexpr,
                        E_P2: tl.constexpr, CHUNK: tl.constexpr):
    bins = tl.arange(0, E_P2)
    counts = _expert_counts(ids_ptr, num_pairs, E, chunk_ptr, E_P2)
    full = counts // BIG
    rest = counts - full * BIG
    over = rest > TAIL_MAX            # too many for tail blocks: one more (partly padded) big block
    pad_big = (full + over.to(tl.int32)) * BIG
    pad_tail = tl.where(over, 0, (rest + TAIL - 1) // TAIL * TAIL)
    end_big = tl.cumsum(pad_big, 0)
    tot_big = tl.sum(pad_big, 0)
    end_tail = tot_big + tl.cumsum(pad_tail, 0)
    tot_tail = tl.sum(pad_tail, 0)
    m = bins < E
    tl.store(meta_ptr + bins, end_big - pad_big, mask=m)
    # claims past this row go to the tail (with `over`, all of an expert's rows fit in its big blocks)
    tl.store(meta_ptr + E + bins, tl.where(over, end_big, end_big - pad_big + full * BIG), mask=m)
    tl.store(meta_ptr + 2 * E + bins, end_tail - pad_tail, mask=m)
    _two_part_blocks(end_big, tot_big, end_tail, tot_tail, E, bounds_ptr, expert_ids_ptr, sorted_ids_ptr, num_pairs,
                     MAX_BIG, MAX_TAIL, P_MAX, BIG, TAIL, E_P2, CHUNK)


def _bins(num_experts: int) -> tuple[int, int]:
    """(E_P2, CHUNK) of the count kernels: a spare bin past E, and the [CHUNK, E_P2] block compare
    kept in registers."""
    e_p2 = triton.next_power_of_2(num_experts + 1)
    return e_p2, max(16, min(1024, 65536 // e_p2))


def _chunk_counts(n: int, e_p2: int, device) -> torch.Tensor:
    """The count kernel's per-chunk expert offsets for the scatter kernel ([chunks, E_P2] int32)."""
    return torch.empty(max(1, triton.cdiv(n, SCATTER_BLOCK)), e_p2, dtype=torch.int32, device=device)


def _scatter(ids: torch.Tensor, chunks: torch.Tensor, num_experts: int, cursor, sorted_ids, perm,
             split: bool = False) -> None:
    """Each pair gets the next row of its expert, in pair order (cursor = the expert's first row)."""
    n = ids.numel()
    if n:
        _scatter_kernel[(triton.cdiv(n, SCATTER_BLOCK),)](ids, chunks, n, num_experts, cursor, sorted_ids, perm,
                                                          E_P2=chunks.shape[1], BLOCK=SCATTER_BLOCK, SPLIT=split,
                                                          num_warps=4)


def _two_part(ids: torch.Tensor, num_experts: int, count_kernel, cursor_words: int, big_m: int, max_big: int,
              small_m: int, max_small: int, split: bool, *extra, **consts) -> MixedAlignment:
    """Buffers, count kernel and scatter of a MixedAlignment (big blocks first, then small ones)."""
    n = ids.numel()
    dev = ids.device
    p_max = big_m * max_big + small_m * max_small
    cursor = torch.empty(cursor_words, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_big + max_small, dtype=torch.int32, device=dev)
    bounds = torch.empty(4, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(p_max, dtype=torch.int32, device=dev)
    perm = torch.empty(n, dtype=torch.int32, device=dev)
    e_p2, chunk = _bins(num_experts)
    chunks = _chunk_counts(n, e_p2, dev)
    count_kernel[(1,)](ids, chunks, n, num_experts, cursor, expert_ids, bounds, sorted_ids, max_big, max_small, p_max,
                       *extra, E_P2=e_p2, CHUNK=chunk, num_warps=8, **consts)
    _scatter(ids, chunks, num_experts, cursor, sorted_ids, perm, split=split)
    big = Alignment(sorted_ids, expert_ids[:max_big], bounds[0:2], perm, big_m, max_big)
    small = Alignment(sorted_ids, expert_ids[max_big:], bounds[2:4], perm, small_m, max_small, row_start=True)
    return MixedAlignment(big, small, perm, p_max)


def align_mixed(topk_ids: torch.Tensor, num_experts: int) -> MixedAlignment:
    """Like align_by_expert, with SMALL_M-row blocks for experts that fit in one and BIG_M-row blocks
    for the rest (~8 rows per expert: 59% of experts fit; the others are not split in two)."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n = ids.numel()
    m = min(num_experts, n)
    # big experts have > SMALL_M rows each: at most n // (SMALL_M + 1) of them, ceil(c / BIG_M) blocks each
    max_big = max(1, min(max_blocks(n, num_experts, BIG_M), min(m, n // (SMALL_M + 1)) + n // BIG_M))
    return _two_part(ids, num_experts, _count_mixed_kernel, num_experts, BIG_M, max_big, SMALL_M, max(1, m), False,
                     SMALL=SMALL_M, BIG=BIG_M)


def align_split(topk_ids: torch.Tensor, num_experts: int, big_m: int, tail_max: int) -> MixedAlignment:
    """Big-row blocks for the rows that fill them, 16-row tail blocks for a remainder of at most
    tail_max rows (more: one more big block), in one row space: big blocks first. `big` is for the
    tl.dot kernel (reads num_post_pad[0] only: its rows start at 0), `small` for the fragment kernel."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n = ids.numel()
    m = min(num_experts, n)
    # a tail holds <= tail_max rows, at most one per pair
    max_tail = max(1, min(m * triton.cdiv(max(tail_max, 1), TAIL_M), max_blocks(n, num_experts, TAIL_M)))
    # cursor: [first row, end of the big rows, first tail row] per expert (see _scatter_kernel)
    return _two_part(ids, num_experts, _count_split_kernel, 3 * num_experts, big_m, max_blocks(n, num_experts, big_m),
                     TAIL_M, max_tail, True, tail_max, BIG=big_m, TAIL=TAIL_M)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n = ids.numel()
    dev = ids.device
    nb = max_blocks(n, num_experts, block_m)
    p_max = nb * block_m
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(nb, dtype=torch.int32, device=dev)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(p_max, dtype=torch.int32, device=dev)
    perm = torch.empty(n, dtype=torch.int32, device=dev)
    e_p2, chunk = _bins(num_experts)
    chunks = _chunk_counts(n, e_p2, dev)
    _count_kernel[(1,)](ids, chunks, n, num_experts, cursor, expert_ids, num_post_pad, sorted_ids, nb, p_max,
                        BLOCK_M=block_m, E_P2=e_p2, CHUNK=chunk, num_warps=8)
    _scatter(ids, chunks, num_experts, cursor, sorted_ids, perm)
    return Alignment(sorted_ids, expert_ids, num_post_pad, perm, block_m, nb)
