"""Stop strings through the HTTP API (issue 31 item 2): the start of a stop string spanning tokens
is never sent (streaming or not, completions and chat), include_stop_str_in_output, stop_reason,
and the tokens counted stop at the one that completed the match. In-process: the real app and
Engine over a table model (next-token logits = a fixed row of the last token)."""

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

MAX_LEN = 128


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer_files(d, 512, MAX_LEN)
    tok = Tokenizer(d)
    m = Metrics()
    model = TableModel(tok.vocab_size, seed=1)
    eng = Engine(model, "cpu", 4, 8, MAX_LEN, tok.stop_ids, m)
    eng.start()
    yield TestClient(create_app(ServerState("m", m, eng, tok, ready=True))), model, tok
    eng.stop()


def chain(model, last, n):
    out = []
    for _ in range(n):
        last = int(model.table[last].argmax())
        out.append(last)
    return out


@pytest.fixture(scope="module")
def case(stack):
    """A greedy chain from prompt [7] and a stop string made of the end of one token's text and the
    start of the next one's (so no single token completes it)."""
    _, model, tok = stack
    ids = chain(model, 7, 24)
    texts = [tok.decode([t]) for t in ids]
    for k in range(2, 20):
        a, b = texts[k], texts[k + 1]
        if len(a) >= 2 and len(b) >= 2 and a.isprintable() and b.isprintable():
            stop = a[-2:] + b[:2]
            full = tok.decode(ids)
            cut = full.find(stop)
            if cut == len(tok.decode(ids[:k + 1])) - 2:  # its first occurrence is where we built it
                return ids, stop, full[:cut], k + 2
    pytest.skip("no chain with two multi-character tokens")


def body(chat, **kw):
    base = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": [7]}
    return {**base, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **kw}


def completion(client, stop, **kw):
    r = client.post("/v1/completions", json=body(False, stop=[stop], **kw))
    assert r.status_code == 200, r.text
    return r.json()


def streamed(client, path, payload):
    with client.stream("POST", path, json={**payload, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c for e in events for c in e["choices"]]
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    return text, choices[-1], events[-1]["usage"]


def test_completion_stop_string_across_tokens(stack, case):
    client, _, _ = stack
    ids, stop, before, n = case
    for _ in range(3):  # the same answer every time (the count does not depend on when the cancel lands)
        r = completion(client, stop)
        c = r["choices"][0]
        assert c["text"] == before and c["finish_reason"] == "stop" and c["stop_reason"] == stop
        assert r["usage"]["completion_tokens"] == n


def test_streamed_completion_never_sends_the_start(stack, case):
    client, _, _ = stack
    ids, stop, before, n = case
    text, last, usage = streamed(client, "/v1/completions", body(False, stop=[stop]))
    assert text == before and last["finish_reason"] == "stop" and last["stop_reason"] == stop
    assert usage["completion_tokens"] == n


def test_include_stop_str_in_output(stack, case):
    client, _, _ = stack
    ids, stop, before, n = case
    r = completion(client, stop, include_stop_str_in_output=True)
    assert r["choices"][0]["text"] == before + stop
    text, _, _ = streamed(client, "/v1/completions", body(False, stop=[stop], include_stop_str_in_output=True))
    assert text == before + stop


def test_chat_stop_string(stack):
    client, _, tok = stack
    free = client.post("/v1/chat/completions", json=body(True)).json()["choices"][0]["message"]["content"]
    i = next(i for i in range(4, len(free) - 4) if free[i - 1] != free[i] and free[i:i + 3].strip())
    stop = free[i:i + 3]
    cut = free.find(stop)
    r = client.post("/v1/chat/completions", json=body(True, stop=stop)).json()
    assert r["choices"][0]["message"]["content"] == free[:cut] and r["choices"][0]["stop_reason"] == stop
    text, last, _ = streamed(client, "/v1/chat/completions", body(True, stop=stop))
    assert text == free[:cut] and last["finish_reason"] == "stop"


def test_stop_token_id_is_the_stop_reason_and_counts(stack):
    client, model, _ = stack
    ids = chain(model, 7, 12)
    k = next(k for k in range(1, 12) if ids[k] not in ids[:k])
    r = client.post("/v1/completions", json=body(False, stop_token_ids=[ids[k]])).json()
    assert r["choices"][0]["stop_reason"] == ids[k] and r["usage"]["completion_tokens"] == k + 1
    r = client.post("/v1/completions", json=body(False, max_tokens=3)).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["stop_reason"] is None
