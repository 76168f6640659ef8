"""The HTTP layer under hostile and careless clients, and the sampling parameters end to end.

In-process part: the real FastAPI app, the real Engine (its scheduler thread) and a real tokenizer,
over a fake model whose next-token logits are a fixed table row of the last token, so every
expected output is computed here from the table (greedy chains, penalties, logprobs).
Live part: `moe-runtime serve` on the tiny checkpoint for what needs real sockets (client
disconnects, a 10 MB body while /health is polled, chunked bodies over the limit).
"""

import asyncio
import json
import random
import socket
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from moe_runtime.engine import Engine
from moe_runtime.metrics import Metrics
from moe_runtime.http.app import create_app
from moe_runtime.http.state import ServerOptions, ServerState
from moe_runtime.tokenizer import Tokenizer, build_tokenizer_files
from table_model import TableModel

MAX_LEN = 128


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer_files(d, 512, MAX_LEN)
    return Tokenizer(d)


@pytest.fixture(scope="module")
def stack(tok):
    m = Metrics()
    model = TableModel(tok.vocab_size, seed=0)
    eng = Engine(model, "cpu", 4, 8, MAX_LEN, tok.stop_ids, m)
    eng.start()
    state = ServerState("m", m, eng, tok, ready=True, options=ServerOptions(max_body_bytes=64 * 1024))
    yield TestClient(create_app(state)), model, state
    eng.stop()


@pytest.fixture
def client(stack):
    return stack[0]


def ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def is_openai_error(r, status):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"] and e["type"]
    return e


def greedy_chain(model, stops, last, n, penalty=None):
    """Reference: the table model's greedy continuation of `last` (optionally penalized)."""
    out = []
    for _ in range(n):
        row = model.table[last].clone()
        if penalty:
            row = penalty(row, out)
        t = int(row.argmax())
        if t in stops:
            break
        out.append(t)
        last = t
    return out


def completion_text(client, body):
    return ok(client.post("/v1/completions", json=body))["choices"][0]["text"]


# ------------------------------------------------------------------------------------ error shape

@pytest.mark.parametrize("method,path,body,status,needle", [
    ("get", "/nope", None, 404, "no such endpoint"),
    ("delete", "/v1/completions", None, 405, "not allowed"),
    ("get", "/v1/chat/completions", None, 405, "not allowed"),
    ("post", "/v1/completions", b"{not json", 400, "JSON"),
    ("post", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("post", "/v1/completions", rb'{"prompt": "a\ud800b"}', 400, "invalid Unicode in prompt"),
    ("post", "/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\udfff"}]}', 400,
     "invalid Unicode in messages.0.content"),
    ("post", "/v1/completions", b"[1, 2]", 400, "invalid request"),
    ("post", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("post", "/v1/completions", b'{"prompt": "x", "max_tokens": 1e400}', 400, "max_tokens"),
    ("post", "/v1/completions", b'{"prompt": "x", "seed": 99999999999999999999999}', 400, "seed"),
    ("post", "/v1/completions", b"[" * 20000 + b"]" * 20000, 400, ""),
    ("post", "/v1/models/m", b"{}", 405, "not allowed"),
    ("get", "/v1/models/other", None, 404, "does not exist"),
    ("post", "/detokenize", b'{"tokens": [-1]}', 400, "token ids"),
    ("post", "/tokenize", b'{"prompt": "a", "messages": []}', 400, "exactly one"),
])
def test_every_error_is_openai_shaped(client, method, path, body, status, needle):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if body is not None else {}
    e = is_openai_error(client.request(method.upper(), path, **kw), status)
    assert needle in e["message"]
    ok(client.get("/health"))


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"length_penalty": 2.0}, "length_penalty"),
])
def test_unimplemented_parameters_are_refused_by_name(client, extra, param):
    e = is_openai_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **extra}), 400)
    assert e["param"] == param and param in e["message"] and e["code"] == "unsupported_parameter"
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 1, **extra})
    assert is_openai_error(chat, 400)["param"] == param


@pytest.mark.parametrize("extra", [{"tools": []}, {"tool_choice": "none"}, {"response_format": {"type": "text"}},
                                   {"logit_bias": {}}, {"best_of": 1}, {"echo": False}, {"store": False}])
