"""OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (SSE streaming or
not), /v1/models, /health, /ready, /metrics.

Errors are OpenAI-shaped JSON: {"error": {"message", "type", "code"}} with 400 for malformed
requests, 429 when the queue is full, 503 while loading or draining.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, field_validator

from .engine import Draining, Finished, QueueFull, Request as EngineRequest, SamplingParams
from .tokenizer import IncrementalDecoder


@dataclass
class ServerState:
    model_name: str
    metrics: Any
    engine: Any = None
    tokenizer: Any = None
    ready: bool = False
    draining: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class _Sampling(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None
    logprobs: int | bool | None = None
    echo: bool = False

    @field_validator("logprobs", "echo")
    @classmethod
    def _unsupported(cls, v, info):
        if v:  # refuse rather than silently ignore what a client relies on
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    def sampling(self, default_max: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_completion_tokens or self.max_tokens or default_max,
                              temperature=self.temperature, top_p=self.top_p, seed=self.seed, ignore_eos=self.ignore_eos)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in (self.stop or []) if s]


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: keep the text parts
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


def error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": code or status}}, status_code=status,
                        headers=headers)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="moe-runtime", docs_url=None, redoc_url=None)
    m = state.metrics

    @app.middleware("http")
    async def count(request: Request, call_next):
        resp = await call_next(request)
        if request.url.path.startswith("/v1/"):
            m.requests.labels(request.url.path, str(resp.status_code)).inc()
        return resp

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:3]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return error(400, "invalid request: " + "; ".join(parts))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.ready and not state.draining:
            return {"ready": True, **state.info}
        return JSONResponse({"ready": False, "draining": state.draining}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "moe-runtime"}]}

    def _check_serving(model: str | None) -> JSONResponse | None:
        if state.draining:
            return error(503, "server is shutting down", "unavailable")
        if not state.ready:
            return error(503, "model is still loading", "unavailable")
        if model is not None and model != state.model_name:
            return error(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                         code="model_not_found")
        return None

    async def _run(prompt_ids: list[int], body: _Sampling, chat: bool):
        loop = asyncio.get_running_loop()
        req = EngineRequest(prompt_ids, body.sampling(16 if not chat else 256), loop, asyncio.Queue())
        try:
            state.engine.submit(req)
        except QueueFull:
            return error(429, "server overloaded: request queue is full, retry later", "rate_limit_exceeded",
                         headers={"Retry-After": "1"})
        except Draining:
            return error(503, "server is shutting down", "unavailable")
        except ValueError as e:
            return error(400, str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        stops = body.stops()
        if body.stream:
            return StreamingResponse(_stream(req, rid, created, chat, stops), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, fin = await _collect(req, stops)
        if fin.reason == "error":
            return error(500, f"generation failed: {fin.error}", "server_error")
        usage = {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
                 "total_tokens": fin.prompt_tokens + fin.completion_tokens}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": fin.reason}
            return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                    "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": fin.reason, "logprobs": None}
        return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": [choice], "usage": usage}

    async def _events(req: EngineRequest, stops: list[str]):
        """(delta text, Finished | None) as tokens arrive; applies stop strings."""
        dec = IncrementalDecoder(state.tokenizer)
        text = ""
        while True:
            item = await req.out.get()
            if isinstance(item, Finished):
                yield "", item
                return
            delta = dec.push(item)
            if stops and delta:
                joined = text + delta
                hit = min((joined.find(s) for s in stops if s in joined), default=-1)
                if hit >= 0:
                    state.engine.cancel(req)
                    yield joined[len(text):hit], None
                    while not isinstance(fin := await req.out.get(), Finished):
                        pass
                    yield "", Finished("stop", fin.prompt_tokens, fin.completion_tokens)
                    return
                text = joined
            yield delta, None

    async def _collect(req, stops):
        parts = []
        async for delta, fin in _events(req, stops):
            parts.append(delta)
            if fin is not None:
                return "".join(parts), fin
        raise RuntimeError("unreachable")

    async def _stream(req, rid, created, chat, stops):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant"} if first else {}
                if delta:
                    d["content"] = delta
                c = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": state.model_name,
                                          "choices": [c]}) + "\n\n"

        try:
            if chat:
                yield chunk(None, None, first=True)
            async for delta, fin in _events(req, stops):
                if fin is not None:
                    if fin.reason == "error":
                        yield "data: " + json.dumps({"error": {"message": f"generation failed: {fin.error}",
                                                               "type": "server_error"}}) + "\n\n"
                    else:
                        yield chunk(None, fin.reason)
                    break
                if delta:
                    yield chunk(delta, None)
            yield "data: [DONE]\n\n"
        finally:  # client went away mid-stream: free the slot
            if not req.done:
                state.engine.cancel(req)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if (resp := _check_serving(body.model)) is not None:
            return resp
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            ids = state.tokenizer.encode(p)
        else:
            vocab = state.engine.model.cfg["vocab_size"]
            if any(t < 0 or t >= vocab for t in p):
                return error(400, f"prompt token ids must be in [0, {vocab})")
            ids = list(p)
        if not ids:
            return error(400, "prompt encodes to zero tokens")
        return await _run(ids, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        if (resp := _check_serving(body.model)) is not None:
            return resp
        try:
            prompt = state.tokenizer.apply_chat_template([{"role": x.role, "content": x.text()} for x in body.messages])
        except Exception as e:
            return error(400, f"cannot apply the chat template: {e}")
        return await _run(state.tokenizer.encode(prompt), body, chat=True)

    return app
