"""vLLM's add_special_tokens (protocol.py v0.11.0: true by default for /v1/completions and /tokenize
prompts, false for chat, whose template writes them) over a tokenizer whose tokenizer.json adds a BOS
(a TemplateProcessing post-processor, as Llama-3's): the count is what transformers' tokenizer gives."""

import json

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer as HFTokenizer, processors

from moe_runtime.engine import Engine
from moe_runtime.http.app import create_app
from moe_runtime.http.state import ServerState
from moe_runtime.metrics import Metrics
from moe_runtime.tokenizer import Tokenizer, build_tokenizer_files
from table_model import TableModel

BOS = "<|begin_of_text|>"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer_files(d, 512, 96)
    hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
    bos = hf.token_to_id(BOS)
    hf.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                             processors.TemplateProcessing(single=f"{BOS} $A",
                                                                           special_tokens=[(BOS, bos)])])
    hf.save(str(d / "tokenizer.json"))
    tok = Tokenizer(d)
    m = Metrics()
    eng = Engine(TableModel(tok.vocab_size, seed=2), "cpu", 2, 16, 96, tok.stop_ids, m)
    eng.start()
    yield TestClient(create_app(ServerState("m", m, eng, tok, ready=True))), tok, bos, d
    eng.stop()


def test_completions_add_the_bos_unless_told_not_to(stack):
    client, tok, bos, d = stack
    plain = tok.encode("hello world")
    transformers = pytest.importorskip("transformers")
    assert transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))("hello world").input_ids \
        == [bos, *plain]
    body = {"prompt": "hello world", "max_tokens": 1, "echo": True, "logprobs": 0}
    r = client.post("/v1/completions", json=body).json()
    assert r["usage"]["prompt_tokens"] == len(plain) + 1 and r["choices"][0]["logprobs"]["tokens"][0] == BOS
    r = client.post("/v1/completions", json={**body, "add_special_tokens": False}).json()
    assert r["usage"]["prompt_tokens"] == len(plain)


def test_chat_leaves_them_to_the_template(stack):
    client, tok, _, _ = stack
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs)
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == len(tok.encode(text))


def test_tokenize_as_vllm(stack):
    client, tok, bos, _ = stack
    r = client.post("/tokenize", json={"prompt": "hello", "return_token_strs": True}).json()
    assert r["tokens"][0] == bos and r["token_strs"][0] == BOS and len(r["token_strs"]) == r["count"]
    # what lm-eval's RemoteTokenizer sends
    r = client.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode("hello") and "token_strs" not in r
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert r["tokens"][0] != bos
    assert json.dumps(r)  # plain JSON


def test_tokenizer_info_only_when_enabled(stack):
    client, tok, _, _ = stack
    assert client.get("/tokenizer_info").status_code == 404  # off by default, as vLLM's
    from moe_runtime.http.state import ServerOptions

    on = TestClient(create_app(ServerState("m", Metrics(), None, tok, ready=True,
                                           options=ServerOptions(tokenizer_info=True))))
    info = on.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["tokenizer_class"] and "vocab_file" not in info