def test_values_that_mean_not_used_are_accepted(client, extra):
    ok(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **extra}))


def test_unknown_parameters_and_bad_combinations(client):
    e = is_openai_error(client.post("/v1/completions", json={"prompt": "hi", "temprature": 0.5}), 400)
    assert e["param"] == "temprature" and "unknown parameter" in e["message"]
    e = is_openai_error(client.post("/v1/completions", json={"prompt": "hi", "stream_options": {"include_usage": True}}), 400)
    assert e["param"] == "stream_options"
    e = is_openai_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "min_tokens": 3}), 400)
    assert e["param"] == "min_tokens"
    e = is_openai_error(client.post("/v1/completions", json={"prompt": "hi", "stop_token_ids": [10**6]}), 400)
    assert e["param"] == "stop_token_ids"
    msgs = [{"role": "user", "content": "hi"}]
    e = is_openai_error(client.post("/v1/chat/completions", json={"messages": msgs, "top_logprobs": 2}), 400)
    assert e["param"] == "top_logprobs"
    e = is_openai_error(client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)
    assert "image_url" in e["message"]
    e = is_openai_error(client.post("/v1/completions", json={"prompt": [[1, 2], []]}), 400)  # batches are served
    assert "must not be empty" in e["message"]
    e = is_openai_error(client.post("/v1/completions", json={"prompt": "hi", "n": 9}), 400)  # queue of 8
    assert e["param"] == "n" and "queue" in e["message"]


def test_body_limit_413_with_and_without_content_length(client):
    big = json.dumps({"prompt": "x" * 70_000}).encode()
    e = is_openai_error(client.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
    assert "65536 bytes" in e["message"]

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    is_openai_error(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    ok(client.post("/v1/completions", json={"prompt": "hello " * 20, "max_tokens": 1}))


def test_prompt_longer_than_the_context_is_refused_without_tokenizing(client, stack, monkeypatch):
    state = stack[2]
    monkeypatch.setattr(state.tokenizer, "encode", lambda text: pytest.fail("tokenized a prompt that cannot fit"))
    e = is_openai_error(client.post("/v1/completions", json={"prompt": "hello " * 10_000}), 400)
    assert e["code"] == "context_length_exceeded"
    e = is_openai_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab" * 5000}]}), 400)
    assert e["code"] == "context_length_exceeded"


def test_unexpected_exception_is_a_json_500_and_counted(stack, tok):
    m = Metrics()

    class Broken:
        max_len = MAX_LEN
        model = stack[1]

        def submit(self, req):
            raise RuntimeError("boom")

    c = TestClient(create_app(ServerState("m", m, Broken(), tok, ready=True)), raise_server_exceptions=False)
    e = is_openai_error(c.post("/v1/completions", json={"prompt": "hi"}), 500)
    assert e["type"] == "server_error" and "RuntimeError" in e["message"]
    text = c.get("/metrics").text
    assert 'moe_runtime_requests_total{endpoint="/v1/completions",status="500"} 1.0' in text
    assert 'moe_runtime_request_errors_total{endpoint="/v1/completions",type="server_error"} 1.0' in text
    ok(c.get("/health"))


def test_metric_labels_are_route_templates(stack, tok):
    m = Metrics()
    c = TestClient(create_app(ServerState("m", m, stack[2].engine, tok, ready=True)))
    for i in range(20):
        c.get(f"/random/{i}/{random.random()}")
        c.get(f"/v1/models/model-{i}")
    text = c.get("/metrics").text
    labels = {line.rsplit(" ", 1)[0][len("moe_runtime_requests_total{"):-1] for line in text.splitlines()
              if line.startswith("moe_runtime_requests_total{")}
    assert labels == {'endpoint="unmatched",status="404"', 'endpoint="/v1/models/{model_id:path}",status="404"'}
    assert 'moe_runtime_request_errors_total{endpoint="unmatched",type="not_found_error"} 20.0' in text


def test_api_key(stack, tok):
    c = TestClient(create_app(ServerState("m", Metrics(), stack[2].engine, tok, ready=True,
                                          options=ServerOptions(api_key="s3cret"))))
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
        e = is_openai_error(c.post("/v1/completions", json=body, headers=headers), 401)
        assert e["code"] == "invalid_api_key"
    is_openai_error(c.get("/v1/models"), 401)
    is_openai_error(c.post("/tokenize", json={"prompt": "a"}), 401)
    ok(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}))
    for open_path in ("/health", "/metrics", "/version"):
        assert c.get(open_path).status_code == 200
    assert c.get("/ready").status_code == 200


