"""FP8 KV cache (`serve --kv-cache-dtype fp8`, issue 28 item 4) on CPU, over a tiny checkpoint of each
architecture (Qwen3-MoE and gpt-oss: GQA k/v caches; DeepSeek-V3: the MLA latent cache) in fp32:
- the caches are float8_e4m3fn and hold value / scale; the scales are the checkpoint's
  self_attn.k_scale / v_scale (vLLM's rule, models.common.attention.checkpoint_kv_scales) or 1.0;
- teacher-forced logits (a 40-token prefill, then 12 decode steps) against the fp32 cache: the
  median error and the argmax agreement within the bounds below (measured numbers beside them);
- the engine with kv_cache_dtype="fp8" generates what the model does with that cache;
- one block takes half the bytes, so the same memory budget gives twice the blocks;
- an unknown value is refused by argparse (exit 3) naming the choices.
"""

import pytest
import torch

from moe_kernels import paged_attention as pa
from moe_kernels.reference import TorchExperts
from moe_runtime.checkpoint_writer import make_checkpoint
from moe_runtime.cli import main
from moe_runtime.engine import Engine, Finished, Request, SamplingParams
from moe_runtime.loader import build_model, load_checkpoint
from moe_runtime.models import Weights
from moe_runtime.models.common.attention import checkpoint_kv_scales

ARCHS = ["qwen3_moe", "gpt_oss", "deepseek_v3"]
# Teacher-forced logits, fp8 cache against the fp32 cache, measured on these checkpoints (seed 3), a
# 40-token prefill + 12 decode steps: per position max |dlogit| / max |logit|, median qwen3_moe 0.014,
# gpt_oss 0.017, deepseek_v3 0.022 (e4m3 keeps 3 mantissa bits: ~2.6% rms error per cached value);
# the worst positions (0.12-0.38) are MoE routing flips (a top-k expert changes on a near tie), so the
# bound is on the median plus the share of positions whose argmax is unchanged (measured 0.923-0.942).
MEDIAN_TOL = 0.03
ARGMAX_AGREE = 0.85
VALUE_TOL = 0.04  # rms relative error of the values an fp8 cache returns (measured 0.025-0.027)
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(40)]
DECODE = 12


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_checkpoint(d, request.param, "bf16", size="tiny", seed=3)
    return request.param, load_checkpoint(d, "cpu", torch.float32, log=lambda *a, **k: None)


def _build(ck, scales: dict | None = None):
    if scales:
        ck.dense.update(scales)
    try:
        return build_model(ck, lambda w: TorchExperts(w, torch.float32), False)
    finally:
        for n in scales or {}:
            ck.dense.pop(n)


def _caches(model, arch):
    a = [l.self_attn for l in model.layers]
    return [c for x in a for c in ((x.cache_ckv, x.cache_krot) if arch == "deepseek_v3" else (x.k_cache, x.v_cache))]


def _forced(model, kv_cache_dtype, feed=None, prompt=PROMPT):
    """Logits [positions, V]: `prompt` prefilled at once, then one-token steps feeding `feed` (None:
    this cache's own greedy tokens). Returns (logits, tokens fed)."""
    model.allocate_kv(9, 8, kv_cache_dtype)
    bt, n = torch.arange(9)[None], len(prompt)
    out = [model(torch.tensor([prompt]), torch.arange(n)[None], bt)[0]]
    fed = []
    for i in range(DECODE):
        t = feed[i] if feed is not None else int(out[-1][-1].argmax())
        fed.append(t)
        out.append(model(torch.tensor([[t]]), torch.tensor([[n + i]]), bt)[0])
    return torch.cat(out), fed


