"""Next-token selection for a decode batch: penalties, temperature, top-k / top-p / min-p, seeded
sampling, stop-token masking for `min_tokens`, and the logprobs a client asked for.

Order (as vLLM and HF apply them): repetition penalty (prompt + output, HF's divide/multiply rule),
frequency/presence penalties (output tokens, OpenAI's subtractive rule), the `min_tokens` mask of
stop tokens, then temperature 0 = greedy, else softmax(logits / T) filtered by top-k, top-p, min-p
and sampled. Logprobs are those of the model's raw distribution (log_softmax of the logits before
any of the above), like OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Sampled:
    """One token with its logprob and the `k` most likely alternatives (token id, logprob): a chosen
    token, or a prompt token (`prompt_logprobs`, with its vocabulary `rank`). `stop`: the EOS / stop
    token that ended the output; not text, but its logprob is reported, as vLLM reports it."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None
    stop: bool = False


def _plain(p) -> bool:
    return (p.temperature <= 0 and p.repetition_penalty == 1.0 and not p.frequency_penalty
            and not p.presence_penalty and p.logprobs is None and not p.min_tokens)


def penalize(logits: torch.Tensor, p, prompt_ids: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """logits [V] fp32 -> penalized copy (or the same tensor when no penalty applies)."""
    if p.repetition_penalty != 1.0 and (prompt_ids or generated):
        seen = torch.tensor(list(prompt_ids) + list(generated), dtype=torch.long, device=logits.device).unique()
        vals = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and generated:
        out = torch.tensor(list(generated), dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def mask_stops(logits: torch.Tensor, p, n_generated: int, stop_ids: set[int]) -> torch.Tensor:
    """Before `min_tokens` tokens exist, EOS (unless ignore_eos) and `stop_token_ids` cannot be picked."""
    if n_generated >= p.min_tokens:
        return logits
    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(stop_ids))
    ids = [i for i in ids if 0 <= i < logits.shape[-1]]
    if not ids:
        return logits
    logits = logits.clone()
    logits[ids] = float("-inf")
    return logits


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """probs [V] (sums to 1) -> renormalized distribution restricted by top-k, then top-p, then min-p."""
    v = probs.shape[-1]
    if 0 < top_k < v:
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        # ties at the k-th value: keep exactly k (the first k in sorted order)
        if int((probs > 0).sum()) > top_k:
            keep = probs.topk(top_k).indices
            probs = torch.zeros_like(probs).scatter_(0, keep, probs[keep])
        probs = probs / probs.sum()
    if top_p < 1.0:
        sp, si = probs.sort(descending=True)
        keep = sp.cumsum(-1) - sp < top_p
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def distribution(logits: torch.Tensor, p, prompt_ids: Sequence[int] = (), generated: Sequence[int] = (),
                 stop_ids: set[int] = frozenset()) -> torch.Tensor:
    """The distribution a request samples from at temperature > 0 (all steps but the final draw)."""
    logits = mask_stops(penalize(logits.float(), p, prompt_ids, generated), p, len(generated), stop_ids)
    probs = torch.softmax(logits / p.temperature, -1)
    return filter_probs(probs, p.top_k, p.top_p, p.min_p)


def _logprobs(raw: torch.Tensor, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    lp = torch.log_softmax(raw.float(), -1)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        vals, idx = lp.topk(min(k, lp.shape[-1]))
        top = tuple(zip(idx.tolist(), vals.tolist()))
    return float(lp[token]), top


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[Sampled]:
    """logits [n, V] at n consecutive prompt positions, targets: the n prompt tokens that follow
    them -> each target's logprob, its rank (how many tokens are at least as likely: vLLM's
    batched_count_greater_than, vllm/v1/sample/ops/logprobs.py, v0.11.0) and the k most likely."""
    if not len(targets):
        return []
    lp = torch.log_softmax(logits[: len(targets)].float(), -1)
    t = torch.tensor(list(targets), dtype=torch.long, device=lp.device)
    own = lp.gather(1, t[:, None])
    ranks = (lp >= own).sum(-1).tolist()
    own = own[:, 0].tolist()
    if k > 0:
        vals, idx = lp.topk(min(k, lp.shape[-1]), -1)
        tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [()] * len(own)
    return [Sampled(int(x), o, top, r) for x, o, top, r in zip(targets, own, tops, ranks)]


def sample(logits: torch.Tensor, reqs: Sequence[Any], stop_ids: set[int]) -> list[tuple[int, Sampled | None]]:
    """logits fp32 [B, V] -> (token id, Sampled with logprobs or None) per request.

    Each request has `.params` (SamplingParams), `.prompt_ids`, `.generated` and `.generator`."""
    greedy = logits.argmax(-1).tolist()
    out: list[tuple[int, Sampled | None]] = []
    for i, r in enumerate(reqs):
        p = r.params
        if _plain(p):
            out.append((greedy[i], None))
            continue
        row = logits[i].float()
        if p.temperature <= 0:
            adj = mask_stops(penalize(row, p, r.prompt_ids, r.generated), p, len(r.generated), stop_ids)
            tok = int(adj.argmax())
        else:
            probs = distribution(row, p, r.prompt_ids, r.generated, stop_ids)
            tok = int(torch.multinomial(probs, 1, generator=r.generator))
        if p.logprobs is not None:
            lp, top = _logprobs(row, tok, p.logprobs)
            out.append((tok, Sampled(tok, lp, top)))
        else:
            out.append((tok, None))
    return out
