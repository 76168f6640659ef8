"""The serving step against its roofline (issue 28 item 6), on one GPU, all numbers from one run.

For DeepSeek-V3 (NVFP4, 1 dense + 2 MoE layers), Qwen3-30B-A3B (NVFP4, 4 layers) and gpt-oss-120b
(MXFP4, 4 layers) shaped checkpoints with the real per-layer dimensions and vocabularies and random
weights (moe_runtime.checkpoint_writer.make_checkpoint with `overrides`), measured through the
runtime's own serving path (moe_runtime.serve's prepare / load / select_backend / build, the
Engine with `serve`'s flag defaults and CUDA graphs), then over HTTP (`moe-runtime serve` in its
own process, streamed through the openai SDK from client processes):

- decode step at batch B (1/8/64) and context --ctx (1024): B prompts of --ctx random tokens,
  --new-tokens (128) greedy tokens each (ignore_eos). The step time is the median wall time of
  the engine steps that decode all B rows and prefill nothing (the engine thread's loop is
  `step()` over and over; here the bench calls it, timing each). Roofline = the bytes that step
  must read (runtime_roofline.roofline_bytes: dense weights incl. lm_head, the experts the batch
  touches, the KV cache at the steps' mean context) / the copy bandwidth measured in this run.
  Engine tok/s = B / step time.
- HTTP tok/s: completion tokens streamed in the window where all B streams are decoding (from
  the last stream's first token to the first stream's last token) / its length; TTFT: mean of
  (first token - request sent).
- prefill at --prefill (1024, 8192)-token prompts, batch 1, the engine's own chunking
  (--max-prefill-tokens 2048 as `serve`): TTFT, tokens/s, and model FLOPs/s
  (runtime_roofline.prefill_flops) as a fraction of the bf16 matmul peak measured in this run.

Engines are freed between phases (references dropped, gc, torch.cuda.empty_cache) and every KV
cache is sized explicitly (--kv-blocks), so no phase depends on what an earlier one left.

  python bench/bench_runtime.py [--model deepseek_v3,qwen3_moe,gpt_oss] [--batches 1,8,64] [--ctx 1024]
      [--new-tokens 128] [--prefill 1024,8192] [--quick] [--no-http] [--json out.json] [--budget-s 540]
  python bench/bench_runtime.py --tiny   # CPU: tiny dims, one layer, batch 1/2 (the unit test's run)

On the lent H200 (its image has no fastapi, uvicorn, openai or pydantic: carry their wheels,
`pip download --no-deps` of the .venv's versions into .whl/serve, and install them aside):
  python3 -m pip install -q --no-deps --no-index --target /tmp/pylib .whl/serve/*.whl
  PYTHONPATH=/tmp/pylib python3 bench/bench_runtime.py --workdir /tmp/br --budget-s 420 --json $OUT/bench_runtime.json \
      2> $OUT/bench_runtime.log | tee $OUT/bench_runtime.md   # stderr: the runtime's JSON log lines
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATHS = [str(ROOT / s) for s in ("operator", "runtime", "kernels")]
sys.path[:0] = [p for p in PATHS + [str(HERE)] if p not in sys.path]

import torch  # noqa: E402

from runtime_roofline import ModelBytes, model_bytes, prefill_flops, roofline_bytes  # noqa: E402,F401

T0 = time.time()

# real per-layer dimensions (the releases' config.json), few layers; max_position_embeddings only
# as long as the 8k prefill needs where the small size's is shorter
REAL = {
    "deepseek_v3": ("DeepSeek-V3", "nvfp4", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        max_position_embeddings=16384)),
    "qwen3_moe": ("Qwen3-30B-A3B", "nvfp4", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, max_position_embeddings=40960)),
    "gpt_oss": ("gpt-oss-120b", "mxfp4", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2)),
}
# --tiny: the writer's tiny dims, one layer (MoE where the architecture has one)
TINY = {"deepseek_v3": dict(num_hidden_layers=1, first_k_dense_replace=0),
        "qwen3_moe": dict(num_hidden_layers=1),
        "gpt_oss": dict(num_hidden_layers=1, layer_types=["sliding_attention"])}

DECODE_COLUMNS = ["model", "batch", "ctx", "step ms", "roofline ms", "step / roofline", "dense MB", "experts MB",
                  "KV MB", "engine tok/s", "HTTP tok/s", "HTTP / engine", "HTTP TTFT ms"]
PREFILL_COLUMNS = ["model", "prompt", "TTFT ms", "chunks", "prefill tok/s", "TFLOP/s", "% of bf16 peak"]


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    """What the previous phase held goes back to the allocator and the driver."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _best(fn, device: str, reps: int) -> float:
    fn()
    sync(device)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def copy_bandwidth(device: str) -> float:
    """bytes/s of a bf16 copy, read + write counted (4 bytes per element), 1 GiB on GPU."""
    n = (1 << 29) if device.startswith("cuda") else (1 << 22)
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    bw = 4 * n / _best(lambda: b.copy_(a), device, 20)
    del a, b
    free(device)
    return bw


