"""The OpenAI-compatible app: /v1/completions, /v1/chat/completions (SSE streaming or not, `n`
choices, logprobs, `stream_options.include_usage`), /v1/models, /v1/models/{id}, /tokenize,
/detokenize, /version, /health, /ready, /metrics; each route a named handler, the serving state
on `app.state.server`.

Every error, the framework's own included (404, 405, bad JSON, invalid UTF-8, a body over the
limit, an unexpected exception), is OpenAI-shaped JSON: 400 for malformed requests and parameters
this server does not implement (named), 401 without the `--api-key` bearer token, 404 unknown model
or path, 413 body over `--max-body-bytes`, 429 queue full, 503 while loading or draining, 500
otherwise.

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
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine import Draining, QueueFull, Request as EngineRequest
from ..tokenize_worker import LONG_TEXT_CHARS
from .guard import Guard
from .protocol import (ChatMessage, ChatRequest, CompletionRequest, DetokenizeRequest, Sampling, TokenizeRequest,
                       bad_unicode, context_overflow, default_max_tokens, error, refusal)
from .state import ServerState
from .streaming import chat_logprobs, collect, completion_logprobs, prompt_logprobs_json, stream

_JSON_PIECE = 65536  # token ids rendered per event-loop turn in a long /tokenize answer


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def invalid_request(_: Request, exc: RequestValidationError):
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


async def http_error(request: Request, exc: StarletteHTTPException):
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


async def health():
    return {"status": "ok"}


async def ready(request: Request):
    state = _state(request)
    if state.ready and not state.draining:
        return {"ready": True, **state.info}
    return JSONResponse({"ready": False, "draining": state.draining}, status_code=503)


async def metrics(request: Request):
    state = _state(request)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def version():
    return {"version": __version__}


def _max_len(state: ServerState) -> int | None:
    return state.engine.max_len if state.engine is not None else None


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "moe-runtime",
            "root": state.model_name, "max_model_len": _max_len(state)}


async def models(request: Request):
    state = _state(request)
    return {"object": "list", "data": [_model_card(state)]}


async def model(model_id: str, request: Request):
    state = _state(request)
    if model_id != state.model_name:
        return error(404, f"model {model_id!r} does not exist; this server serves {state.model_name!r}",
                     code="model_not_found", param="model")
    return _model_card(state)


def _check_serving(state: ServerState, model: str | None) -> JSONResponse | None:
    if state.draining:
        return error(503, "server is shutting down")
    if not state.ready:
        return error(503, "model is still loading")
    if model is not None and model != state.model_name:
        return error(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                     code="model_not_found", param="model")
    return None


def _vocab(state: ServerState) -> int:
    if state.engine is not None:
        return int(state.engine.model.cfg["vocab_size"])
    return state.tokenizer.vocab_size


def _too_long(state: ServerState, n_chars: int, param: str) -> JSONResponse | None:
    """Refuse, from its length alone, a text that cannot fit the context (no tokenizing)."""
    max_len = _max_len(state)
    if max_len is not None and n_chars // state.tokenizer.max_token_chars + 1 > max_len:
        return error(400, f"{param} has at least {n_chars // state.tokenizer.max_token_chars} tokens; this "
                     f"server's context is {max_len}", param=param, code="context_length_exceeded")
    return None


async def _chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       template_kwargs: dict[str, Any] | None = None) -> str | JSONResponse:
    try:
        return await asyncio.to_thread(state.tokenizer.apply_chat_template,
                                       [{"role": x.role, "content": x.text()} for x in messages],
                                       add_generation_prompt, continue_final_message, template_kwargs)
    except Exception as e:  # a template that raises on this conversation
        return error(400, f"cannot apply the chat template: {e}", param="messages")


def _retrieve(fut: asyncio.Future) -> None:
    try:
        fut.exception()
    except BaseException:  # noqa: BLE001 - CancelledError is what a cancelled gather holds
        pass


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _run(state: ServerState, request: Request, prompts: list[list[int]], body: Sampling, chat: bool,
               texts: list[str] | None = None):
    """One engine request per (prompt, choice); a batched prompt's choices are numbered
    prompt * n + choice (vLLM's serving_completion). `texts`: each prompt as text, for echo."""
    loop = asyncio.get_running_loop()
    max_len = _max_len(state)
    asked = body.max_completion_tokens or body.max_tokens
    per_prompt = []
    for prompt_ids in prompts:
        if (why := context_overflow(len(prompt_ids), asked, max_len)) is not None:
            long_prompt = max_len is not None and len(prompt_ids) >= max_len
            param = ("messages" if chat else "prompt") if long_prompt else (
                "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
            return error(400, why, param=param, code="context_length_exceeded")
        params = body.sampling(default_max_tokens(chat, len(prompt_ids), max_len))
        if params.min_tokens > params.max_tokens:
            return error(400, f"min_tokens ({params.min_tokens}) is larger than max_tokens ({params.max_tokens})",
                         param="min_tokens")
        per_prompt.append((prompt_ids, params))
    max_queue = getattr(state.engine, "max_queue", None)
    if max_queue is not None and body.n * len(prompts) > max_queue:  # would be 429 forever, however often retried
        return error(400, f"n={body.n} x {len(prompts)} prompt(s) is more than this server's request queue "
                     f"({max_queue})", param="n")
    reqs: list[EngineRequest] = []
    echo = None
    if getattr(body, "echo", False):  # each choice's prompt text (vLLM detokenizes a token-id prompt)
        echo = [t if t is not None else await asyncio.to_thread(state.tokenizer.decode, p)
                for p, t in zip(prompts, texts or [None] * len(prompts)) for _ in range(body.n)]
    for prompt_ids, params in per_prompt:
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
    prompt_n = sum(len(p) for p in prompts)
    rid = ("chatcmpl-" if chat else "cmpl-") + (body.request_id or uuid.uuid4().hex[:24])
    created = int(time.time())
    stops = body.stops()
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        continuous = usage and body.stream_options.continuous_usage_stats
        return StreamingResponse(stream(state, reqs, rid, created, chat, stops, (usage, continuous),
                                        body.include_stop_str_in_output, body.skip_special_tokens, prompt_n,
                                        echo, getattr(body, "echo_only", False), params.logprobs is not None),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    gather = asyncio.ensure_future(asyncio.gather(*[collect(state, r, stops, body.include_stop_str_in_output, body.skip_special_tokens) for r in reqs]))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not gather.done():  # the client left (or this task was cancelled): free the slots
            gather.cancel()
            # its CancelledError is expected: retrieved, or asyncio logs "exception was never retrieved"
            gather.add_done_callback(_retrieve)
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
    usage = {"prompt_tokens": prompt_n, "completion_tokens": completion, "total_tokens": prompt_n + completion}
    choices = []
    plps = [prompt_logprobs_json(state.tokenizer, r.prompt_logprobs) if r.params.prompt_logprobs is not None
            else None for r in reqs]
    for i, ((text, lps, fin), r) in enumerate(zip(results, reqs)):
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": chat_logprobs(state.tokenizer, lps) if params.logprobs is not None else None,
                            "finish_reason": fin.reason, "stop_reason": fin.stop_reason})
            continue
        unscored = None
        if echo is not None:  # vLLM's request_output_to_completion_response (serving_completion.py v0.11.0)
            if body.echo_only:
                text, lps = "", []
            text, lps, unscored = echo[i] + text, [*r.prompt_logprobs, *lps], r.prompt_ids[0]
        choices.append({"index": i, "text": text, "finish_reason": fin.reason, "stop_reason": fin.stop_reason,
                        "logprobs": completion_logprobs(state.tokenizer, lps, 0, unscored)
                        if params.logprobs is not None else None, "prompt_logprobs": plps[i]})
    out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
           "model": state.model_name, "choices": choices, "usage": usage}
    if chat:  # vLLM's ChatCompletionResponse.prompt_logprobs (the prompt is the same for every choice)
        out["prompt_logprobs"] = plps[0]
    return out


