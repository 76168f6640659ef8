"""CPU thread count of `moe-runtime serve`: throughput and latency of the real HTTP server on the
tiny checkpoint at a few concurrencies, for each `--threads` value, servers started one after the
other in the same run (the choice of the CLI default, bench/README.md "CPU threads").

  python bench/serve_threads.py [--threads 1,0] [--concurrency 1,4,16] [--requests 48] [--rounds 2]

Each (threads, concurrency) point: `--requests` completions (16 new tokens each, greedy,
ignore_eos) sent by `concurrency` clients in a closed loop; tokens/s = completion tokens / wall
time; p50/p99 = request latency. `--rounds` alternates the thread settings to spread drift.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
for sub in ("operator", "runtime", "kernels"):
    sys.path.insert(0, str(ROOT / sub))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ":".join(str(ROOT / s) for s in ("operator", "runtime", "kernels"))}
    proc = subprocess.Popen([sys.executable, "-m", "moe_runtime.cli", "serve", "--model", str(model), "--host",
                             "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "bfloat16",
                             "--threads", str(threads), "--max-batch", "16", "--max-queue", "256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 120:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server not ready")


async def load(url: str, concurrency: int, requests: int) -> dict:
    body = {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    lat: list[float] = []
    tokens = 0
    todo = list(range(requests))

    async def client(c: httpx.AsyncClient):
        nonlocal tokens
        while todo:
            todo.pop()
            t = time.perf_counter()
            r = await c.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            lat.append(time.perf_counter() - t)
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=300) as c:
        await c.post(url + "/v1/completions", json=body)  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*[client(c) for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    lat.sort()
    return {"tok_s": tokens / wall, "p50": statistics.median(lat), "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,0")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from moe_runtime.checkpoint_writer import make_checkpoint

    import torch

    model = make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "deepseek_v3", "nvfp4", "tiny")
    threads = [int(x) for x in a.threads.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    print(f"cpus {os.cpu_count()}, torch {torch.__version__} (default intra-op threads {torch.get_num_threads()})")
    results: dict[tuple[int, int], list[dict]] = {}
    for rnd in range(a.rounds):
        for th in (threads if rnd % 2 == 0 else threads[::-1]):
            proc, url = start(model, th)
            try:
                for c in concs:
                    r = asyncio.run(load(url, c, a.requests))
                    results.setdefault((th, c), []).append(r)
                    print(f"round {rnd} threads {th} concurrency {c}: {r['tok_s']:.1f} tok/s, "
                          f"p50 {r['p50'] * 1000:.0f} ms, p99 {r['p99'] * 1000:.0f} ms", flush=True)
            finally:
                proc.kill()
                proc.wait()
    print("\n| --threads | concurrency | tok/s (median of rounds) | p50 ms | p99 ms |\n|---|---|---|---|---|")
    for (th, c), rs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        print(f"| {th} | {c} | {med('tok_s'):.1f} | {med('p50') * 1000:.0f} | {med('p99') * 1000:.0f} |")


if __name__ == "__main__":
    main()