def matmul_peak(device: str) -> float:
    """FLOP/s of a bf16 matmul (8192^3 on GPU: the tensor-core peak reachable from torch)."""
    n = 8192 if device.startswith("cuda") else 256
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    t = _best(lambda: a @ b, device, 10)
    del a, b
    free(device)
    return 2 * n ** 3 / t


# ------------------------------------------------------------------------------------------------
# The serving path in this process

def serve_args(ckpt: Path, device: str, extra: list[str] = ()):
    """`moe-runtime serve`'s parsed flags for this checkpoint: the server's defaults (engine options,
    CUDA graphs, --max-prefill-tokens) are the bench's."""
    from moe_runtime import cli

    return cli._parser().parse_args(["serve", "--model", str(ckpt), "--device", device, *extra])


def load_model(args):
    """serve.py's stages 1-5 (probe, plan check, load, backend self-test, build): the model as served."""
    from moe_runtime import serve
    from moe_runtime.metrics import Metrics

    prep = serve.prepare(args)
    ck = serve.load(prep)
    backend, deferred = serve.select_backend(prep.resolution, prep.device, Metrics(), args.skip_selftest,
                                             next(iter(ck.experts.values()), None))
    model = serve.build(ck, backend, deferred, prep.dtype)
    info = {"backend": backend, "deferred": deferred, "load_s": round(ck.seconds, 2), "load_bytes": ck.nbytes}
    del ck
    return model, prep.device, info


def make_engine(model, device: str, args, max_batch: int, max_len: int, kv_blocks: int):
    from moe_runtime.engine import Engine
    from moe_runtime.flags import engine_options

    opts = {**engine_options(args), "kv_blocks": kv_blocks}
    return Engine(model, device, max_batch, max(max_batch, 16), max_len, set(), None, **opts,
                  cuda_graphs=bool(args.cuda_graphs) and device.startswith("cuda"))


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def drive(eng, batch_prompts: list[list[int]], new_tokens: int) -> dict:
    """Submit every prompt at once and run the engine's steps here until all finish: each step's
    wall time, (decode rows, prefill tokens) and mean context of its decode rows."""
    from moe_runtime.engine import Request, SamplingParams

    loop = asyncio.new_event_loop()  # the requests' output queues; nothing needs to read them here
    try:
        t0 = time.time()
        reqs = [Request(p, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), loop,
                        asyncio.Queue(), created=t0) for p in batch_prompts]
        for r in reqs:
            eng.submit(r)
        steps = []
        while eng.busy():
            rows = [r for r in eng.running if len(r.tokens) - r.computed == 1]
            ctx = sum(r.computed + 1 for r in rows) / len(rows) if rows else 0.0
            t = time.perf_counter()
            eng.step()
            steps.append((time.perf_counter() - t, *eng.steps[-1], ctx))
        bad = [len(r.generated) for r in reqs if len(r.generated) != new_tokens]
        if bad:
            raise RuntimeError(f"requests finished with {bad[:4]} tokens, not {new_tokens}")
        return {"steps": steps, "ttft": [r.first_token_at - t0 for r in reqs]}
    finally:
        loop.close()