def test_tokenize_detokenize_version_model_card(client, tok):
    t = ok(client.post("/tokenize", json={"prompt": "Hello world"}))
    assert t["tokens"] == tok.encode("Hello world") and t["count"] == len(t["tokens"]) and t["max_model_len"] == MAX_LEN
    assert ok(client.post("/detokenize", json={"tokens": t["tokens"]}))["prompt"] == "Hello world"
    chat = ok(client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}))
    assert chat["tokens"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    from moe_runtime import __version__
    assert ok(client.get("/version")) == {"version": __version__}
    card = ok(client.get("/v1/models/m"))
    assert card["id"] == "m" and card["max_model_len"] == MAX_LEN
    assert ok(client.get("/v1/models"))["data"][0]["max_model_len"] == MAX_LEN


# ------------------------------------------------------------------------------ sampling end to end

def test_stop_token_ids_and_min_tokens(client, stack, tok):
    model = stack[1]
    prompt = [7]
    chain = greedy_chain(model, set(), 7, 12)
    stop = chain[3]
    assert stop not in chain[:3]
    r = ok(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                "ignore_eos": True, "stop_token_ids": [stop]}))
    # the stop token counts (as in vLLM), its text does not
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 4
    assert r["choices"][0]["text"] == tok.decode(chain[:3])
    # min_tokens: the stop id cannot be picked before 5 tokens (the reference masks it)
    first = chain[0]

    def masked(row, out):
        if len(out) < 5:
            row[first] = float("-inf")
        return row

    ref = greedy_chain(model, {first}, 7, 8, masked)
    r = ok(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                                "stop_token_ids": [first], "min_tokens": 5}))
    assert len(ref) >= 5 and r["usage"]["completion_tokens"] == len(ref) + (len(ref) < 8) and r["choices"][0]["text"] == tok.decode(ref)
    plain = ok(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True, "stop_token_ids": [first]}))
    assert plain["usage"]["completion_tokens"] == 1  # without min_tokens it stops at once (on the stop id)


@pytest.mark.parametrize("params", [{"repetition_penalty": 1.8}, {"frequency_penalty": 1.5},
                                    {"presence_penalty": 2.0}, {"frequency_penalty": 0.8, "presence_penalty": 0.8}])
def test_penalties_change_the_greedy_chain_as_the_reference(client, stack, tok, params):
    model = stack[1]
    prompt = [11]
    rep = params.get("repetition_penalty", 1.0)
    fp, pp = params.get("frequency_penalty", 0.0), params.get("presence_penalty", 0.0)

    def penalty(row, out):
        for t in set(prompt + out) if rep != 1.0 else ():
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        for t in set(out):
            row[t] -= fp * out.count(t) + pp
        return row

    n = 24
    ref = greedy_chain(model, set(), 11, n, penalty)
    plain = greedy_chain(model, set(), 11, n)
    assert tok.decode(ref) != tok.decode(plain)  # the penalty must show on this chain
    assert completion_text(client, {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                    **params}) == tok.decode(ref)


def test_top_k_and_min_p_through_http(client, stack, tok):
    model = stack[1]
    greedy = greedy_chain(model, set(), 3, 10)
    base = {"prompt": [3], "max_tokens": 10, "temperature": 2.0, "ignore_eos": True, "seed": 5}
    free = completion_text(client, base)
    assert free != tok.decode(greedy)  # hot sampling differs from greedy for this seed...
    assert completion_text(client, {**base, "top_k": 1}) == tok.decode(greedy)  # ...unless only the top token is kept
    assert completion_text(client, {**base, "min_p": 1.0}) == tok.decode(greedy)
    assert completion_text(client, base) == free  # seeded: reproducible