def test_fp8_cache_logits_track_the_fp32_cache(ckpt):
    arch, ck = ckpt
    model = _build(ck)
    ref, feed = _forced(model, "auto")
    ref_vals = [c.clone() for c in _caches(model, arch)]
    got, _ = _forced(model, "fp8", feed)
    caches = _caches(model, arch)
    assert all(c.dtype == torch.float8_e4m3fn for c in caches)
    # what layer 0's caches return (its inputs are the same embeddings in both runs; scale 1.0: no scales
    # in this checkpoint). Later layers' inputs carry the error of the layers before them.
    for r, c in list(zip(ref_vals, caches))[:2]:
        assert ((c.float() - r).norm() / r.norm()).item() < VALUE_TOL
    per_pos = (got - ref).abs().max(-1).values / ref.abs().max()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    med = per_pos.median().item()
    print(f"{arch}: fp8 KV logit error median {med:.4f} max {per_pos.max().item():.4f}, argmax agreement {agree:.3f}")
    assert 0 < med < MEDIAN_TOL  # > 0: the fp8 cache really is what attention read
    assert agree >= ARGMAX_AGREE
    model.allocate_kv(1, 8)


def _engine(model, **kw):
    opts = dict(max_batch=4, max_queue=16, max_len=64, stop_ids=set(), block_size=8)
    opts.update(kw)
    return Engine(model, "cpu", **opts)


def _generate(eng, prompts, n=12):
    reqs = [Request(list(p), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), _Loop(), _Sink())
            for p in prompts]
    for r in reqs:
        eng.submit(r)
    while eng.waiting or eng.running:
        eng.step()
    assert all(isinstance(r.out[-1], Finished) for r in reqs)
    return [list(r.out[:-1]) for r in reqs]


class _Loop:
    def call_soon_threadsafe(self, fn, *a):
        fn(*a)


class _Sink(list):
    def put_nowait(self, item):
        self.append(item)


def test_engine_generates_with_fp8_cache_and_twice_the_blocks(ckpt):
    arch, ck = ckpt
    model = _build(ck)
    budget = model.kv_bytes_per_block(8) * 40
    prompt = PROMPT[:25]
    _, direct = _forced(model, "fp8", prompt=prompt)  # greedy tokens of the fp8 cache, no engine
    _, direct32 = _forced(model, "auto", prompt=prompt)
    ref_eng = _engine(model, kv_memory_bytes=budget)
    assert ref_eng.kv.num_blocks == 40
    ref = _generate(ref_eng, [prompt], DECODE)[0]
    eng = _engine(model, kv_memory_bytes=budget, kv_cache_dtype="fp8")
    assert eng.kv.num_blocks == 160  # fp32 model: 4 bytes -> 1 per cached value, 4x the blocks
    assert model.kv_bytes_per_block(8, "fp8_e4m3") == model.kv_bytes_per_block(8, "fp8")  # vLLM's alias
    with pytest.raises(ValueError, match="kv cache dtype 'fp16': expected one of auto, fp8, fp8_e4m3"):
        model.kv_bytes_per_block(8, "fp16")
    assert all(c.dtype == torch.float8_e4m3fn and c.shape[0] == 161 for c in _caches(model, arch))
    got = _generate(eng, [prompt], DECODE)[0]
    assert ref == direct32 and got == direct  # the engine runs what the model does with that cache
    same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
    print(f"{arch}: fp8 engine greedy tokens equal the fp32 cache's for the first {same} of {len(ref)}")
    bf16 = _build(load_checkpoint(ck.validated.root, "cpu", torch.bfloat16, log=lambda *a, **k: None))
    per = bf16.kv_bytes_per_block(8)
    assert per == 2 * bf16.kv_bytes_per_block(8, "fp8")  # against a bf16 cache: half the bytes
    b16 = _engine(bf16, kv_memory_bytes=per * 40, kv_blocks=None)
    b8 = _engine(bf16, kv_memory_bytes=per * 40, kv_cache_dtype="fp8")
    assert (b16.kv.num_blocks, b8.kv.num_blocks) == (40, 80)  # the same memory holds twice the tokens
    model.allocate_kv(1, 8)


