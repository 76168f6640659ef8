"""OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (SSE streaming or
not, `n` choices, logprobs, `stream_options.include_usage`), /v1/models, /v1/models/{id},
/tokenize, /detokenize, /version, /health, /ready, /metrics.

Every error, the framework's own included (404, 405, bad JSON, invalid UTF-8, a body over the
limit, an unexpected exception), is OpenAI-shaped JSON: {"error": {"message", "type", "param",
"code"}}: 400 for malformed requests and parameters this server does not implement (named),
401 without the `--api-key` bearer token, 404 unknown model or path, 413 body over
`--max-body-bytes`, 429 queue full, 503 while loading or draining, 500 otherwise.

The event loop never runs a long computation: tokenizing (which releases the GIL) and chat
templating run in worker threads, a text of 256K characters or more in the tokenizer's child
process (what tokenizers does with the GIL held grows with the tokens: 0.6 s for 10 MB), and a
prompt that cannot fit the context is refused from its length before it is tokenized. A client
that disconnects, streaming or not, has its sequences cancelled (their batch slots freed at the
next step). Metric labels are route templates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import __version__
from .engine import Draining, Finished, QueueFull, Request as EngineRequest, SamplingParams
from .tokenize_worker import LONG_TEXT_CHARS
from .tokenizer import IncrementalDecoder

MAX_N = 16  # choices per request
MAX_STOP = 16  # stop strings / stop token ids per request
MAX_LOGPROBS = 20
_JSON_PIECE = 65536  # token ids rendered per event-loop turn in a long /tokenize answer


@dataclass
class ServerOptions:
    """HTTP-layer settings from the serve flags (flags.server_options), given to ServerState."""

    api_key: str | None = None  # Bearer token for /v1/*, /tokenize, /detokenize (None: open)
    max_body_bytes: int = 32 * 1024 * 1024


@dataclass
class ServerState:
    model_name: str
    metrics: Any
    engine: Any = None
    tokenizer: Any = None
    ready: bool = False
    draining: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    options: ServerOptions = field(default_factory=ServerOptions)
    long_encoder: Any = None  # tokenize_worker.LongEncoder (serve sets it): long texts off the GIL


# ---------------------------------------------------------------------------------------- errors

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_exceeded",
          499: "client_closed_request", 500: "server_error", 503: "unavailable"}


def error(status: int, message: str, type_: str | None = None, code: str | int | None = None,
          headers: dict[str, str] | None = None, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_ or _TYPES.get(status, "server_error" if status >= 500
                                                                       else "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status, headers=headers)


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than this server's limit of {limit} bytes")


class _Guard:
    """Pure ASGI middleware around the app: API key, body-size limit (413, whether or not the
    client sent Content-Length), a JSON 500 for any exception, and request/error metrics labelled
    by route template (never the raw path)."""

    PUBLIC = ("/health", "/ready", "/metrics", "/version")

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        opts, m = self.state.options, self.state.metrics
        status: list[int] = []

        async def send_(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        async def respond(resp: Response):
            await resp(scope, receive, send_)

        try:
            if opts.api_key and scope["path"] not in self.PUBLIC and not self._authorized(scope, opts.api_key):
                await respond(error(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                return
            limit = opts.max_body_bytes
            length = self._header(scope, b"content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                await respond(error(413, _BodyTooLarge(limit).detail) if length.isdigit()
                              else error(400, f"invalid Content-Length header {length!r}"))
                return
            seen = 0

            async def receive_():
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > limit:
                        raise _BodyTooLarge(limit)
                return message

            await self.app(scope, receive_, send_)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the client gets JSON, not a traceback
            from .log import log

            log("http_error", f"{scope.get('method')} {self._route(scope)}: {type(e).__name__}: {e}")
            if not status:
                await respond(error(500, f"internal server error: {type(e).__name__}", "server_error"))
        finally:
            code = status[0] if status else 499  # no response at all: the client went away
            route = self._route(scope)
            m.requests.labels(route, str(code)).inc()
            if code >= 400:
                m.errors.labels(route, _TYPES.get(code, "server_error" if code >= 500 else "invalid_request_error")).inc()

    @staticmethod
    def _header(scope, name: bytes) -> str | None:
        for k, v in scope.get("headers", ()):
            if k.lower() == name:
                return v.decode("latin-1").strip()
        return None

    def _authorized(self, scope, key: str) -> bool:
        auth = self._header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    @staticmethod
    def _route(scope) -> str:
        route = scope.get("route")
        return getattr(route, "path", None) or "unmatched"


# ---------------------------------------------------------------------------------------- bodies

# Parameters of the OpenAI API this server does not implement, with the values that mean "not
# used" (accepted). Anything else set is refused with 400 naming the parameter, never ignored.
_UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "best_of": (None, 1),
    "suffix": (None, ""), "echo": (None, False), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,), "store": (None, False),
    "metadata": (None, {}), "service_tier": (None, "auto", "default"), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,), "prompt_logprobs": (None,),
    "use_beam_search": (None, False), "length_penalty": (None, 1.0), "include_stop_str_in_output": (None, False),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP)
    min_tokens: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    ignore_eos: bool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    def max_new(self, default_max: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default_max

    def top_logprobs_k(self) -> int | None:  # None: no logprobs asked (the subclasses' fields)
        return None

    def sampling(self, default_max: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_new(default_max), temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            ignore_eos=self.ignore_eos, top_k=max(self.top_k, 0), min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens, logprobs=self.top_logprobs_k())

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in (self.stop or []) if s]


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], (str, list)) and len(v) != 1:
            raise ValueError("batched prompts are not supported; send one prompt per request")
        if isinstance(v, list) and isinstance(v[0], list) and not v[0]:
            raise ValueError("prompt must not be empty")
        return v

    def top_logprobs_k(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text", ""), str):
                    raise ValueError(f"content part type {part.get('type')!r} is not supported "
                                     "(this server takes text parts only)")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v):
        if v:
            raise ValueError("tool_calls are not supported by this server")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: the text parts
            return "".join(p.get("text", "") for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            return None  # refused in _refusal
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def _bad_unicode(obj: Any, path: str = "") -> str | None:
    """The first string (by path) that is not valid Unicode (a lone surrogate from a \\ud800 escape)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        if (bad := _bad_unicode(v, f"{path}.{k}" if path else str(k))) is not None:
            return bad
    return None