def warmup_tokens(batch: int, ctx: int, new_tokens: int, max_prefill_tokens: int) -> int:
    """Tokens per request of a warm-up burst that reaches a step decoding all B rows (the prompts
    take about B x ctx / max_prefill_tokens steps to prefill), so its JIT and the CUDA-graph capture
    of B's bucket happen before the timed burst."""
    return min(new_tokens, math.ceil(batch * ctx / max_prefill_tokens) + 8)


def decode_point(eng, mb: ModelBytes, batch: int, ctx: int, new_tokens: int, vocab: int, bw: float) -> dict:
    drive(eng, prompts(batch, ctx, vocab, 1000 + batch), warmup_tokens(batch, ctx, new_tokens, eng.max_prefill_tokens))
    run = drive(eng, prompts(batch, ctx, vocab, 2000 + batch), new_tokens)
    pure = [(t, c) for t, rows, pre, c in run["steps"] if rows == batch and pre == 0]
    if not pure:
        raise RuntimeError(f"batch {batch}: no step decoded all {batch} rows without prefill")
    step = statistics.median(t for t, _ in pure)
    mean_ctx = sum(c for _, c in pure) / len(pure)
    rb = roofline_bytes(mb, batch, mean_ctx)
    roof = rb["total"] / bw
    return {"batch": batch, "ctx": ctx, "mean_ctx": round(mean_ctx, 1), "steps_timed": len(pure),
            "step_ms": 1e3 * step, "roofline_ms": 1e3 * roof, "ratio": step / roof,
            "bytes": rb, "engine_tok_s": batch / step, "engine_ttft_ms": 1e3 * statistics.mean(run["ttft"])}


def prefill_point(eng, mb: ModelBytes, prompt: int, vocab: int, peak: float) -> dict:
    drive(eng, prompts(1, prompt, vocab, 3000 + prompt), 1)
    run = drive(eng, prompts(1, prompt, vocab, 4000 + prompt), 1)
    ttft = run["ttft"][0]
    flops = prefill_flops(mb, prompt)
    return {"prompt": prompt, "ttft_ms": 1e3 * ttft, "chunks": sum(1 for s in run["steps"] if s[2] > 0),
            "tok_s": prompt / ttft, "tflop_s": flops / ttft / 1e12, "peak_frac": flops / ttft / peak}


