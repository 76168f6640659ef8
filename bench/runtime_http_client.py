"""One client process of bench_runtime.py's HTTP runs: streams completions through the real openai
SDK and records, per stream, when it was sent and the running completion-token count of every
chunk (stream_options continuous_usage_stats), on the host-wide monotonic clock so that the
parent can merge several processes (one Python process parsing 64 streams would be the bottleneck).

  python bench/runtime_http_client.py URL MODEL   # prints "ready", then for each job line on stdin
                                                 # prints one result line
job: {"max_tokens": N, "prompts": [[token ids], ...]}; result: [{"sent": t, "chunks": [[t, n], ...]}]
One process serves every burst against one server: its start-up (Python, the SDK's imports: seconds
on a busy host) is paid once.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import openai


async def one(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> dict:
    sent = time.monotonic()
    chunks: list[list[float]] = []
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    seen = 0
    async for ch in stream:
        n = ch.usage.completion_tokens if ch.usage is not None else seen + bool(ch.choices)
        if n > seen:
            chunks.append([time.monotonic(), n])
            seen = n
    return {"sent": sent, "chunks": chunks}


async def run(url: str, model: str, job: dict) -> list[dict]:
    n = len(job["prompts"]) + 4
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n), timeout=600) as http:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", http_client=http, max_retries=0)
        return await asyncio.gather(*[one(client, model, p, job["max_tokens"]) for p in job["prompts"]])


def main() -> int:
    url, model = sys.argv[1], sys.argv[2]
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(asyncio.run(run(url, model, json.loads(line)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