def test_checkpoint_scales_are_used(ckpt):
    arch, ck = ckpt
    p = "model.layers.0.self_attn."
    model = _build(ck, {p + "k_scale": torch.tensor(0.25), p + "v_scale": torch.tensor(0.5)})
    attn = model.layers[0].self_attn
    model.allocate_kv(9, 8, "auto")
    scales = (attn.kv_scale,) if arch == "deepseek_v3" else (attn.k_scale, attn.v_scale)
    assert set(scales) == {1.0}  # a bf16/fp32 cache ignores the scales (as vLLM with "auto")
    ref = model(torch.tensor([PROMPT]), torch.arange(40)[None], torch.arange(9)[None])
    cache = attn.cache_ckv if arch == "deepseek_v3" else attn.k_cache
    stored = cache.clone()
    model.allocate_kv(9, 8, "fp8")
    scales = (attn.kv_scale,) if arch == "deepseek_v3" else (attn.k_scale, attn.v_scale)
    assert scales == ((0.25,) if arch == "deepseek_v3" else (0.25, 0.5))  # MLA: the k_scale, as vLLM's MLA
    got = model(torch.tensor([PROMPT]), torch.arange(40)[None], torch.arange(9)[None])
    cache = attn.cache_ckv if arch == "deepseek_v3" else attn.k_cache
    assert torch.equal(cache, pa.quantize_fp8(stored, 0.25))  # the cache holds k / k_scale in e4m3
    assert ((cache.float() * 0.25 - stored).norm() / stored.norm()).item() < VALUE_TOL
    assert ((got - ref).abs().max(-1).values / ref.abs().max()).median().item() < MEDIAN_TOL
    assert model.layers[1].self_attn is not attn and (
        model.layers[1].self_attn.kv_scale if arch == "deepseek_v3" else model.layers[1].self_attn.k_scale) == 1.0
    model.allocate_kv(1, 8)


@pytest.mark.parametrize("names,expect", [
    ({}, (1.0, 1.0)),
    ({"k_scale": 0.5, "v_scale": 2.0}, (0.5, 2.0)),
    ({"k_proj.k_scale": 0.5, "v_proj.v_scale": 2.0}, (0.5, 2.0)),  # ModelOpt's names
    ({"kv_scale": 3.0}, (3.0, 3.0)),  # the deprecated single scale
    ({"v_scale": 2.0}, (2.0, 2.0)),  # one of the pair: both
])
def test_scale_names_follow_vllm(names, expect):
    p = "model.layers.3.self_attn."
    assert checkpoint_kv_scales(Weights({p + n: torch.tensor([v]) for n, v in names.items()}), p) == expect


def test_bad_scale_is_refused():
    p = "model.layers.0.self_attn."
    with pytest.raises(ValueError, match="k_scale.*finite positive"):
        checkpoint_kv_scales(Weights({p + "k_scale": torch.tensor(0.0)}), p)
    with pytest.raises(ValueError, match="one value"):
        checkpoint_kv_scales(Weights({p + "k_scale": torch.ones(2)}), p)


def test_unknown_kv_cache_dtype_is_a_usage_error(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path), "--kv-cache-dtype", "fp16"]) == 3
    err = capsys.readouterr().err
    assert "argument --kv-cache-dtype: invalid choice: 'fp16' (choose from 'auto', 'fp8', 'fp8_e4m3')" in err


@pytest.mark.parametrize("argv,want", [([], "auto"), (["--kv-cache-dtype", "fp8"], "fp8"),
                                       (["--kv-cache-dtype", "fp8_e4m3"], "fp8_e4m3")])
def test_serve_flag_reaches_the_engine(tmp_path, argv, want):
    from moe_runtime.cli import _parser
    from moe_runtime.flags import engine_options

    args = _parser().parse_args(["serve", "--model", str(tmp_path), *argv])
    assert engine_options(args)["kv_cache_dtype"] == want  # serve builds Engine(..., **engine_options(args))
