"""Router top-k in torch (reference semantics; fast enough at the router's size on any device).

Both functions return (weights fp32 [T, k], ids int32 [T, k]) with slots ordered by decreasing
selection score.
"""

from __future__ import annotations

import torch


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, keep the top_k; optionally renormalise them to sum to 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def grouped_topk(router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor | None, top_k: int,
                 n_group: int, topk_group: int, routed_scaling_factor: float = 1.0,
                 renormalize: bool = True, scoring: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 `noaux_tc` routing (deepseek-ai/DeepSeek-V3 inference/model.py::Gate; HF
    DeepseekV3TopkRouter):

    scores = sigmoid(logits) (or softmax); the correction bias is added for *selection only*;
    group score = sum of the top-2 biased scores in the group (max when there is no bias, as in
    Gate); keep the best `topk_group` groups; pick `top_k` experts among them by biased score;
    weights = the *unbiased* scores of the picked experts, renormalised (if asked) and multiplied
    by `routed_scaling_factor`. Experts of dropped groups are masked to -inf (Gate; HF masks to 0,
    which differs only when every biased score in the kept groups is negative).
    """
    t, e = router_logits.shape
    if e % n_group:
        raise ValueError(f"{e} experts do not split into {n_group} groups")
    logits = router_logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
    elif scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"unknown scoring {scoring!r}")
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    grouped = choice.view(t, n_group, e // n_group)
    if e_score_correction_bias is None:
        group_scores = grouped.amax(dim=-1)
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    group_idx = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
    ids = masked.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)
