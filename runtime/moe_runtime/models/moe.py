"""The MoE block: router -> experts backend -> finalize (shared expert fused when deferred).

Two paths, chosen once per model by the plan (`moe.deferredFinalize`):
- deferred: `experts.forward(..., defer_finalize=True)` returns (gemm2_out, weights, perm); the
  shared expert runs, and `moe_finalize_fuse_shared` adds the weighted routed rows, `routed_scale`
  and the shared output in one pass (sglang's fused finalize).
- plain: `experts.forward(...)` finalizes itself; the shared expert output is added afterwards.
`routed_scaling_factor` (DeepSeek) is applied in the finalize (`routed_scale`), not in the router.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from moe_kernels.routing import grouped_topk, softmax_topk

from .. import dispatch, parallel


@dataclass(frozen=True)
class RoutingConfig:
    kind: str  # "grouped" (DeepSeek noaux_tc) | "softmax" (Qwen3)
    top_k: int
    renormalize: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0


class MoEBlock(nn.Module):
    def __init__(self, gate_weight: torch.Tensor, bias: torch.Tensor | None, routing: RoutingConfig,
                 experts, shared: nn.Module | None, deferred: bool):
        super().__init__()
        self.gate_weight = nn.Parameter(gate_weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.routing, self.experts, self.shared, self.deferred = routing, experts, shared, deferred

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        if r.kind == "grouped":
            # DeepSeek scores in fp32 (HF keeps the router in fp32 too)
            logits = F.linear(x.float(), self.gate_weight.float())
            return grouped_topk(logits, self.bias, r.top_k, r.n_group, r.topk_group,
                                        routed_scaling_factor=1.0, renormalize=r.renormalize)
        logits = F.linear(x, self.gate_weight)
        return softmax_topk(logits, r.top_k, r.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] in x's dtype. Under expert/tensor parallelism (moe_runtime.parallel) this
        rank's experts see only the pairs routed to them (other ids -1) and the routed + shared partial
        sums are combined once over the world (moe_runtime.dispatch: all-reduce, or all-to-all for large batches)."""
        weights, ids = self.route(x)
        global_ids = ids
        ids = parallel.localize_expert_ids(ids, self.experts)
        scale = self.routing.routed_scale
        if self.deferred:
            d = self.experts.forward(x, weights, ids, routed_scale=scale, defer_finalize=True)
            shared = self.shared(x) if self.shared is not None else None
            return dispatch.combine(d.finalize(shared).to(x.dtype), global_ids, self.experts, shared is not None)
        y = self.experts.forward(x, weights, ids, routed_scale=scale).to(x.dtype)
        if self.shared is not None:
            y = y + self.shared(x)
        return dispatch.combine(y, global_ids, self.experts, self.shared is not None)
