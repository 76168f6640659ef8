"""The parallel layers the models build on, each given the replica's `Group` (None: one process,
where every one of them is the plain layer): the row-parallel linear, the vocab-parallel embedding
and LM-head gather, and the global-to-local expert ids of expert parallelism."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .group import Group, all_reduce_attn, all_reduce_world, attn_replicated


class RowParallelLinear(nn.Module):
    """A linear over this rank's input-dimension slice, its output all-reduced over the attention
    group (`reduce` "attn") or the world ("world"); the plain linear without a process group. A bias
    (attention only) is added once: by the attention group's first rank, before the sum (every rank
    when attention is replicated)."""

    def __init__(self, weight: torch.Tensor, reduce: str, group: Group | None, bias: torch.Tensor | None = None):
        super().__init__()
        if bias is not None and reduce != "attn":
            raise ValueError("a row-parallel bias is added once per attention group: reduce 'attn' only")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.reduce, self.group = reduce, group
        self._adds_bias = group is None or group.layout.tp == 1 or group.layout.tp_rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias if self._adds_bias else None)
        return all_reduce_attn(y, self.group) if self.reduce == "attn" else all_reduce_world(y, self.group)


def embed(input_ids: torch.Tensor, weight: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Vocab-parallel embedding: this rank's rows [lo, lo + V/tp), others masked to zero, summed."""
    if attn_replicated(group):
        return F.embedding(input_ids, weight)
    lo = group.layout.tp_rank * weight.shape[0]
    local = input_ids - lo
    inside = (local >= 0) & (local < weight.shape[0])
    x = F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * inside[..., None].to(weight.dtype)
    return all_reduce_attn(x, group)


def gather_vocab(logits: torch.Tensor, group: Group | None) -> torch.Tensor:
    """LM head over this rank's vocab slice -> the full logits on every rank of the attention group."""
    if attn_replicated(group):
        return logits
    parts = [torch.empty_like(logits) for _ in range(group.layout.tp)]
    dist.all_gather(parts, logits.contiguous(), group=group.attn)
    return torch.cat(parts, dim=-1)


def num_local_experts(experts) -> int:
    """Experts on this rank: every backend keeps the ExpertWeights it was built from, or its E."""
    w = getattr(experts, "weights", None)
    if w is not None and hasattr(w, "num_experts"):
        return w.num_experts
    return int(getattr(experts, "E"))


def localize_expert_ids(ids: torch.Tensor, experts, group: Group | None) -> torch.Tensor:
    """Global expert ids -> this rank's local ids; experts on other ranks become -1 (skipped by the
    backends' alignment and by the finalize)."""
    if group is None or group.layout.ep == 1:
        return ids
    n = num_local_experts(experts)
    local = ids - group.layout.ep_rank * n
    return torch.where((local >= 0) & (local < n), local, torch.full_like(local, -1))