async def _encode(state: ServerState, text: str, packed: bool = False, add_special_tokens: bool = False):
    """Token ids of `text`, in a worker thread; a long text in the tokenizer's child process
    (tokenize_worker: the GIL stays free), as an array('I') with `packed` (for /tokenize's JSON).
    `add_special_tokens`: vLLM's field (true by default for completions and /tokenize, false for chat,
    whose template writes them)."""
    if state.long_encoder is not None and len(text) >= LONG_TEXT_CHARS:
        ids = await asyncio.to_thread(state.long_encoder.encode, text, add_special_tokens)
        return ids if packed else await asyncio.to_thread(ids.tolist)
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens)


async def completions(body: CompletionRequest, request: Request):
    state = _state(request)
    if (resp := _check_serving(state, body.model)) is not None:
        return resp
    if (resp := refusal(body, _vocab(state))) is not None:
        return resp
    batch = body.prompt if isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list)) else [body.prompt]
    prompts = []
    texts = [p if isinstance(p, str) else None for p in batch]
    for p in batch:
        if isinstance(p, str):
            if (resp := _too_long(state, len(p), "prompt")) is not None:
                return resp
            ids = await _encode(state, p, add_special_tokens=body.add_special_tokens)
        else:
            vocab = _vocab(state)
            if any(t < 0 or t >= vocab for t in p):
                return error(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = list(p)
        if not ids:
            return error(400, "prompt encodes to zero tokens", param="prompt")
        prompts.append(ids)
    return await _run(state, request, prompts, body, chat=False, texts=texts)


async def chat(body: ChatRequest, request: Request):
    state = _state(request)
    if (resp := _check_serving(state, body.model)) is not None:
        return resp
    if (resp := refusal(body, _vocab(state))) is not None:
        return resp
    if (resp := _too_long(state, sum(len(m.text()) for m in body.messages), "messages")) is not None:
        return resp
    prompt = await _chat_prompt(state, body.messages, body.add_generation_prompt, body.continue_final_message,
                                body.chat_template_kwargs)
    if isinstance(prompt, JSONResponse):
        return prompt
    return await _run(state, request, [await _encode(state, prompt, add_special_tokens=body.add_special_tokens)], body,
                      chat=True)


async def tokenize(body: TokenizeRequest, request: Request):
    state = _state(request)
    if body.model is not None and body.model != state.model_name:
        return error(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                     code="model_not_found", param="model")
    if (body.prompt is None) == (body.messages is None):
        return error(400, "send exactly one of prompt or messages", param="prompt")
    if (bad := bad_unicode(body.model_dump())) is not None:
        return error(400, f"invalid Unicode in {bad} (a lone surrogate)", param=bad)
    if body.messages is not None:
        text = await _chat_prompt(state, body.messages, body.add_generation_prompt)
        if isinstance(text, JSONResponse):
            return text
    else:
        text = body.prompt
    # vLLM's defaults: specials added for a prompt, not for messages (TokenizeCompletionRequest / TokenizeChatRequest)
    special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
    ids = await _encode(state, text, packed=True, add_special_tokens=special)
    head = {"count": len(ids), "max_model_len": _max_len(state)}
    if body.return_token_strs and len(ids) <= _JSON_PIECE:
        head["token_strs"] = await asyncio.to_thread(lambda: [state.tokenizer.token_text(t) for t in ids])
    if len(ids) <= _JSON_PIECE:
        return {**head, "tokens": list(ids)}

    async def pieces():  # millions of ids: rendered piece by piece, the event loop keeps serving
        yield json.dumps(head)[:-1] + ', "tokens": ['
        for i in range(0, len(ids), _JSON_PIECE):
            yield ("," if i else "") + ",".join(map(str, ids[i:i + _JSON_PIECE]))
            await asyncio.sleep(0)
        yield "]}"

    return StreamingResponse(pieces(), media_type="application/json")


async def tokenizer_info(request: Request):
    """vLLM's /tokenizer_info (serving_tokenization.py TokenizerInfo._get_tokenizer_config, v0.11.0):
    the tokenizer's config without file paths, its class and the chat template in use."""
    tok = _state(request).tokenizer
    cfg = {k: v for k, v in tok.config.items() if k not in ("vocab_file", "merges_file")}
    cfg.update(tok.special_tokens)  # as text ({"content": ...} objects flattened, as vLLM's serializer does)
    cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    return cfg


async def detokenize(body: DetokenizeRequest, request: Request):
    state = _state(request)
    if body.model is not None and body.model != state.model_name:
        return error(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                     code="model_not_found", param="model")
    vocab = _vocab(state)
    if any(t < 0 or t >= vocab for t in body.tokens):
        return error(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens)}


_ROUTES = (("GET", "/health", health), ("GET", "/ready", ready), ("GET", "/metrics", metrics),
           ("GET", "/version", version), ("GET", "/v1/models", models), ("GET", "/v1/models/{model_id:path}", model),
           ("POST", "/v1/completions", completions), ("POST", "/v1/chat/completions", chat),
           ("POST", "/tokenize", tokenize), ("POST", "/detokenize", detokenize))


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="moe-runtime", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for method, path, handler in _ROUTES:
        app.add_api_route(path, handler, methods=[method])
    if state.options.tokenizer_info:
        app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])
    app.add_middleware(Guard, state=state)
    return app
