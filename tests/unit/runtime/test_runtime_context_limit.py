"""max_tokens against the context (issue 31 item 3): an asked max_tokens that does not fit is a 400
with vLLM's wording; chat's default is the rest of the context (vLLM), completions' OpenAI's 16.
In-process: the real app and Engine over a table model whose chains never hit EOS."""

import pytest
import torch
from fastapi.testclient import TestClient

from moe_runtime.engine import Engine
from moe_runtime.http.app import create_app
from moe_runtime.http.protocol import context_overflow, default_max_tokens
from moe_runtime.http.state import ServerState
from moe_runtime.metrics import Metrics
from moe_runtime.tokenizer import Tokenizer, build_tokenizer_files
from table_model import TableModel

MAX_LEN = 64


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer_files(d, 512, MAX_LEN)
    tok = Tokenizer(d)
    model = TableModel(tok.vocab_size, seed=2, scale=1.0)
    m = Metrics()
    eng = Engine(model, "cpu", 2, 8, MAX_LEN, tok.stop_ids, m)
    eng.start()
    yield TestClient(create_app(ServerState("m", m, eng, tok, ready=True)))
    eng.stop()


def test_max_tokens_beyond_the_context_is_refused_with_vllms_message(client):
    r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5000})
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    # vllm/entrypoints/openai/serving_engine.py OpenAIServing._validate_input, v0.11.0 (read from the wheel)
    assert e["message"] == ("'max_tokens' or 'max_completion_tokens' is too large: 5000. This model's maximum "
                            f"context length is {MAX_LEN} tokens and your request has 3 input tokens "
                            f"(5000 > {MAX_LEN} - 3).")
    assert e["param"] == "max_tokens"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_completion_tokens": MAX_LEN})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    # exactly the rest of the context fits
    r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": MAX_LEN - 3, "ignore_eos": True,
                                             "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_LEN - 3
    r = client.post("/v1/completions", json={"prompt": list(range(5, 5 + MAX_LEN)), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, your request has {MAX_LEN} input "
        "tokens. Please reduce the length of the input messages.")


def test_chat_default_is_the_rest_of_the_context(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == MAX_LEN
    r = client.post("/v1/completions", json={"prompt": [5], "ignore_eos": True, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("prompt_n,asked,max_len,bad", [(3, 61, 64, False), (3, 62, 64, True), (3, None, 64, False),
                                                        (64, 1, 64, True), (64, None, 64, True), (3, 10**9, None, False)])
def test_context_overflow(prompt_n, asked, max_len, bad):
    assert (context_overflow(prompt_n, asked, max_len) is not None) == bad


def test_default_max_tokens():
    assert default_max_tokens(True, 10, 64) == 54 and default_max_tokens(False, 10, 64) == 16
    assert default_max_tokens(False, 60, 64) == 4 and default_max_tokens(True, 64, 64) == 1