def test_logprobs_completion_and_chat(client, stack, tok):
    model = stack[1]
    ids = greedy_chain(model, set(), 9, 4)
    r = ok(client.post("/v1/completions", json={"prompt": [9], "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True, "logprobs": 3}))
    lp = r["choices"][0]["logprobs"]
    prev = [9] + ids[:-1]
    for i, (p, t) in enumerate(zip(prev, ids)):
        ref = torch.log_softmax(model.table[p], -1)
        assert lp["token_logprobs"][i] == pytest.approx(float(ref[t]), abs=1e-5)
        top3 = ref.topk(3).values.tolist()  # (tokens that print alike share one key of the dict)
        got = sorted(lp["top_logprobs"][i].values(), reverse=True)
        assert got[0] == pytest.approx(top3[0], abs=1e-5) and all(min(abs(g - r) for r in top3) < 1e-5 for g in got)
    assert lp["text_offset"][0] == 0 and len(lp["tokens"]) == 4
    assert r["choices"][0]["text"] == tok.decode(ids) and lp["tokens"] == [tok.token_text(t) for t in ids]
    c = ok(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                     "temperature": 0, "ignore_eos": True, "logprobs": True,
                                                     "top_logprobs": 2}))
    content = c["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
    assert content[0]["top_logprobs"][0]["logprob"] >= content[0]["top_logprobs"][1]["logprob"]
    no = ok(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
    assert no["choices"][0]["logprobs"] is None


def test_n_choices_and_stream_usage(client, tok):
    r = ok(client.post("/v1/completions", json={"prompt": [4], "max_tokens": 5, "n": 3, "temperature": 1.0,
                                                "ignore_eos": True, "seed": 1}))
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 15
    assert len({c["text"] for c in r["choices"]}) > 1  # seed, seed+1, seed+2: different samples
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in chunks[:-1])
    texts = {0: "", 1: ""}
    finishes = {}
    for c in chunks[:-1]:
        ch = c["choices"][0]
        texts[ch["index"]] += ch["delta"].get("content", "")
        if ch["finish_reason"]:
            finishes[ch["index"]] = ch["finish_reason"]
    assert finishes == {0: "length", 1: "length"} and texts[0] == texts[1]  # greedy: both choices agree


def test_fuzz_bodies_never_500(client):
    """Seeded random bodies built from valid and invalid values: never a 500, always the shape."""
    rng = random.Random(17)
    values = {
        "prompt": ["hi", "", [], [1, 2], [-1], [[1]], 5, None, {"a": 1}, "\u00e9\u4e2d", ["a"], [1.5], True],
        "max_tokens": [1, 3, 0, -5, "7", 2.5, None, 10**20, True],
        "temperature": [0, 0.7, 2.5, -1, "hot", None, 1e308],
        "top_p": [1, 0.5, 0, 1.5, None], "top_k": [-1, 0, 3, -7, 10**9, "x"], "min_p": [0, 0.5, 1.5, -0.1],
        "n": [1, 2, 0, 17, "2"], "stop": ["x", ["a", "b"], [""], 5, ["s"] * 20, None],
        "repetition_penalty": [1, 1.2, 0, -1, 11], "frequency_penalty": [0, 1, -3, 3],
        "logprobs": [None, 0, 2, 6, -1, True], "stream": [False, True, "yes"], "seed": [None, 0, -1, 2**64, "s"],
        "stream_options": [None, {"include_usage": True}, {"bogus": 1}, 3],
        "min_tokens": [0, 2, -1, 10**6], "stop_token_ids": [None, [1], [-3], "x", [1] * 20],
    }
    for _ in range(150):
        body = {k: rng.choice(v) for k, v in values.items() if rng.random() < 0.35}
        body.setdefault("max_tokens", 2)
        if rng.random() < 0.8:
            body.setdefault("prompt", "hello")
        r = client.post("/v1/completions", json=body)
        assert r.status_code in (200, 400, 404, 413), (body, r.status_code, r.text)
        if r.status_code != 200:
            is_openai_error(r, r.status_code)
    ok(client.get("/health"))
    ok(client.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 1}))


# ------------------------------------------------------------------------------------ live server

