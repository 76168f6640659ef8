"""moe_runtime.sampling against torch references written here from the definitions (HF's
repetition penalty, OpenAI's frequency/presence penalties, top-k / top-p / min-p filtering,
min_tokens, stop tokens, logprobs). Each test also checks that the feature changes the outcome on
its input, so it fails if the feature were ignored."""

from dataclasses import dataclass, field

import pytest
import torch

from moe_runtime import sampling
from moe_runtime.engine import SamplingParams

V = 32


def logits_row(seed=0):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2


@dataclass
class R:
    params: SamplingParams
    prompt_ids: list = field(default_factory=list)
    generated: list = field(default_factory=list)
    generator: torch.Generator | None = None


def ref_repetition(logits, ids, penalty):
    out = logits.clone()
    for t in set(ids):
        out[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
    return out


def ref_freq_presence(logits, generated, freq, pres):
    out = logits.clone()
    for t in set(generated):
        out[t] -= freq * generated.count(t) + pres
    return out


def ref_filter(probs, top_k, top_p, min_p):
    p = probs.clone()
    if top_k > 0:
        order = sorted(range(V), key=lambda i: -float(p[i]))
        for i in order[top_k:]:
            p[i] = 0
        p /= p.sum()
    if top_p < 1:
        order = sorted(range(V), key=lambda i: -float(p[i]))
        acc, keep = 0.0, set()
        for i in order:
            if acc >= top_p:
                break
            keep.add(i)
            acc += float(p[i])
        for i in range(V):
            if i not in keep:
                p[i] = 0
        p /= p.sum()
    if min_p > 0:
        thr = min_p * float(p.max())
        for i in range(V):
            if p[i] < thr:
                p[i] = 0
        p /= p.sum()
    return p


def test_repetition_penalty_matches_hf_rule_and_changes_greedy():
    x = logits_row(1)
    top2 = x.topk(2).indices.tolist()
    x[top2[0]] = 3.0
    x[top2[1]] = 2.9  # a close second: penalizing the first makes the second win
    p = SamplingParams(temperature=0, repetition_penalty=1.3)
    prompt, gen = [top2[0], 5], [7, 7]
    got = sampling.penalize(x, p, prompt, gen)
    torch.testing.assert_close(got, ref_repetition(x, prompt + gen, 1.3))
    assert sampling.sample(x[None], [R(p, prompt, gen)], set())[0][0] == top2[1] != int(x.argmax())


def test_frequency_and_presence_penalties_match_openai_rule():
    x = logits_row(2)
    best = int(x.argmax())
    gen = [best, best, 3, best, 9]
    p = SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.5)
    got = sampling.penalize(x, p, [best], gen)  # the prompt does not count for these two
    ref = ref_freq_presence(x, gen, 0.7, 0.5)
    torch.testing.assert_close(got, ref)
    assert not torch.equal(got, x)
    tok = sampling.sample(x[None], [R(p, [best], gen)], set())[0][0]
    assert tok == int(ref.argmax())
    # negative values encourage repetition
    neg = sampling.penalize(x, SamplingParams(frequency_penalty=-1.0), [], [4])
    assert neg[4] == pytest.approx(float(x[4]) + 1.0)


@pytest.mark.parametrize("top_k,top_p,min_p", [(3, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.3), (5, 0.8, 0.2),
                                               (1, 1.0, 0.0), (V + 10, 1.0, 0.0)])
def test_filters_match_reference(top_k, top_p, min_p):
    x = logits_row(3)
    p = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    got = sampling.distribution(x, p)
    ref = ref_filter(torch.softmax(x / 0.8, -1), top_k, top_p, min_p)
    torch.testing.assert_close(got, ref)
    if (top_k, top_p, min_p) != (V + 10, 1.0, 0.0):
        assert int((got > 0).sum()) < V  # the filter removed something


def test_top_k_and_min_p_restrict_what_is_sampled():
    x = logits_row(4)
    allowed3 = set(x.topk(3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    r = R(SamplingParams(temperature=1.5, top_k=3), generator=gen)
    draws = {sampling.sample(x[None], [r], set())[0][0] for _ in range(300)}
    assert draws <= allowed3 and len(draws) > 1
    free = R(SamplingParams(temperature=1.5), generator=torch.Generator().manual_seed(0))
    assert {sampling.sample(x[None], [free], set())[0][0] for _ in range(300)} - allowed3  # without top-k: more
    probs = torch.softmax(x / 1.5, -1)
    keep = set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    r = R(SamplingParams(temperature=1.5, min_p=0.5), generator=torch.Generator().manual_seed(1))
    assert {sampling.sample(x[None], [r], set())[0][0] for _ in range(300)} <= keep


def test_min_tokens_masks_eos_and_stop_token_ids():
    x = logits_row(5)
    order = x.argsort(descending=True).tolist()
    eos, stop = order[0], order[1]
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(stop,))
    assert sampling.sample(x[None], [R(p, [1], [])], {eos})[0][0] == order[2]  # both masked before 2 tokens
    assert sampling.sample(x[None], [R(p, [1], [8, 9])], {eos})[0][0] == eos  # from then on, allowed
    ign = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=(stop,))
    assert sampling.sample(x[None], [R(ign, [1], [])], {eos})[0][0] == eos  # ignore_eos: EOS is no stop
    sp = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=(stop,))
    d = sampling.distribution(x, sp, [], [], {eos})
    assert d[eos] == 0 and d[stop] == 0 and d.sum() == pytest.approx(1.0)


def test_logprobs_are_the_raw_distribution():
    x = logits_row(6)
    p = SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5)
    tok, s = sampling.sample(x[None], [R(p, [int(x.argmax())], [])], set())[0]
    ref = torch.log_softmax(x, -1)
    assert s.id == tok and s.logprob == pytest.approx(float(ref[tok]))
    assert [t for t, _ in s.top] == ref.topk(3).indices.tolist()
    assert [lp for _, lp in s.top] == pytest.approx(ref.topk(3).values.tolist())
    assert sampling.sample(x[None], [R(SamplingParams(temperature=0), [], [])], set())[0][1] is None


def test_batch_rows_use_their_own_params():
    x = torch.stack([logits_row(7), logits_row(8)])
    plain = R(SamplingParams(temperature=0))
    pen = R(SamplingParams(temperature=0, repetition_penalty=100.0), prompt_ids=[int(x[1].argmax())])
    out = sampling.sample(x, [plain, pen], set())
    assert out[0][0] == int(x[0].argmax())
    assert out[1][0] == int(ref_repetition(x[1], pen.prompt_ids, 100.0).argmax()) != int(x[1].argmax())
