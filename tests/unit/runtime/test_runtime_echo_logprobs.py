"""`echo` and prompt logprobs (issue 31 item 2), as vLLM's OpenAI server shapes them (v0.11.0:
vllm/entrypoints/openai/serving_completion.py request_output_to_completion_response and
completion_stream_generator, protocol.py CompletionRequest.to_sampling_params, vllm/v1/engine/logprobs.py
_make_logprob_dict). The real app and Engine over the table model, whose logits after token t are
table[t], so each prompt token's logprob is log_softmax(table[previous token])[token], computed here.
Small blocks and prefill chunks: a prompt spans several chunks, and a repeated prompt would hit the
prefix cache (which must be bypassed, or positions go unscored)."""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from moe_runtime.engine import Engine
from moe_runtime.http.app import create_app
from moe_runtime.http.state import ServerState
from moe_runtime.metrics import Metrics
from moe_runtime.tokenizer import Tokenizer, build_tokenizer_files
from table_model import TableModel

MAX_LEN = 96
PROMPT = [(i * 37 + 11) % 400 + 20 for i in range(29)]  # 29 tokens: 4 blocks of 8, 4 prefill chunks of 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer_files(d, 512, MAX_LEN)
    tok = Tokenizer(d)
    m = Metrics()
    model = TableModel(tok.vocab_size, seed=5)
    eng = Engine(model, "cpu", 4, 16, MAX_LEN, tok.stop_ids, m, max_prefill_tokens=8, block_size=8)
    eng.start()
    yield TestClient(create_app(ServerState("m", m, eng, tok, ready=True))), model, tok, eng
    eng.stop()


def ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def ref(model, prev, tok_id):
    lp = torch.log_softmax(model.table[prev].float(), -1)
    return float(lp[tok_id]), int((lp >= lp[tok_id]).sum()), lp


def test_echo_with_logprobs_is_the_prompt_scored_then_the_completion(stack):
    client, model, tok, _ = stack
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True, "ignore_eos": True}
    c = ok(client.post("/v1/completions", json=body))["choices"][0]
    lp = c["logprobs"]
    gen = int(model.table[PROMPT[-1]].argmax())
    assert len(lp["token_logprobs"]) == len(PROMPT) + 1  # lm-eval's [ctxlen:-1] relies on it
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(PROMPT)):
        want, _, row = ref(model, PROMPT[p - 1], PROMPT[p])
        assert lp["token_logprobs"][p] == pytest.approx(want, abs=1e-5)
        top = lp["top_logprobs"][p]
        # the token itself is a key (tokens that print alike share one: the likeliest value)
        assert top[tok.token_text(PROMPT[p])] >= want - 1e-5 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(float(row.max()), abs=1e-5)
    assert lp["token_logprobs"][-1] == pytest.approx(float(torch.log_softmax(model.table[PROMPT[-1]], -1)[gen]),
                                                     abs=1e-5)
    assert lp["tokens"] == [tok.token_text(t) for t in [*PROMPT, gen]]
    prompt_text = tok.decode(PROMPT)
    assert c["text"] == prompt_text + tok.decode([gen])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(tok.token_text(PROMPT[0]))
    # the prompt's logprobs with echo are also the choice's prompt_logprobs (k = logprobs)
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == len(PROMPT)


def test_prompt_logprobs_field_ranks_and_top_k(stack):
    client, model, tok, _ = stack
    c = ok(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                "prompt_logprobs": 3}))["choices"][0]
    assert c["logprobs"] is None and c["text"] and not c["text"].startswith(tok.decode(PROMPT[:3]))
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        want, rank, row = ref(model, PROMPT[p - 1], PROMPT[p])
        entry = plp[p]
        own = entry[str(PROMPT[p])]
        assert list(entry)[0] == str(PROMPT[p])  # the prompt token first, then the top 3
        assert own["logprob"] == pytest.approx(want, abs=1e-5) and own["decoded_token"] == tok.token_text(PROMPT[p])
        vals, idx = row.topk(3)
        for r, (t, v) in enumerate(zip(idx.tolist(), vals.tolist()), 1):
            assert entry[str(t)]["rank"] == r and entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-5)
        if str(PROMPT[p]) not in {str(t) for t in idx.tolist()}:
            assert own["rank"] == rank and len(entry) == 4


