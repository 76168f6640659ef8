"""The MoE block of every architecture: router -> experts backend -> finalize (shared expert fused
when deferred) -> combine over the group. What the experts compute (the activation, expert biases)
is their backend's: the block only routes and combines.

Two paths, chosen once per model by the plan (`moe.deferredFinalize`):
- deferred: `experts.forward(..., defer_finalize=True)` returns (gemm2_out, weights, perm); the
  shared expert runs, and `moe_finalize_fuse_shared` adds the weighted routed rows, `routed_scale`
  and the shared output in one pass (sglang's fused finalize).
- plain: `experts.forward(...)` finalizes itself; the shared expert output is added afterwards.
`routed_scaling_factor` (grouped routing) is applied in the finalize (`routed_scale`), not in the router.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from moe_kernels.routing import grouped_topk, softmax_topk

from ...dist.combine import combine
from ...dist.layers import localize_expert_ids


@dataclass(frozen=True)
class RoutingConfig:
    # "grouped": sigmoid scores, grouped top-k with a correction bias (noaux_tc); "softmax": softmax
    # over all experts, then top-k; "topk_softmax": top-k of the logits, softmax over those k only
    kind: str
    top_k: int
    renormalize: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0


class MoEBlock(nn.Module):
    def __init__(self, gate_weight: torch.Tensor, bias: torch.Tensor | None, routing: RoutingConfig,
                 experts, shared: nn.Module | None, deferred: bool, group=None,
                 router_bias: torch.Tensor | None = None):
        """`bias`: the grouped router's score correction (kept fp32); `router_bias`: a bias of the
        router's linear itself (added to the logits in x's dtype)."""
        super().__init__()
        self.gate_weight = nn.Parameter(gate_weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.router_bias = None if router_bias is None else nn.Parameter(router_bias, requires_grad=False)
        self.routing, self.experts, self.shared, self.deferred = routing, experts, shared, deferred
        self.group = group  # moe_runtime.dist.group.Group (None: one process)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        if r.kind == "grouped":
            # grouped scores in fp32 (HF keeps that router in fp32 too)
            logits = F.linear(x.float(), self.gate_weight.float())
            return grouped_topk(logits, self.bias, r.top_k, r.n_group, r.topk_group,
                                        routed_scaling_factor=1.0, renormalize=r.renormalize)
        logits = F.linear(x, self.gate_weight, self.router_bias)
        if r.kind == "topk_softmax":
            top, ids = torch.topk(logits, r.top_k, dim=-1)
            return torch.softmax(top, dim=1, dtype=top.dtype), ids
        return softmax_topk(logits, r.top_k, r.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] in x's dtype. Under expert/tensor parallelism (moe_runtime.dist) this
        rank's experts see only the pairs routed to them (other ids -1) and the routed + shared partial
        sums are combined once over the world (dist.combine: all-reduce, or all-to-all for large batches)."""
        weights, ids = self.route(x)
        global_ids = ids
        ids = localize_expert_ids(ids, self.experts, self.group)
        scale = self.routing.routed_scale
        if self.deferred:
            d = self.experts.forward(x, weights, ids, routed_scale=scale, defer_finalize=True)
            shared = self.shared(x) if self.shared is not None else None
            return combine(d.finalize(shared).to(x.dtype), global_ids, self.experts, shared is not None, self.group)
        y = self.experts.forward(x, weights, ids, routed_scale=scale).to(x.dtype)
        if self.shared is not None:
            y = y + self.shared(x)
        return combine(y, global_ids, self.experts, self.shared is not None, self.group)