from test_runtime_server import Server, _metric  # noqa: E402  (same helpers, same tiny checkpoint)
from moe_runtime.checkpoint_writer import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model = make_checkpoint(tmp_path_factory.mktemp("hard") / "tiny", "deepseek_v3", "nvfp4", "tiny")
    s = Server(model, "--max-batch", "1", "--max-queue", "4", "--max-body-bytes", str(16 * 1024 * 1024),
               tmp=tmp_path_factory.mktemp("hardlog")).wait_ready()
    yield s
    s.stop()


def _labeled(s, series: str) -> float:
    for line in httpx.get(s.url + "/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _running(s) -> float:
    return _metric(s, "moe_runtime_running_requests")


def _wait_idle(s, timeout=20):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if _running(s) == 0 and _metric(s, "moe_runtime_queue_depth") == 0:
            return time.time() - t0
        time.sleep(0.1)
    raise AssertionError("the abandoned request kept its slot: " + s.logs()[-2000:])


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_frees_the_slot(live, stream):
    n = 1000  # the tiny model's context is 1024
    body = {"prompt": "go on", "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream}
    before = _metric(live, "moe_runtime_generation_tokens_total")
    if stream:  # read a few chunks, then hang up
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
    else:  # give up waiting for the whole answer
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(1.5))
    _wait_idle(live)
    generated = _metric(live, "moe_runtime_generation_tokens_total") - before
    assert generated < n / 2, f"{generated} of {n} tokens generated for a client that left"
    # the only slot is free again: a new request is served at once
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "next", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    if not stream:
        t0 = time.time()
        while _labeled(live, 'moe_runtime_requests_total{endpoint="/v1/completions",status="499"}') < 1:
            assert time.time() - t0 < 10, "the abandoned request was not counted as 499"
            time.sleep(0.1)


def test_health_answers_while_a_10mb_prompt_is_tokenized(live):
    """Tokenizing 10 MB takes seconds (10-20 s on a loaded 2-core box); /health keeps answering
    meanwhile. The tokenizer's GIL-held work (the ids list, dropping the Encoding: ~0.6 s) happens
    in its child process (tokenize_worker); what the server still does with the GIL is parse the
    body and render 3.6M ids piece by piece (bench/README.md: max /health 0.05-0.09 s), hence the
    bound: far below the tokenization time, and below a liveness probe's budget on a loaded host."""
    text = "Hello world, the quick brown fox jumps. " * 260_000  # ~10 MB
    gaps: list[float] = []

    async def go():
        async with httpx.AsyncClient(timeout=300) as c:
            t0 = time.perf_counter()
            big = asyncio.ensure_future(c.post(live.url + "/tokenize", json={"prompt": text}))
            big_c = asyncio.ensure_future(c.post(live.url + "/v1/completions", json={"prompt": text}))
            await asyncio.sleep(0.3)
            while not (big.done() and big_c.done()):
                t = time.perf_counter()
                assert (await c.get(live.url + "/health", timeout=30)).status_code == 200
                gaps.append(time.perf_counter() - t)
                await asyncio.sleep(0.05)
            tokenized = await big
            return tokenized, await big_c, time.perf_counter() - t0

    tokenized, refused, took = asyncio.run(go())
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 1_000_000
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert len(gaps) >= 3 and max(gaps) < 2.5 and max(gaps) < took / 3, (took, sorted(gaps)[-5:])


def test_live_body_limit_and_raw_garbage(live):
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:  # a lying Content-Length
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 99999999999\r\n\r\n{}")
        head = s.recv(4096)
    assert b" 413 " in head.split(b"\r\n", 1)[0]

    def chunks():
        yield b'{"prompt": "'
        for _ in range(17):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    r = httpx.post(live.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    for raw in (b"\x00\x01\x02", b'{"prompt": "\xc3\x28"}', b'{"messages": 5}', b"null", b'"str"'):
        r = httpx.post(live.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(live.url + "/health").status_code == 200
    text = httpx.get(live.url + "/metrics").text
    assert 'moe_runtime_requests_total{endpoint="/v1/completions",status="413"}' in text
    assert "/v1/completions/" not in text.replace('"/v1/completions"', "")
