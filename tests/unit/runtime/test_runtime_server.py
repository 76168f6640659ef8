"""HTTP API against live `moe-runtime serve` processes on free ports (tiny NVFP4 DeepSeek-V3,
bf16 activations so the kernels' torch backend and the fused finalize are what answers)."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from moe_runtime.checkpoint_writer import make_checkpoint

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *extra, tmp):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": ":".join(str(ROOT / s) for s in ("operator", "runtime", "kernels"))}
        env.pop("MOE_RUNNER_BACKEND", None)
        env.pop("MOE_DEFERRED_FINALIZE", None)
        self.log = open(tmp / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "moe_runtime.cli", "serve", "--model", str(model),
                                      "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16", "--threads", "1",
                                      *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout=60):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.logs()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("server not ready: " + self.logs())

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("srv") / "tiny-ds-nvfp4", "deepseek_v3", "nvfp4", "tiny")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(model, "--max-batch", "4", "--max-queue", "16", tmp=tmp_path_factory.mktemp("log")).wait_ready()
    yield s
    s.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def sse(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[6:])
    return out


def test_health_ready_models(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(server.url + "/ready").json()
    assert r["ready"] and r["backend"] == "torch" and r["deferredFinalize"] is True and r["format"] == "nvfp4"
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny-ds-nvfp4"


def test_completion(server):
    r = post(server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["prompt_tokens"] > 0
    again = post(server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert again.json()["choices"][0]["text"] == body["choices"][0]["text"]  # greedy is deterministic
    ids = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0.7, "seed": 1})
    assert ids.status_code == 200


def test_chat_and_streaming(server):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi there"}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    full = r.json()
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": msgs, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = sse(s.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}) as s:
        events = sse(s.iter_lines())
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "JSON"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"prompt": [999999]}).encode(), 400, "token ids"),
    (json.dumps({"prompt": "x", "model": "gpt-5"}).encode(), 404, "does not exist"),
    (json.dumps({"prompt": "x", "n": 17}).encode(), 400, "n"),
    (json.dumps({"prompt": ["a", [1]]}).encode(), 400, "prompt"),  # a batch mixes strings and ids
    (json.dumps({"prompt": "x", "logprobs": 6}).encode(), 400, "logprobs"),
    (json.dumps({"prompt": "x", "suffix": "y"}).encode(), 400, "not supported by this server: suffix"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "0 only with echo"),
])
def test_malformed_requests_get_4xx_json(server, body, status, needle):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    bad_chat = post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert bad_chat.status_code == 400
    assert post(server, "/v1/completions", {"prompt": "still serving", "max_tokens": 1}).status_code == 200


def test_concurrent_requests_are_batched(server):
    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"prompt": "Batch me", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*[c.post(server.url + "/v1/completions", json=body) for _ in range(4)])

    before = _metric(server, "moe_runtime_decode_steps_total")
    rs = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs)
    assert len({r.json()["choices"][0]["text"] for r in rs}) == 1
    steps = _metric(server, "moe_runtime_decode_steps_total") - before
    assert steps < 4 * 23, f"{steps} decode steps for 4x24 tokens: requests were not batched"


def _metric(server, name):
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_content(server):
    post(server, "/v1/completions", {"prompt": "count me", "max_tokens": 2})
    text = httpx.get(server.url + "/metrics").text
    for name in ("moe_runtime_requests_total", "moe_runtime_generation_tokens_total", "moe_runtime_prompt_tokens_total",
                 "moe_runtime_request_latency_seconds_bucket", "moe_runtime_time_to_first_token_seconds_count",
                 "moe_runtime_queue_depth", "moe_runtime_running_requests", "moe_runtime_ready 1.0"):
        assert name in text
    assert 'moe_runtime_moe_backend_info{backend="torch",deferred_finalize="true",family="cpu",weight_format="nvfp4"} 1.0' in text
    assert 'moe_runtime_requests_total{endpoint="/v1/completions",status="200"}' in text


def test_overload_answers_429(model, tmp_path):
    s = Server(model, "--max-batch", "1", "--max-queue", "1", tmp=tmp_path).wait_ready()
    try:
        async def go():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": "overload", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*[c.post(s.url + "/v1/completions", json=body) for _ in range(6)])

        codes = sorted(r.status_code for r in asyncio.run(go()))
        assert 429 in codes and 200 in codes, codes
        assert _metric(s, "moe_runtime_rejected_requests_total") >= 1
        assert post(s, "/v1/completions", {"prompt": "after", "max_tokens": 1}).status_code == 200
    finally:
        s.stop()


def test_sigterm_drains_in_flight_then_exits_0(model, tmp_path):
    s = Server(model, "--max-batch", "2", tmp=tmp_path).wait_ready()
    try:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120,
                          json={"prompt": "long", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                                "stream": True}) as st:
            lines = st.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            try:  # new work is refused while draining (or the port is already closed)
                late = httpx.post(s.url + "/v1/completions", json={"prompt": "late", "max_tokens": 1}, timeout=5)
                assert late.status_code == 503
            except httpx.TransportError:
                pass
            rest = sse(lines)
        assert first and rest[-1] == "[DONE]"
        chunks = [json.loads(e) for e in rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(timeout=60) == 0, s.logs()
        assert "drained" in s.logs()
    finally:
        s.stop()


def test_ready_flips_after_loading():
    from fastapi.testclient import TestClient

    from moe_runtime.metrics import Metrics
    from moe_runtime.http.app import create_app
    from moe_runtime.http.state import ServerState

    state = ServerState(model_name="m", metrics=Metrics())
    client = TestClient(create_app(state))
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    state.ready = True
    assert client.get("/ready").status_code == 200
    state.draining = True
    assert client.get("/ready").status_code == 503