def _refusal(body: _Sampling, vocab: int) -> JSONResponse | None:
    """400 for what is set but not implemented, unknown, or inconsistent; None when acceptable."""
    extra = body.model_extra or {}
    unimpl = [k for k, v in extra.items() if k in _UNIMPLEMENTED and v not in _UNIMPLEMENTED[k]]
    if unimpl:
        return error(400, f"parameter(s) not supported by this server: {', '.join(unimpl)}", param=unimpl[0],
                     code="unsupported_parameter")
    unknown = [k for k in extra if k not in _UNIMPLEMENTED]
    if unknown:
        return error(400, f"unknown parameter(s): {', '.join(unknown)}", param=unknown[0], code="unknown_parameter")
    if (bad := _bad_unicode(body.model_dump())) is not None:
        return error(400, f"invalid Unicode in {bad} (a lone surrogate)", param=bad)
    if body.stream_options is not None and not body.stream:
        return error(400, "stream_options is only allowed with stream=true", param="stream_options")
    if isinstance(body, ChatRequest) and body.top_logprobs is not None and not body.logprobs:
        return error(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    bad_ids = [t for t in body.stop_token_ids or () if not 0 <= t < vocab]
    if bad_ids:
        return error(400, f"stop_token_ids must be in [0, {vocab}); got {bad_ids[0]}", param="stop_token_ids")
    return None


# ---------------------------------------------------------------------------------------- the app

def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="moe-runtime", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        parts, first = [], None
        for e in exc.errors()[:3]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            if e.get("type") == "json_invalid":
                ctx = (e.get("ctx") or {}).get("error", "")
                parts.append(f"body is not valid JSON ({ctx}) at position {loc}")
                continue
            first = first or loc or None
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return error(400, "invalid request: " + "; ".join(parts), param=first)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = str(exc.detail)
        if exc.status_code == 404 and msg == "Not Found":
            msg = f"no such endpoint: {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
            msg = f"request body is not valid UTF-8 (byte {exc.__cause__.start})"
        elif exc.status_code == 400 and msg == "There was an error parsing the body":
            msg = "cannot parse the request body as JSON" + (f" ({exc.__cause__})" if exc.__cause__ else "")
        return error(exc.status_code, msg, headers=getattr(exc, "headers", None))

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
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def _max_len() -> int | None:
        return state.engine.max_len if state.engine is not None else None

    def _model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "moe-runtime",
                "root": state.model_name, "max_model_len": _max_len()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            return error(404, f"model {model_id!r} does not exist; this server serves {state.model_name!r}",
                         code="model_not_found", param="model")
        return _model_card()

    def _check_serving(model: str | None) -> JSONResponse | None:
        if state.draining:
            return error(503, "server is shutting down")
        if not state.ready:
            return error(503, "model is still loading")
        if model is not None and model != state.model_name:
            return error(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                         code="model_not_found", param="model")
        return None

    def _vocab() -> int:
        if state.engine is not None:
            return int(state.engine.model.cfg["vocab_size"])
        return state.tokenizer.vocab_size

    def _too_long(n_chars: int, param: str) -> JSONResponse | None:
        """Refuse, from its length alone, a text that cannot fit the context (no tokenizing)."""
        max_len = _max_len()
        if max_len is not None and n_chars // state.tokenizer.max_token_chars + 1 > max_len:
            return error(400, f"{param} has at least {n_chars // state.tokenizer.max_token_chars} tokens; this "
                         f"server's context is {max_len}", param=param, code="context_length_exceeded")
        return None

    async def _chat_prompt(messages: list[ChatMessage]) -> str | JSONResponse:
        try:
            return await asyncio.to_thread(state.tokenizer.apply_chat_template,
                                           [{"role": x.role, "content": x.text()} for x in messages])
        except Exception as e:  # a template that raises on this conversation
            return error(400, f"cannot apply the chat template: {e}", param="messages")

    async def _disconnected(request: Request) -> None:
        """Returns when the client goes away (the body has been read already)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _run(request: Request, prompt_ids: list[int], body: _Sampling, chat: bool):
        loop = asyncio.get_running_loop()
        params = body.sampling(16 if not chat else 256)
        if params.min_tokens > params.max_tokens:
            return error(400, f"min_tokens ({params.min_tokens}) is larger than max_tokens ({params.max_tokens})",
                         param="min_tokens")
        max_queue = getattr(state.engine, "max_queue", None)
        if max_queue is not None and body.n > max_queue:  # would be 429 forever, however often retried
            return error(400, f"n={body.n} is more than this server's request queue ({max_queue})", param="n")
        reqs: list[EngineRequest] = []
        for i in range(body.n):
            p = params if params.seed is None or i == 0 else dataclasses.replace(
                params, seed=(params.seed + i) % (2**63))
            req = EngineRequest(prompt_ids, p, loop, asyncio.Queue())
            try:
                state.engine.submit(req)
            except (QueueFull, Draining, ValueError) as e:
                for r in reqs:
                    state.engine.cancel(r)
                if isinstance(e, QueueFull):
                    return error(429, "server overloaded: request queue is full, retry later",
                                 headers={"Retry-After": "1"})
                if isinstance(e, Draining):
                    return error(503, "server is shutting down")
                return error(400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded")
            reqs.append(req)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        stops = body.stops()
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(reqs, rid, created, chat, stops, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        gather = asyncio.ensure_future(asyncio.gather(*[_collect(r, stops) for r in reqs]))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not gather.done():  # the client left (or this task was cancelled): free the slots
                gather.cancel()
            for r in reqs:
                if not r.done:
                    state.engine.cancel(r)
        if not gather.done() or gather.cancelled():
            return Response(status_code=499)
        results = gather.result()
        failed = [fin for _, _, fin in results if fin.reason == "error"]
        if failed:
            return error(500, f"generation failed: {failed[0].error}", "server_error")
        completion = sum(fin.completion_tokens for _, _, fin in results)
        prompt_n = results[0][2].prompt_tokens
        usage = {"prompt_tokens": prompt_n, "completion_tokens": completion, "total_tokens": prompt_n + completion}
        choices = []
        for i, (text, lps, fin) in enumerate(results):
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": _chat_logprobs(lps) if params.logprobs is not None else None,
                                "finish_reason": fin.reason})
            else:
                choices.append({"index": i, "text": text, "finish_reason": fin.reason,
                                "logprobs": _completion_logprobs(lps) if params.logprobs is not None else None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": state.model_name, "choices": choices, "usage": usage}

    def _tok_str(tid: int) -> str:
        return state.tokenizer.token_text(tid)

    def _chat_logprobs(lps) -> dict[str, Any]:
        def entry(tid, lp):
            s = _tok_str(tid)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
        return {"content": [{**entry(s.id, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]}
                            for s in lps]}

    def _completion_logprobs(lps, offset: int = 0) -> dict[str, Any]:
        tokens, offsets = [], []
        for s in lps:
            offsets.append(offset)
            tokens.append(_tok_str(s.id))
            offset += len(tokens[-1])
        def top(s):  # tokens that print alike share a key: keep the likeliest
            d: dict[str, float] = {}
            for t, lp in s.top:
                d.setdefault(_tok_str(t), lp)
            return d

        return {"tokens": tokens, "token_logprobs": [s.logprob for s in lps], "top_logprobs": [top(s) for s in lps],
                "text_offset": offsets}

    async def _events(req: EngineRequest, stops: list[str]):
        """(delta text, Sampled | None, Finished | None) as tokens arrive; applies stop strings."""
        dec = IncrementalDecoder(state.tokenizer)
        text = ""
        while True:
            item = await req.out.get()
            if isinstance(item, Finished):
                tail = dec.flush() if item.reason != "cancelled" else ""
                if stops and tail:  # a stop string completed by the held-back text
                    joined = text + tail
                    hit = min((joined.find(s) for s in stops if s in joined), default=-1)
                    if hit >= 0:
                        yield joined[len(text):hit], None, Finished("stop", item.prompt_tokens, item.completion_tokens)
                        return
                yield tail, None, item
                return
            lp = None if isinstance(item, int) else item
            delta = dec.push(item if isinstance(item, int) else item.id)
            if stops and delta:
                joined = text + delta
                hit = min((joined.find(s) for s in stops if s in joined), default=-1)
                if hit >= 0:
                    state.engine.cancel(req)
                    yield joined[len(text):hit], lp, None
                    while not isinstance(fin := await req.out.get(), Finished):
                        pass
                    yield "", None, Finished("stop", fin.prompt_tokens, fin.completion_tokens)
                    return
                text = joined
            yield delta, lp, None

    async def _collect(req, stops):
        parts, lps = [], []
        async for delta, lp, fin in _events(req, stops):
            parts.append(delta)
            if lp is not None:
                lps.append(lp)
            if fin is not None:
                return "".join(parts), lps, fin
        raise RuntimeError("unreachable")

    async def _stream(reqs, rid, created, chat, stops, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"
        offsets = [0] * len(reqs)

        def chunk(i: int, delta: str | None, finish: str | None, lp=None, first: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if delta:
                    d["content"] = delta
                c = {"index": i, "delta": d, "logprobs": _chat_logprobs([lp]) if lp is not None else None,
                     "finish_reason": finish}
            else:
                c = {"index": i, "text": delta or "", "finish_reason": finish,
                     "logprobs": _completion_logprobs([lp], offsets[i]) if lp is not None else None}
                offsets[i] += len(delta or "")
            out = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [c]}
            if include_usage:
                out["usage"] = None
            return "data: " + json.dumps(out) + "\n\n"

        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, r):
            try:
                async for delta, lp, fin in _events(r, stops):
                    await q.put((i, delta, lp, fin))
                    if fin is not None:
                        return
            except Exception as e:  # noqa: BLE001 - reported in the stream, not lost
                await q.put((i, "", None, Finished("error", len(r.prompt_ids), len(r.generated), repr(e))))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        prompt_n, completion = len(reqs[0].prompt_ids), 0
        try:
            if chat:
                for i in range(len(reqs)):
                    yield chunk(i, None, None, first=True)
            left = len(reqs)
            while left:
                i, delta, lp, fin = await q.get()
                if fin is not None and delta and fin.reason != "error":
                    yield chunk(i, delta, None)  # the text held back until the end
                if fin is not None:
                    left -= 1
                    completion += fin.completion_tokens
                    if fin.reason == "error":
                        state.metrics.errors.labels("/v1/chat/completions" if chat else "/v1/completions",
                                                    "server_error").inc()
                        yield "data: " + json.dumps({"error": {"message": f"generation failed: {fin.error}",
                                                               "type": "server_error", "param": None,
                                                               "code": 500}}) + "\n\n"
                    else:
                        yield chunk(i, None, fin.reason)
                elif delta or lp is not None:
                    yield chunk(i, delta, None, lp)
            if include_usage:
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": state.model_name,
                                             "choices": [], "usage": {"prompt_tokens": prompt_n,
                                                                      "completion_tokens": completion,
                                                                      "total_tokens": prompt_n + completion}}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:  # client went away mid-stream: free the slots
            for t in tasks:
                t.cancel()
            for r in reqs:
                if not r.done:
                    state.engine.cancel(r)

    async def _encode(text: str, packed: bool = False):
        """Token ids of `text`, in a worker thread; a long text in the tokenizer's child process
        (tokenize_worker: the GIL stays free), as an array('I') with `packed` (for /tokenize's JSON)."""
        if state.long_encoder is not None and len(text) >= LONG_TEXT_CHARS:
            ids = await asyncio.to_thread(state.long_encoder.encode, text)
            return ids if packed else await asyncio.to_thread(ids.tolist)
        return await asyncio.to_thread(state.tokenizer.encode, text)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (resp := _check_serving(body.model)) is not None:
            return resp
        if (resp := _refusal(body, _vocab())) is not None:
            return resp
        p = body.prompt
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            if (resp := _too_long(len(p), "prompt")) is not None:
                return resp
            ids = await _encode(p)
        else:
            vocab = _vocab()
            if any(t < 0 or t >= vocab for t in p):
                return error(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = list(p)
        if not ids:
            return error(400, "prompt encodes to zero tokens", param="prompt")
        return await _run(request, ids, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if (resp := _check_serving(body.model)) is not None:
            return resp
        if (resp := _refusal(body, _vocab())) is not None:
            return resp
        if (resp := _too_long(sum(len(m.text()) for m in body.messages), "messages")) is not None:
            return resp
        prompt = await _chat_prompt(body.messages)
        if isinstance(prompt, JSONResponse):
            return prompt
        return await _run(request, await _encode(prompt), body, chat=True)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None and body.model != state.model_name:
            return error(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                         code="model_not_found", param="model")
        if (body.prompt is None) == (body.messages is None):
            return error(400, "send exactly one of prompt or messages", param="prompt")
        if (bad := _bad_unicode(body.model_dump())) is not None:
            return error(400, f"invalid Unicode in {bad} (a lone surrogate)", param=bad)
        if body.messages is not None:
            text = await _chat_prompt(body.messages)
            if isinstance(text, JSONResponse):
                return text
        else:
            text = body.prompt
        ids = await _encode(text, packed=True)
        head = {"count": len(ids), "max_model_len": _max_len()}
        if len(ids) <= _JSON_PIECE:
            return {**head, "tokens": list(ids)}

        async def pieces():  # millions of ids: rendered piece by piece, the event loop keeps serving
            yield json.dumps(head)[:-1] + ', "tokens": ['
            for i in range(0, len(ids), _JSON_PIECE):
                yield ("," if i else "") + ",".join(map(str, ids[i:i + _JSON_PIECE]))
                await asyncio.sleep(0)
            yield "]}"

        return StreamingResponse(pieces(), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None and body.model != state.model_name:
            return error(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                         code="model_not_found", param="model")
        vocab = _vocab()
        if any(t < 0 or t >= vocab for t in body.tokens):
            return error(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens)}

    app.add_middleware(_Guard, state=state)
    return app