def test_repeated_prompt_is_scored_whole_despite_the_prefix_cache(stack):
    """The second request's prompt blocks are cached (the first registered them): scored anyway."""
    client, _, _, eng = stack
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    ok(client.post("/v1/completions", json={**body, "prompt_logprobs": None}))  # fills the prefix cache
    assert eng.kv.match_prefix(PROMPT)  # a plain request would now skip these
    a = ok(client.post("/v1/completions", json=body))["choices"][0]["prompt_logprobs"]
    b = ok(client.post("/v1/completions", json=body))["choices"][0]["prompt_logprobs"]
    assert len(a) == len(PROMPT) and a == b and all(len(e) == 1 for e in a[1:])


def test_echo_max_tokens_0_is_the_prompt_alone(stack):
    client, _, tok, _ = stack
    text = "The quick brown fox"
    r = ok(client.post("/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1}))
    c = r["choices"][0]
    ids = tok.encode(text)
    assert c["text"] == text and len(c["logprobs"]["token_logprobs"]) == len(ids)
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 1  # as vLLM counts
    e = client.post("/v1/completions", json={"prompt": text, "max_tokens": 0})
    assert e.status_code == 400 and e.json()["error"]["param"] == "max_tokens"


def test_the_stop_token_is_scored_when_it_ends_the_output(stack):
    """A stop token is not text but is the output's last token: its logprob is there (vLLM keeps it),
    so echo + logprobs always covers prompt + output. As the last allowed token it is "length" and
    text (vLLM's check_stop tests the length cap first): lm-eval's max_tokens 1 gets len(prompt) + 1."""
    client, model, _, _ = stack
    gen = int(model.table[PROMPT[-1]].argmax())
    for max_tokens, reason, stop_reason in [(2, "stop", gen), (1, "length", None)]:
        c = ok(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                                    "logprobs": 1, "echo": True, "stop_token_ids": [gen]}))
        c = c["choices"][0]
        assert c["finish_reason"] == reason and c["stop_reason"] == stop_reason
        assert len(c["logprobs"]["token_logprobs"]) == len(PROMPT) + 1


def test_streamed_echo_equals_the_answer(stack):
    client, _, _, _ = stack
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True, "ignore_eos": True}
    whole = ok(client.post("/v1/completions", json=body))["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    cs = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in cs) == whole["text"]
    streamed = [v for c in cs if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    assert cs[0]["logprobs"]["token_logprobs"][0] is None


def test_prompt_logprobs_with_stream_is_refused_and_chat_has_them(stack):
    client, model, tok, _ = stack
    e = client.post("/v1/completions", json={"prompt": "hi", "stream": True, "prompt_logprobs": 1})
    assert e.status_code == 400 and e.json()["error"]["param"] == "prompt_logprobs"
    r = ok(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 1, "prompt_logprobs": 1}))
    plp = r["prompt_logprobs"]
    assert plp[0] is None and r["usage"]["prompt_tokens"] == len(plp)
    e = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert e.status_code == 400 and e.json()["error"]["param"] == "echo"  # chat's echo: not served


def test_a_long_prompt_is_scored_in_bounded_chunks():
    """Every position's logits of a prompt_logprobs chunk are kept: chunks stay within
    PROMPT_LOGPROBS_CHUNK tokens whatever the prefill budget, and the scores are all there."""
    from moe_runtime.engine import PROMPT_LOGPROBS_CHUNK, Finished, Request, SamplingParams

    class Loop:
        def call_soon_threadsafe(self, fn, *a):
            fn(*a)

    class Sink(list):
        def put_nowait(self, item):
            self.append(item)

    model = TableModel(64, seed=3)
    eng = Engine(model, "cpu", 2, 4, 2048, set(), max_prefill_tokens=2048, block_size=16)
    prompt = [(i * 7 + 1) % 60 for i in range(1300)]
    r = Request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), Loop(), Sink())
    eng.submit(r)
    while eng.waiting or eng.running:
        eng.step()
    assert isinstance(r.out[-1], Finished)
    assert max(p for _, p in eng.steps) == PROMPT_LOGPROBS_CHUNK
    assert len(r.prompt_logprobs) == len(prompt) - 1
    lp = torch.log_softmax(model.table[prompt[699]], -1)[prompt[700]]
    assert r.prompt_logprobs[699].logprob == pytest.approx(float(lp), abs=1e-5)