# ------------------------------------------------------------------------------------------------
# Over HTTP: `moe-runtime serve` in its own process, openai SDK clients in others

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, device: str, flags: list[str], log_path: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(PATHS + [os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "moe_runtime.cli", "serve", "--model", str(ckpt), "--host", "127.0.0.1", "--port",
           str(port), "--device", device, "--served-model-name", "bench", *flags]
    logf = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    stop_server(proc)
    raise RuntimeError(f"server not ready after {timeout:.0f}s: {log_path.read_text()[-2000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # drains, exits 0
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Clients:
    """`k` client processes (runtime_http_client.py) against one server, started once; a burst
    splits its prompts over them (16 streams per process, at most 4: one Python process parsing 64
    streams would be the bottleneck) and releases them together."""

    def __init__(self, url: str, k: int):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(PATHS + [os.environ.get("PYTHONPATH", "")])}
        self.procs = [subprocess.Popen([sys.executable, str(HERE / "runtime_http_client.py"), url, "bench"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                      for _ in range(k)]
        for p in self.procs:
            if p.stdout.readline().strip() != "ready":
                self.close()
                raise RuntimeError("HTTP client process did not start")

    def burst(self, batch_prompts: list[list[int]], max_tokens: int) -> list[dict]:
        use = self.procs[:min(len(self.procs), math.ceil(len(batch_prompts) / 16))]
        jobs = [json.dumps({"max_tokens": max_tokens, "prompts": batch_prompts[i::len(use)]}) + "\n"
                for i in range(len(use))]
        for p, job in zip(use, jobs):
            p.stdin.write(job)
            p.stdin.flush()
        out = []
        for p in use:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"HTTP client process failed (exit {p.poll()})")
            out += json.loads(line)
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.stdin.close()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def http_decode(streams: list[dict], new_tokens: int) -> dict:
    """Tokens/s in the window where every stream is decoding, and mean TTFT."""
    bad = [s["chunks"][-1][1] if s["chunks"] else 0 for s in streams if not s["chunks"] or s["chunks"][-1][1] != new_tokens]
    if bad:
        raise RuntimeError(f"streams ended with {bad[:4]} tokens, not {new_tokens}")
    ta = max(s["chunks"][0][0] for s in streams)
    tb = min(s["chunks"][-1][0] for s in streams)

    def at(s, t):
        return max((n for u, n in s["chunks"] if u <= t), default=0)

    toks = sum(at(s, tb) - at(s, ta) for s in streams)
    return {"tok_s": toks / (tb - ta) if tb > ta and toks else None,
            "ttft_ms": 1e3 * statistics.mean(s["chunks"][0][0] - s["sent"] for s in streams)}


# ------------------------------------------------------------------------------------------------
# One model, then the tables

def bench_model(arch: str, a, device: str, bw: float, peak: float, work: Path, results: dict, dump=lambda: None) -> None:
    """One model's phases; `dump` after every point, so a run stopped by a time limit keeps its numbers."""
    from moe_runtime.checkpoint_writer import make_checkpoint

    label, fmt, real = REAL[arch]
    ckpt = work / arch
    shutil.rmtree(ckpt, ignore_errors=True)
    t = time.time()
    if a.tiny:
        make_checkpoint(ckpt, arch, fmt, "tiny", device=device, overrides=TINY[arch])
    else:
        make_checkpoint(ckpt, arch, fmt, "small", device=device, overrides=real)
    label = f"{label}{' (tiny)' if a.tiny else ''} {fmt}"
    mb = model_bytes(ckpt, 1 if a.kv_cache_dtype.startswith("fp8") else 2)  # bf16 model: auto is bf16
    cfg = json.loads((ckpt / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    added = extend_tokenizer(ckpt, vocab)
    entry = {"model": label, "arch": arch, "format": fmt, "layers": cfg["num_hidden_layers"],
             "make_checkpoint_s": round(time.time() - t, 1), "tokens_added_to_tokenizer": added, "model_bytes": mb.__dict__, "decode": [], "prefill": []}
    results["models"].append(entry)
    say(f"{label}: checkpoint in {entry['make_checkpoint_s']}s")
    batches = a.batch_list
    bs = 16
    max_len = a.ctx + a.new_tokens + bs
    kv_blocks = 2 * max(batches) * math.ceil(max_len / bs)
    kv_flag = ["--kv-cache-dtype", a.kv_cache_dtype] if a.kv_cache_dtype != "auto" else []
    args = serve_args(ckpt, device, kv_flag)
    model, dev, entry["serve"] = load_model(args)
    say(f"{label}: loaded ({entry['serve']})")
    eng = make_engine(model, dev, args, max(batches), max_len, kv_blocks)
    for b in batches:
        if time.time() - T0 > a.budget_s:
            results["notes"].append(f"{label} batch {b}: skipped (time budget)")
            continue
        r = decode_point(eng, mb, b, a.ctx, a.new_tokens, vocab, bw)
        entry["decode"].append(r)
        dump()
        say(f"{label} B={b}: step {r['step_ms']:.2f} ms, roofline {r['roofline_ms']:.3f} ms ({r['ratio']:.1f}x), "
            f"{r['engine_tok_s']:.0f} tok/s")
    if dev.startswith("cuda") and args.cuda_graphs:
        entry["cuda_graphs"] = eng.decoder is not None  # the engine falls back to eager when capture fails
        if not entry["cuda_graphs"]:
            results["notes"].append(f"{label}: CUDA graphs disabled by the engine (capture failed; see the log): eager steps")
    del eng
    free(dev)
    plen = max(a.prefill_list)
    eng = make_engine(model, dev, args, 1, plen + bs, 4 * math.ceil((plen + bs) / bs))
    for p in a.prefill_list:
        if time.time() - T0 > a.budget_s:
            results["notes"].append(f"{label} prefill {p}: skipped (time budget)")
            continue
        r = prefill_point(eng, mb, p, vocab, peak)
        entry["prefill"].append(r)
        dump()
        say(f"{label} prefill {p}: TTFT {r['ttft_ms']:.1f} ms, {r['tok_s']:.0f} tok/s, {100 * r['peak_frac']:.1f}% of peak")
    del eng, model
    free(dev)
    if a.no_http:
        results["notes"].append(f"{label}: HTTP not measured (--no-http)")
    elif time.time() - T0 > a.budget_s:
        results["notes"].append(f"{label}: HTTP skipped (time budget)")
    else:
        flags = ["--max-batch", str(max(batches)), "--max-model-len", str(max_len), "--kv-blocks", str(kv_blocks), *kv_flag]
        proc, url = start_server(ckpt, device, flags, work / f"{arch}-serve.log", a.server_timeout)
        clients = None
        try:
            clients = Clients(url, min(4, math.ceil(max(batches) / 16)))
            for r in entry["decode"]:
                b = r["batch"]
                if time.time() - T0 > a.budget_s:
                    results["notes"].append(f"{label} HTTP batch {b}: skipped (time budget)")
                    continue
                if device.startswith("cuda"):  # the server's JIT and graph capture for B (CPU: none)
                    clients.burst(prompts(b, a.ctx, vocab, 5000 + b),
                                  warmup_tokens(b, a.ctx, a.new_tokens, args.max_prefill_tokens))
                h = http_decode(clients.burst(prompts(b, a.ctx, vocab, 6000 + b), a.new_tokens), a.new_tokens)
                r["http_tok_s"], r["http_ttft_ms"] = h["tok_s"], h["ttft_ms"]
                dump()
                say(f"{label} HTTP B={b}: {h['tok_s'] or float('nan'):.0f} tok/s, TTFT {h['ttft_ms']:.1f} ms")
        finally:
            if clients is not None:
                clients.close()
            stop_server(proc)
    if not a.keep:
        shutil.rmtree(ckpt, ignore_errors=True)


def extend_tokenizer(ckpt: Path, vocab: int) -> int:
    """Give every model id text: the writer's tokenizer has at most 512 tokens, and a streamed token
    without text (an id the tokenizer lacks) sends no chunk, so a random model's output over the real
    vocabulary would stream nothing to time. Ids past the tokenizer become added tokens " t<id>".
    Returns how many were added."""
    from tokenizers import AddedToken, Tokenizer

    path = ckpt / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    have = tok.get_vocab_size()
    if have >= vocab:
        return 0
    tok.add_tokens([AddedToken(f" t{i}", normalized=False) for i in range(have, vocab)])
    if tok.get_vocab_size() != vocab or tok.token_to_id(f" t{vocab - 1}") != vocab - 1:
        raise RuntimeError(f"{path}: extending the tokenizer to {vocab} ids gave {tok.get_vocab_size()}")
    tok.save(str(path))
    return vocab - have


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def decode_rows(results: dict) -> list[list[str]]:
    rows = []
    for m in results["models"]:
        for r in m["decode"]:
            http = r.get("http_tok_s")
            rows.append([m["model"], str(r["batch"]), f"{r['ctx']} ({r['mean_ctx']:.0f})", _f(r["step_ms"], ".3f"),
                         _f(r["roofline_ms"], ".3f"), _f(r["ratio"], ".2f") + "x", _f(r["bytes"]["dense"] / 1e6, ".4g"),
                         _f(r["bytes"]["experts"] / 1e6, ".4g"), _f(r["bytes"]["kv"] / 1e6, ".4g"),
                         _f(r["engine_tok_s"], ".0f"), _f(http, ".0f"),
                         (_f(http / r["engine_tok_s"], ".2f") + "x") if http else "-", _f(r.get("http_ttft_ms"), ".1f")])
    return rows


def prefill_rows(results: dict) -> list[list[str]]:
    return [[m["model"], str(r["prompt"]), _f(r["ttft_ms"], ".1f"), str(r["chunks"]), _f(r["tok_s"], ".0f"),
             _f(r["tflop_s"], ".3g"), _f(100 * r["peak_frac"], ".1f")] for m in results["models"] for r in m["prefill"]]


def table(columns: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def report(results: dict) -> str:
    h = (f"{results['device']}, torch {results['torch']}, copy bandwidth {results['copy_bw'] / 1e12:.3f} TB/s, "
         f"bf16 matmul peak {results['bf16_peak'] / 1e12:.1f} TFLOP/s; {results['new_tokens']} new tokens, "
         f"KV cache {results['kv_cache_dtype']}; ctx = prompt (mean context of the timed steps)")
    notes = "\n".join(f"note: {n}" for n in results["notes"])
    return f"{h}\n\n{table(DECODE_COLUMNS, decode_rows(results))}\n\n{table(PREFILL_COLUMNS, prefill_rows(results))}\n{notes}"


def parse(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deepseek_v3,qwen3_moe,gpt_oss", help="comma-separated: " + ",".join(REAL))
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,64; --tiny 1,2)")
    ap.add_argument("--ctx", type=int, default=None, help="prompt tokens of the decode runs (default 1024; --tiny 24)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 128, --quick 48, --tiny 8)")
    ap.add_argument("--prefill", default=None, help="prefill prompt lengths (default 1024,8192; --tiny 16,48)")
    ap.add_argument("--quick", action="store_true", help="48 new tokens, batches 1,64, prefill at 1024 only")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny dims, one layer, batch 1/2")
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (--tiny's default)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                    help="serve's --kv-cache-dtype for the engine and the server (fp8: 1 byte per KV value in the roofline)")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--budget-s", type=float, default=540, help="skip what starts after this many seconds")
    ap.add_argument("--server-timeout", type=float, default=600, help="seconds for `serve` to become ready")
    a = ap.parse_args(argv)
    unknown = [m for m in a.model.split(",") if m not in REAL]
    if unknown:
        ap.error(f"--model {','.join(unknown)}: choose from {','.join(REAL)}")
    a.models = a.model.split(",")
    a.device = a.device or ("cpu" if a.tiny else "cuda")
    a.batch_list = [int(x) for x in (a.batches or ("1,2" if a.tiny else "1,64" if a.quick else "1,8,64")).split(",")]
    a.ctx = a.ctx or (24 if a.tiny else 1024)
    a.new_tokens = a.new_tokens or (8 if a.tiny else 48 if a.quick else 128)
    a.prefill_list = [int(x) for x in (a.prefill or ("16,48" if a.tiny else "1024" if a.quick else "1024,8192")).split(",")]
    if a.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (a decode step after the first token)")
    return a


def main(argv: list[str] | None = None) -> int:
    global T0
    T0 = time.time()  # the budget counts from this run, not from the import (a test session imports it early)
    a = parse(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no GPU: run with --tiny (CPU) or on a GPU host")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_runtime_"))
    work.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu",
               "torch": torch.__version__, "new_tokens": a.new_tokens, "ctx": a.ctx, "kv_cache_dtype": a.kv_cache_dtype, "models": [], "notes": []}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    results["copy_bw"] = copy_bandwidth(a.device)
    results["bf16_peak"] = matmul_peak(a.device)
    say(f"copy {results['copy_bw'] / 1e12:.3f} TB/s, bf16 matmul {results['bf16_peak'] / 1e12:.1f} TFLOP/s")

    def dump():
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1, default=str))

    failed = False
    for arch in a.models:
        try:
            bench_model(arch, a, a.device, results["copy_bw"], results["bf16_peak"], work, results, dump)
        except Exception as e:  # one model failing must not cost the others' numbers
            failed = True
            results["notes"].append(f"{arch}: FAILED {type(e).__name__}: {str(e)[:500]}")
            say(results["notes"][-1])
        free(a.device)
        dump()
    print("\n" + report(results), flush=True)
    dump()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
