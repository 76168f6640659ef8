"""Generation output: a request's tokens as text deltas with stop strings applied (`events`), the
whole answer (`collect`), the SSE stream of one or `n` choices (`stream`), and OpenAI logprobs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ..engine import Finished, Request as EngineRequest
from ..tokenizer import IncrementalDecoder
from .state import ServerState


def chat_logprobs(tokenizer, lps) -> dict[str, Any]:
    def entry(tid, lp):
        s = tokenizer.token_text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
    return {"content": [{**entry(s.id, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]}
                        for s in lps]}


def completion_logprobs(tokenizer, lps, offset: int = 0) -> dict[str, Any]:
    tokens, offsets = [], []
    for s in lps:
        offsets.append(offset)
        tokens.append(tokenizer.token_text(s.id))
        offset += len(tokens[-1])
    def top(s):  # tokens that print alike share a key: keep the likeliest
        d: dict[str, float] = {}
        for t, lp in s.top:
            d.setdefault(tokenizer.token_text(t), lp)
        return d

    return {"tokens": tokens, "token_logprobs": [s.logprob for s in lps], "top_logprobs": [top(s) for s in lps],
            "text_offset": offsets}


async def events(state: ServerState, req: EngineRequest, stops: list[str]):
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


async def collect(state: ServerState, req, stops):
    parts, lps = [], []
    async for delta, lp, fin in events(state, req, stops):
        parts.append(delta)
        if lp is not None:
            lps.append(lp)
        if fin is not None:
            return "".join(parts), lps, fin
    raise RuntimeError("unreachable")


async def stream(state: ServerState, reqs, rid, created, chat, stops, include_usage):
    obj = "chat.completion.chunk" if chat else "text_completion"
    offsets = [0] * len(reqs)

    def chunk(i: int, delta: str | None, finish: str | None, lp=None, first: bool = False) -> str:
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if delta:
                d["content"] = delta
            c = {"index": i, "delta": d, "logprobs": chat_logprobs(state.tokenizer, [lp]) if lp is not None else None,
                 "finish_reason": finish}
        else:
            c = {"index": i, "text": delta or "", "finish_reason": finish,
                 "logprobs": completion_logprobs(state.tokenizer, [lp], offsets[i]) if lp is not None else None}
            offsets[i] += len(delta or "")
        out = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [c]}
        if include_usage:
            out["usage"] = None
        return "data: " + json.dumps(out) + "\n\n"

    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, r):
        try:
            async for delta, lp, fin in events(state, r, stops):
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
