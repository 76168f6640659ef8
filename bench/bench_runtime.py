"""End-to-end runtime benchmark on one GPU (H200): decode tokens/s and time to first token for the
`small` DeepSeek-V3-shaped checkpoint (moe-runtime make-checkpoint --size small) with NVFP4 experts
at batch 1, 8 and 64, against the same model with bf16 experts (the dequantised FP4 weights, same
Triton backend) and against transformers' own DeepseekV3ForCausalLM `generate` on those bf16
weights - all in the same run. Also the weight loading speed (GB/s, safetensors -> GPU).

Measured through the runtime's real serving engine (continuous batching scheduler, batched
prefill, greedy sampling, per-step host sync), not a bare forward loop. `B` requests with
`--prompt-len` prompt tokens and `--new-tokens` generated tokens arrive at once:
  TTFT    = mean over the B requests of (first token time - arrival)
  decode  = B * (new_tokens - 1) / (last finish - last first token)   [tokens/s]
transformers: TTFT = generate(max_new_tokens=1) on the [B, prompt] batch; decode = B*(N-1) /
(t(generate N) - t(generate 1)).

  python bench/bench_runtime.py [--batches 1,8,64] [--new-tokens 128] [--json out.json] [--no-hf]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for sub in ("operator", "runtime", "kernels"):
    sys.path.insert(0, str(HERE.parent / sub))

import torch  # noqa: E402

from moe_kernels.backends import load_backend  # noqa: E402
from moe_kernels.experts import ExpertWeights  # noqa: E402
from moe_runtime.checkpoint_writer import make_checkpoint  # noqa: E402
from moe_runtime.engine import Engine, Finished, Request, SamplingParams  # noqa: E402
from moe_runtime.loader import LoadedCheckpoint, build_model, load_checkpoint  # noqa: E402

T0 = time.time()


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def quiet(*a, **k):
    pass


def drop_page_cache() -> bool:
    """Best effort (root, not in every sandbox): makes the load measurement a cold read."""
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_engine(model, batch: int, prompt_len: int, new_tokens: int, vocab: int, graphs: bool) -> dict:
    eng = Engine(model, DEVICE, max_batch=batch, max_queue=batch, max_len=prompt_len + new_tokens + 2, stop_ids=set(),
                 cuda_graphs=graphs)
    eng.start()
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]

    async def go():
        loop = asyncio.get_running_loop()
        reqs = [Request(p, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), loop,
                        asyncio.Queue()) for p in prompts]
        t0 = time.time()
        for r in reqs:
            r.created = t0
            eng.submit(r)
        ends = []
        for r in reqs:
            while not isinstance(item := await r.out.get(), Finished):
                pass
            assert item.completion_tokens == new_tokens, item
            ends.append(time.time())
        firsts = [r.first_token_at for r in reqs]
        return {"ttft_ms": 1000 * sum(f - t0 for f in firsts) / batch,
                "decode_tok_s": batch * (new_tokens - 1) / max(max(ends) - max(firsts), 1e-9)}

    try:
        return asyncio.run(go())
    finally:
        eng.stop()


def hf_model(ck: LoadedCheckpoint, bf16_experts: dict, path: Path):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(path))
    if hasattr(cfg, "quantization_config"):  # the weights handed over are already dequantised bf16
        del cfg.quantization_config
    cfg._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    sd = dict(ck.dense)
    for i, (w13, w2) in bf16_experts.items():
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = w13
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = w2
    missing, unexpected = m.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"transformers state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return m.eval()


def run_hf(m, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g).to(DEVICE)

    def gen(n):
        sync()
        t = time.time()
        with torch.inference_mode():
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        sync()
        assert out.shape[1] == prompt_len + n
        return time.time() - t

    gen(2)  # warm-up
    t1, tn = gen(1), gen(new_tokens)
    return {"ttft_ms": 1000 * t1, "decode_tok_s": batch * (new_tokens - 1) / max(tn - t1, 1e-9)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/bench_runtime")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    # 128: at batch 1 a graphed step takes ~1.7 ms, so 32 tokens (~50 ms) moved rows by 25% run to run
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--budget-s", type=float, default=330, help="skip what would not finish in time")
    ap.add_argument("--json", default=None)
    ap.add_argument("--size", default="small", help="tiny: a CPU dry run of this script")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    batches = [int(b) for b in a.batches.split(",")]
    results: dict = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "format": a.format,
                     "backend": a.backend, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "rows": [],
                     "notes": []}

    def dump():
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=2))

    work = Path(a.workdir)
    ck_dir = work / f"ds-{a.size}-{a.format}"
    if not (ck_dir / "config.json").exists():
        t = time.time()
        make_checkpoint(ck_dir, "deepseek_v3", a.format, a.size, device=DEVICE)
        results["make_checkpoint_s"] = round(time.time() - t, 1)
        say(f"make-checkpoint {a.size} {a.format}: {results['make_checkpoint_s']}s")
    cold = drop_page_cache()
    ck = load_checkpoint(ck_dir, DEVICE, torch.bfloat16, log=quiet)
    results["load"] = {"bytes": ck.nbytes, "seconds": round(ck.seconds, 3), "gb_per_s": round(ck.nbytes / ck.seconds / 1e9, 2),
                       "page_cache": "dropped (cold read)" if cold else "not dropped (file just written: warm read)"}
    say(f"load {ck.nbytes / 1e9:.2f} GB in {ck.seconds:.2f}s = {results['load']['gb_per_s']} GB/s ({results['load']['page_cache']})")
    dump()
    vocab = ck.config["vocab_size"]

    # bf16 experts = the dequantised FP4 weights (same numbers), shared with the transformers model
    bf16_experts = {i: ew.dequantize() for i, ew in ck.experts.items()}
    backend = load_backend(a.backend)
    models = {f"runtime {a.format} experts": build_model(ck, backend, deferred=True)}
    bf16_ck = LoadedCheckpoint(ck.validated, ck.dense, {i: ExpertWeights("bf16", w13, w2)
                                                        for i, (w13, w2) in bf16_experts.items()}, 0, 0)
    models["runtime bf16 experts"] = build_model(bf16_ck, backend, deferred=True)
    hf = None
    if not a.no_hf:
        try:
            hf = hf_model(ck, bf16_experts, ck_dir)
        except Exception as e:  # transformers missing or incompatible: say so, keep the rest
            results["notes"].append(f"transformers comparison skipped: {type(e).__name__}: {e}")
            say(results["notes"][-1])
    say("models built")

    variants = [(f"{name}{' + CUDA graphs' if g else ''}", m, g) for name, m in models.items()
                for g in ((False, True) if DEVICE == "cuda" else (False,))]
    for b in batches:
        for name, m, graphs in variants:
            if time.time() - T0 > a.budget_s:
                results["notes"].append(f"skipped {name} batch {b}: time budget")
                continue
            run_engine(m, b, a.prompt_len, 4, vocab, graphs)  # warm-up: Triton JIT for these shapes
            r = run_engine(m, b, a.prompt_len, a.new_tokens, vocab, graphs)
            results["rows"].append({"engine": name, "batch": b, **{k: round(v, 2) for k, v in r.items()}})
            say(f"{name:42s} B={b:3d} TTFT {r['ttft_ms']:8.1f} ms  decode {r['decode_tok_s']:9.1f} tok/s")
            dump()
        if hf is not None:
            if time.time() - T0 > a.budget_s:
                results["notes"].append(f"skipped transformers batch {b}: time budget")
                continue
            r = run_hf(hf, b, a.prompt_len, a.new_tokens, vocab)
            results["rows"].append({"engine": "transformers generate (bf16)", "batch": b,
                                    **{k: round(v, 2) for k, v in r.items()}})
            say(f"{'transformers generate (bf16)':28s} B={b:3d} TTFT {r['ttft_ms']:8.1f} ms  decode {r['decode_tok_s']:9.1f} tok/s")
            dump()

    print("\n| engine | batch | TTFT ms | decode tok/s | vs bf16 experts (same graphs setting) | vs transformers |")
    print("|---|---|---|---|---|---|")
    by = {(r["engine"], r["batch"]): r for r in results["rows"]}
    for r in results["rows"]:
        suffix = " + CUDA graphs" if r["engine"].endswith("CUDA graphs") else ""
        base = by.get(("runtime bf16 experts" + suffix, r["batch"]))
        hfr = by.get(("transformers generate (bf16)", r["batch"]))
        rb = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
        rh = f"{r['decode_tok_s'] / hfr['decode_tok_s']:.2f}x" if hfr else "-"
        print(f"| {r['engine']} | {r['batch']} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} | {rb} | {rh} |")
    for n in results["notes"]:
        print("note:", n)
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
