"""The official `openai` SDK against the server, unchanged (issue 31 item 9): completions, chat,
streaming with usage, stop strings, and errors mapped to the SDK's exception classes. The real app
and Engine in-process (the SDK's httpx client is the app's TestClient), over a table model."""

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from moe_runtime.engine import Engine
from moe_runtime.http.app import create_app
from moe_runtime.http.state import ServerState
from moe_runtime.metrics import Metrics
from moe_runtime.tokenizer import SPECIALS, Tokenizer, build_tokenizer_files
from table_model import TableModel

MAX_LEN = 96


@pytest.fixture(scope="module")
def sdk(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer_files(d, 512, MAX_LEN)
    tok = Tokenizer(d)
    m = Metrics()
    eng = Engine(TableModel(tok.vocab_size, seed=3), "cpu", 4, 16, MAX_LEN, tok.stop_ids, m)
    eng.start()
    http = TestClient(create_app(ServerState("tiny", m, eng, tok, ready=True)))
    yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    eng.stop()


def test_models(sdk):
    assert [m.id for m in sdk.models.list().data] == ["tiny"]


def test_completion_and_its_stream_agree(sdk):
    r = sdk.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0 and r.choices[0].text
    chunks = list(sdk.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_stream_and_stop_string(sdk):
    msgs = [{"role": "user", "content": "Hi"}]
    r = sdk.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and text
    parts = [c.choices[0].delta.content or "" for c in sdk.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(parts) == text
    stop = text[3:6]
    s = sdk.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert s.choices[0].message.content == text[:text.find(stop)] and s.choices[0].finish_reason == "stop"


def test_logprobs_through_the_sdk(sdk):
    r = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                    temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


@pytest.mark.parametrize("kw,exc,needle", [
    ({"model": "other"}, openai.NotFoundError, "does not exist"),
    ({"max_tokens": 10_000}, openai.BadRequestError, "maximum context length"),
    ({"temperature": 5}, openai.BadRequestError, "temperature"),
    ({"extra_body": {"best_of": 3}}, openai.BadRequestError, "best_of"),
])
def test_errors_are_the_sdks_exception_classes(sdk, kw, exc, needle):
    with pytest.raises(exc) as e:
        sdk.completions.create(**{"model": "tiny", "prompt": "Hello", **kw})
    assert needle in str(e.value)


def test_vllm_chat_fields_through_extra_body(sdk):
    """chat_template_kwargs, add_generation_prompt, continue_final_message (vLLM's fields) shape the
    prompt: visible in prompt_tokens."""
    msgs = [{"role": "user", "content": "Hi"}]

    def prompt_n(**extra):
        return sdk.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                           extra_body=extra).usage.prompt_tokens

    with_gen = prompt_n()
    assert prompt_n(add_generation_prompt=False) < with_gen
    assert prompt_n(chat_template_kwargs={"enable_thinking": False}) == with_gen  # accepted (unused here)
    cont = [*msgs, {"role": "assistant", "content": "The quick"}]
    r = sdk.chat.completions.create(model="tiny", messages=cont, max_tokens=1,
                                    extra_body={"add_generation_prompt": False, "continue_final_message": True})
    full = sdk.chat.completions.create(model="tiny", messages=cont, max_tokens=1,
                                       extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens < full.usage.prompt_tokens  # cut after "The quick" (no <|im_end|>)
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        sdk.chat.completions.create(model="tiny", messages=cont, max_tokens=1,
                                    extra_body={"continue_final_message": True})


def test_skip_special_tokens_false_keeps_them(sdk):
    """The same greedy output with and without skip_special_tokens: equal once the specials are removed,
    and this chain has some (seeded table model)."""
    kw = dict(model="tiny", prompt=[1, 2, 3], max_tokens=40, temperature=0)
    plain = sdk.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    kept = sdk.completions.create(**kw, extra_body={"ignore_eos": True, "skip_special_tokens": False}).choices[0].text
    stripped = kept
    for s in SPECIALS:
        stripped = stripped.replace(s, "")
    assert kept != plain and stripped == plain


@pytest.mark.parametrize("stream", [False, True])
def test_batched_prompts(sdk, stream):
    """prompt: [a, b] (strings or token-id lists) answers each; choice index = prompt * n + choice (vLLM)."""
    kw = dict(model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    singles = [sdk.completions.create(prompt=p, **kw) for p in ("Hello", "The quick")]
    if stream:
        chunks = list(sdk.completions.create(prompt=["Hello", "The quick"], n=2, stream=True,
                                             stream_options={"include_usage": True}, **kw))
        texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                 for i in range(4)}
        usage = chunks[-1].usage
    else:
        r = sdk.completions.create(prompt=["Hello", "The quick"], n=2, **kw)
        texts, usage = {c.index: c.text for c in r.choices}, r.usage
    assert [texts[i] for i in range(4)] == [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2
    assert usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles) and usage.completion_tokens == 16
    ids = sdk.completions.create(prompt=[[5, 6], [7]], **kw)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 3


def test_vllm_default_fields_request_id_and_continuous_usage(sdk):
    """Clients written for vLLM send its extra fields at their defaults (protocol.py, v0.11.0): accepted;
    request_id names the response; stream_options' continuous_usage_stats puts the running usage on
    every chunk, include_usage defaults to true once stream_options is sent."""
    defaults = {"spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "bad_words": [],
                "include_reasoning": True, "priority": 0, "return_token_ids": False, "allowed_token_ids": None,
                "ignore_eos": True, "request_id": "abc123"}
    r = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                    extra_body=defaults)
    assert r.id == "chatcmpl-abc123" and r.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="priority"):
        sdk.completions.create(model="tiny", prompt="Hi", max_tokens=1, extra_body={"priority": 5})
    chunks = list(sdk.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, stream=True,
                                         stream_options={"continuous_usage_stats": True},
                                         extra_body={"ignore_eos": True}))
    running = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert running and running == sorted(running) and running[-1] == 4
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices  # the final usage chunk
