"""Generation output: a request's tokens as text deltas with stop strings applied (`events`), the
whole answer (`collect`), the SSE stream of one or `n` choices (`stream`), and OpenAI logprobs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ..engine import Finished, Request as EngineRequest
from ..stop_strings import StopScanner
from ..tokenizer import IncrementalDecoder
from .state import ServerState


def _lp(x: float) -> float:
    """-inf as the JSON-serializable -9999.0 (vLLM's clamp_prompt_logprobs / _create_completion_logprobs)."""
    return max(x, -9999.0)


def chat_logprobs(tokenizer, lps) -> dict[str, Any]:
    def entry(tid, lp):
        s = tokenizer.token_text(tid)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8", "replace"))}
    return {"content": [{**entry(s.id, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]}
                        for s in lps]}


def completion_logprobs(tokenizer, lps, offset: int = 0, unscored: int | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs of `lps` (sampling.Sampled); `unscored`: a leading token without a
    logprob (the first prompt token when echoing: null entries, as vLLM's _create_completion_logprobs,
    serving_completion.py v0.11.0). top_logprobs holds the token itself and the k most likely (k + 1
    at most, as OpenAI's and vLLM's)."""
    tokens, offsets, values, tops = [], [], [], []
    if unscored is not None:
        tokens.append(tokenizer.token_text(unscored))
        offsets.append(offset)
        values.append(None)
        tops.append(None)
        offset += len(tokens[-1])
    for s in lps:
        offsets.append(offset)
        tokens.append(tokenizer.token_text(s.id))
        offset += len(tokens[-1])
        values.append(_lp(s.logprob))
        d: dict[str, float] = {tokens[-1]: _lp(s.logprob)}
        for t, lp in s.top:  # tokens that print alike share a key: keep the likeliest
            key = tokenizer.token_text(t)
            d[key] = max(d.get(key, -9999.0), _lp(lp))
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(tokenizer, plps) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then {token id: {logprob, rank,
    decoded_token}} with the prompt token first and the k most likely at ranks 1..k
    (vllm/v1/engine/logprobs.py LogprobsProcessor._make_logprob_dict, v0.11.0)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for s in plps:
        d = {str(s.id): {"logprob": _lp(s.logprob), "rank": s.rank, "decoded_token": tokenizer.token_text(s.id)}}
        for j, (t, lp) in enumerate(s.top):
            d[str(t)] = {"logprob": _lp(lp), "rank": j + 1, "decoded_token": tokenizer.token_text(t)}
        out.append(d)
    return out


async def events(state: ServerState, req: EngineRequest, stops: list[str], include_stop_str: bool = False,
                 skip_special_tokens: bool = True):
    """(delta text, Sampled | None, Finished | None) as tokens arrive; applies stop strings. The
    possible start of a stop string is held back (StopScanner); on a match the request is cancelled
    and the tokens up to the one that completed it are counted (vLLM stops right there, so the
    tokens the engine made before the cancel landed are not the client's)."""
    dec = IncrementalDecoder(state.tokenizer, skip_special_tokens)
    scan = StopScanner(stops, include_stop_str) if stops else None
    n = 0  # tokens received (the EOS / stop token is not sent, only counted in Finished)
    while True:
        item = await req.out.get()
        if isinstance(item, Finished):
            tail = dec.flush() if item.reason != "cancelled" else ""
            if scan is not None:
                tail = scan.push(tail) if tail else ""
                if scan.matched is not None:  # completed by the text held back in the decoder
                    yield tail, None, Finished("stop", item.prompt_tokens, item.completion_tokens,
                                               stop_reason=scan.matched)
                    return
                tail += scan.flush()
            yield tail, None, item
            return
        if not isinstance(item, int) and item.stop:  # the EOS / stop token: its logprob, no text
            yield "", item, None
            continue
        n += 1
        lp = None if isinstance(item, int) else item
        delta = dec.push(item if isinstance(item, int) else item.id)
        if scan is not None and delta:
            delta = scan.push(delta)
            if scan.matched is not None:
                state.engine.cancel(req)
                yield delta, lp, None
                while not isinstance(fin := await req.out.get(), Finished):
                    pass
                yield "", None, Finished("stop", fin.prompt_tokens, n, stop_reason=scan.matched)
                return
        yield delta, lp, None


async def collect(state: ServerState, req, stops, include_stop_str: bool = False, skip_special_tokens: bool = True):
    parts, lps = [], []
    async for delta, lp, fin in events(state, req, stops, include_stop_str, skip_special_tokens):
        parts.append(delta)
        if lp is not None:
            lps.append(lp)
        if fin is not None:
            return "".join(parts), lps, fin
    raise RuntimeError("unreachable")


async def stream(state: ServerState, reqs, rid, created, chat, stops, include_usage, include_stop_str: bool = False,
                 skip_special_tokens: bool = True, prompt_n: int | None = None, echo: list[str] | None = None,
                 echo_only: bool = False, logprobs: bool = False):
    """`echo`: each choice's prompt text, sent before its first delta (completions), with the prompt's
    logprobs when `logprobs`; `echo_only` (max_tokens 0): the prompt alone, the generated token dropped
    (vLLM's completion_stream_generator, serving_completion.py v0.11.0). `include_usage`: a bool or
    (include_usage, continuous_usage_stats): the latter puts each choice's running usage on its chunks."""
    include_usage, continuous = include_usage if isinstance(include_usage, tuple) else (include_usage, False)
    obj = "chat.completion.chunk" if chat else "text_completion"
    offsets = [0] * len(reqs)
    ntok = [0] * len(reqs)  # tokens each choice has produced so far (continuous usage)
    echoed = [echo is None] * len(reqs)

    def chunk(i: int, delta: str | None, finish: str | None, lp=None, first: bool = False,
              stop_reason: int | str | None = None) -> str:
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if delta:
                d["content"] = delta
            c = {"index": i, "delta": d, "logprobs": chat_logprobs(state.tokenizer, [lp]) if lp is not None else None,
                 "finish_reason": finish}
        else:
            lps = [lp] if lp is not None else []
            unscored = None
            if not echoed[i]:  # the prompt (and its logprobs) ahead of this first delta
                echoed[i] = True
                delta = echo[i] + (delta or "")
                lps, unscored = [*reqs[i].prompt_logprobs, *lps], reqs[i].prompt_ids[0]
            c = {"index": i, "text": delta or "", "finish_reason": finish,
                 "logprobs": completion_logprobs(state.tokenizer, lps, offsets[i], unscored)
                 if logprobs and (lps or unscored is not None) else None}
            offsets[i] += len(delta or "")
        if finish is not None:
            c["stop_reason"] = stop_reason
        out = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [c]}
        if include_usage:
            p = len(reqs[i].prompt_ids)
            out["usage"] = ({"prompt_tokens": p, "completion_tokens": ntok[i], "total_tokens": p + ntok[i]}
                            if continuous else None)
        return "data: " + json.dumps(out) + "\n\n"

    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, r):
        try:
            async for delta, lp, fin in events(state, r, stops, include_stop_str, skip_special_tokens):
                await q.put((i, delta, lp, fin))
                if fin is not None:
                    return
        except Exception as e:  # noqa: BLE001 - reported in the stream, not lost
            await q.put((i, "", None, Finished("error", len(r.prompt_ids), len(r.generated), repr(e))))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    prompt_n, completion = (len(reqs[0].prompt_ids) if prompt_n is None else prompt_n), 0
    try:
        if chat:
            for i in range(len(reqs)):
                yield chunk(i, None, None, first=True)
        left = len(reqs)
        while left:
            i, delta, lp, fin = await q.get()
            if echo_only:  # the one token generated is not the client's
                delta, lp = "", None
            ntok[i] = fin.completion_tokens if fin is not None else ntok[i] + 1
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
                    yield chunk(i, None, fin.reason, stop_reason=fin.stop_reason)
            elif delta or lp is not None or not echoed[i]:
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
