"""/health while a 10 MB /tokenize runs: how long the server's event loop stops (the GIL).

Starts `moe-runtime serve` of the given checkout on a checkpoint (CPU), posts a ~10 MB prompt
(3.64M tokens with the tiny checkpoints' tokenizer) to /tokenize and polls /health every 20 ms
until the answer is complete; prints the largest and the p99/p50 /health latency per run. Run it
against two checkouts for an A/B (bench/README.md, "GIL during /tokenize"):

  python bench/bench_tokenize_gil.py --root . --model DIR --runs 2
"""

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx


async def one(url: str, text: str):
    gaps = []
    async with httpx.AsyncClient(timeout=600) as c:
        t0 = time.perf_counter()
        big = asyncio.ensure_future(c.post(url + "/tokenize", json={"prompt": text}))
        await asyncio.sleep(0.3)
        while not big.done():
            t = time.perf_counter()
            await c.get(url + "/health", timeout=60)
            gaps.append(time.perf_counter() - t)
            await asyncio.sleep(0.02)
        r = await big
        return r.json()["count"], time.perf_counter() - t0, sorted(gaps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=".", help="the checkout whose moe-runtime serves")
    ap.add_argument("--model", required=True, help="checkpoint directory (moe-runtime make-checkpoint ... tiny)")
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {**os.environ, "PYTHONPATH": ":".join(f"{root}/{d}" for d in ("operator", "runtime", "kernels"))}
    p = subprocess.Popen([sys.executable, "-m", "moe_runtime.cli", "serve", "--model", a.model, "--host", "127.0.0.1",
                          "--port", str(port), "--device", "cpu"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        text = "Hello world, the quick brown fox jumps. " * 260_000
        for i in range(a.runs):
            count, took, gaps = asyncio.run(one(url, text))
            print(json.dumps({"root": root, "run": i, "tokens": count, "seconds": round(took, 2), "probes": len(gaps),
                              "max_health_s": round(gaps[-1], 3), "p99_health_s": round(gaps[int(len(gaps) * .99)], 3),
                              "p50_health_s": round(gaps[len(gaps) // 2], 3)}), flush=True)
    finally:
        p.terminate()
        p.wait(30)


if __name__ == "__main__":
    main()
