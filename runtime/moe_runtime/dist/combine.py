"""The MoE combine: how the routed experts' outputs come back to every rank under expert/tensor parallelism.

In the bundled runtime's layout (moe_runtime.dist) the MoE block's input is replicated: every rank
holds every token after the attention all-reduce, and every rank computes the same routing. So the
dispatch itself moves no bytes: each rank takes, from its own copy, the (token, expert) pairs whose
expert it holds, which is exactly what an all-to-all dispatch from the tokens' owners would deliver
(rows and their routing). What has to travel is the combine: the per-rank partial sums (routed experts
on this rank + this rank's slice of the shared expert) must be summed per token, and every rank needs
the sum. Two ways, chosen per batch by `choose()`:

- "allgather" (the all-gather + reduce kind the issue names for small batches): one all-reduce over the
  world of the [T, H] partials, in fp32 (group.all_reduce_world), one collective.
- "alltoall": token t is owned by rank t // ceil(T/W). One `torch.distributed.all_to_all_single` sends
  each owner the rows of its tokens (in the activation dtype): with a shared expert every row (each rank
  holds a slice of it: a reduce-scatter carried by the all-to-all); without one only the rows of tokens
  that have an expert on the sending rank (the rows an expert rank returns to the token owner). The owner
  sums them in fp32 (the same "bf16 partials summed once in fp32" as the all-reduce), rounds, and one
  `all_gather_into_tensor` gives every rank the result. Two collectives, fewer bytes.

The choice is a pure function of (tokens, hidden, top_k, world, shared expert, activation bytes) with an
alpha-beta cost model (`choose`), identical on every rank (all inputs are), so every rank takes the same
collectives. `MOE_EP_DISPATCH=allgather|alltoall` forces one (tests, measurements); `auto` (default)
chooses.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..log import log
from .group import Group, all_reduce_world
from .layers import num_local_experts

# alpha: latency of one NCCL collective inside an NVLink node (launch + protocol), ~10-25 us measured by
# nccl-tests at small sizes on H100/H200; beta: the per-rank bandwidth a large all-reduce / all-to-all
# reaches there (~300 GB/s busbw of ~450 GB/s NVLink 4 per direction). Across nodes (LeaderWorkerSet,
# ~50 GB/s per GPU over InfiniBand) both the latency and the byte cost grow; the threshold below scales
# as alpha * beta, which stays within a factor ~2 of the in-node value, so one set of constants is used.
ALPHA_S = 20e-6
BETA_BYTES_S = 300e9
MODES = ("allgather", "alltoall")


@dataclass(frozen=True)
class Choice:
    mode: str  # "none" (one rank) | "allgather" | "alltoall"
    threshold: float  # tokens from which all-to-all is cheaper (inf: never)
    reason: str


def _hit_probability(top_k: int, groups: int) -> float:
    """P(a token has at least one of its top_k experts in a given expert-parallel group), uniform routing."""
    return 1.0 - (1.0 - 1.0 / groups) ** top_k


def bytes_per_token(hidden: int, top_k: int, world: int, ep: int, shared: bool, act_bytes: int) -> tuple[float, float]:
    """(all-reduce, all-to-all + all-gather) bytes each rank sends per token of the batch.
    All-reduce: a ring moves 2(W-1)/W of the fp32 tensor. All-to-all: (W-1)/W of the rows go to other
    owners, all of them with a shared expert, else the fraction with an expert on this rank; all-gather:
    (W-1)/W of the output, both in the activation dtype."""
    f = (world - 1) / world
    allreduce = 2 * f * 4 * hidden
    rows = 1.0 if shared else _hit_probability(top_k, ep)
    alltoall = f * rows * act_bytes * hidden + f * act_bytes * hidden
    return allreduce, alltoall


def choose(tokens: int, hidden: int, top_k: int, world: int, ep: int, shared: bool, act_bytes: int = 2,
           alpha: float = ALPHA_S, beta: float = BETA_BYTES_S) -> Choice:
    """The combine for a batch of `tokens`. Cost = collectives x alpha + bytes / beta: the all-to-all
    path has one collective more (alpha) and fewer bytes per token when the activations are narrower than
    fp32; it wins from threshold = alpha x beta / (bytes saved per token). DeepSeek-V3 (H 7168, shared
    expert) on 8 ranks in bf16: 7.0 vs 3.5 bytes per element, 25 KB saved per token, threshold 240
    tokens: decode batches all-reduce, prefill chunks all-to-all. Qwen3-235B (H 4096, top-8 of 128, no
    shared expert) on 8 ranks: 357 tokens. fp32 activations (exact mode): never (the same bytes)."""
    if world <= 1:
        return Choice("none", math.inf, "one rank: no combine")
    ar, a2a = bytes_per_token(hidden, top_k, world, ep, shared, act_bytes)
    saved = ar - a2a
    threshold = alpha * beta / saved if saved > 0 else math.inf
    mode = "alltoall" if tokens >= threshold else "allgather"
    why = (f"{tokens} tokens, {world} ranks: all-reduce {ar / hidden:.2f} B/element in 1 collective vs all-to-all + "
           f"all-gather {a2a / hidden:.2f} B/element in 2; "
           + (f"all-to-all from {threshold:.0f} tokens" if saved > 0 else "all-to-all never (no bytes saved)")
           + f" (alpha {alpha * 1e6:.0f} us, beta {beta / 1e9:.0f} GB/s)")
    return Choice(mode, threshold, why)


_logged: set[str] = set()


def combine(y: torch.Tensor, ids: torch.Tensor, experts, shared: bool, group: Group | None,
            top_k: int | None = None) -> torch.Tensor:
    """Sum this rank's MoE partial `y` [T, H] (routed experts on this rank + its slice of the shared expert,
    x's dtype) over the world; every rank gets the sum. `ids` [T, K]: the global expert ids (the same on
    every rank). Without a process group: y."""
    g = group
    if g is None or g.layout.world == 1:
        return y
    lay = g.layout
    forced = os.environ.get("MOE_EP_DISPATCH", "auto")
    c = choose(y.shape[0], y.shape[1], top_k or ids.shape[-1], lay.world, lay.ep, shared, y.element_size())
    mode = forced if forced in MODES else c.mode
    if mode not in _logged:
        _logged.add(mode)
        log("dispatch", f"rank {lay.rank}: MoE combine {mode}" + (f" (MOE_EP_DISPATCH={forced})" if forced in MODES
                                                                  else f": {c.reason}"), rank=lay.rank, mode=mode)
    if mode == "allgather":
        return all_reduce_world(y, g)
    hit = None if shared else _rank_hits(ids, experts, lay)
    return combine_alltoall(y, hit, g.world_pg)


def _rank_hits(ids: torch.Tensor, experts, lay) -> torch.Tensor:
    """[T, W] bool: token t has at least one expert on rank r (the experts of r's expert-parallel group)."""
    n = num_local_experts(experts)
    groups = (ids // n).clamp(0, lay.ep - 1)
    hit = torch.zeros(ids.shape[0], lay.ep, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, groups, True)
    return hit.repeat_interleave(lay.etp, dim=1)


def combine_alltoall(y: torch.Tensor, hit: torch.Tensor | None, group=None) -> torch.Tensor:
    """The all-to-all combine. Token t belongs to rank t // chunk (chunk = ceil(T / W), the batch padded
    to W x chunk rows). hit None: every rank sends each owner all its rows of the owner's tokens (a
    reduce-scatter by all-to-all); else only rows t with hit[t, this rank] (the others are zero: no expert
    of this rank was routed to). The owner sums in fp32, rounds to y's dtype, and all_gather_into_tensor
    returns the [T, H] sum to every rank (bit-identical on all ranks: each token is summed once)."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    T, H = y.shape
    chunk = -(-T // W)
    pad = chunk * W - T
    yp = torch.cat([y, y.new_zeros(pad, H)]) if pad else y
    yp = yp.contiguous()
    if hit is None:
        recv = torch.empty_like(yp)
        dist.all_to_all_single(recv, yp, group=group)
        own = recv.view(W, chunk, H).float().sum(0)
    else:
        hitp = torch.cat([hit, hit.new_zeros(pad, W)]) if pad else hit
        send_rows = hitp[:, r]
        in_splits = send_rows.view(W, chunk).sum(1).tolist()
        mine = hitp[r * chunk:(r + 1) * chunk]  # [chunk, W]: which rank sends which of my tokens
        out_splits = mine.sum(0).tolist()
        recv = y.new_empty(sum(out_splits), H)
        dist.all_to_all_single(recv, yp[send_rows].contiguous(), out_splits, in_splits, group=group)
        order = torch.cat([mine[:, s].nonzero().flatten() for s in range(W)])
        own = torch.zeros(chunk, H, dtype=torch.float32, device=y.device)
        own.index_add_(0, order, recv.float())
    out = torch.empty_like(yp)
    dist.all_gather_into_tensor(out, own.to(y.dtype).contiguous(), group=group)
    return out[:T]
