"""Model correctness on CPU.

- Greedy generation of tiny random bf16 checkpoints matches Hugging Face transformers' own
  DeepseekV3ForCausalLM / Qwen3MoeForCausalLM token for token (both in fp32 on CPU).
- Quantized checkpoints (NVFP4, MXFP4, FP8): the runtime's bf16 serving path (kernels' torch backend
  on the packed weights, deferred finalize) matches the same model with dequantised fp32 weights
  within 5% of the logit range (stated tolerance), and transformers on an F32 checkpoint of the
  exact dequantised weights agrees with the runtime's fp32 path on the packed checkpoint within 1e-4
  (so the runtime reads each quantized layout exactly as its dequantised meaning).
- Batched decode (continuous batching over the paged KV cache) equals one-at-a-time decode.
"""

import asyncio
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_kernels.backends import load_backend
from moe_kernels.experts import dequantize
from moe_kernels.formats import Fp8BlockTensor, MxFp4Tensor, NvFp4Tensor, quantize_nvfp4
from moe_kernels.reference import TorchExperts
from moe_runtime.checkpoint_writer import make_checkpoint
from moe_runtime.loader import build_model, load_checkpoint

transformers = pytest.importorskip("transformers")

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny matmuls: torch's multi-threading costs far more than it gains (and CI has 2 busy cores)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
N_NEW = 16


def _quiet(*a, **k):
    pass


def runtime_model(path, dtype=torch.float32, backend=None, deferred=False):
    ck = load_checkpoint(path, "cpu", dtype, log=_quiet)
    factory = (lambda w: TorchExperts(w, torch.float32)) if backend is None else load_backend(backend)
    m = build_model(ck, factory, deferred)
    m.allocate_kv(16, 8)  # 128 tokens in blocks of 8, read through TABLE's scattered block order
    return m


TABLE = torch.tensor([[9, 3, 14, 0, 7, 12, 5, 1, 10, 2, 15, 4, 8, 11, 6, 13]])


def greedy_runtime(m, prompt, n):
    ids = torch.tensor([prompt])
    logits = m(ids, torch.arange(len(prompt))[None], TABLE, last_only=True)
    out = [int(logits[0, -1].argmax())]
    for i in range(n - 1):
        logits = m(torch.tensor([[out[-1]]]), torch.tensor([[len(prompt) + i]]), TABLE)
        out.append(int(logits[0, -1].argmax()))
    return out


def hf_model(path):
    m = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return m.eval()


def greedy_hf(m, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return lambda arch, fmt: make_checkpoint(root / f"{arch}-{fmt}", arch, fmt, "tiny") \
        if not (root / f"{arch}-{fmt}" / "config.json").exists() else root / f"{arch}-{fmt}"


@pytest.mark.parametrize("arch,cls", [("deepseek_v3", "DeepseekV3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_greedy_matches_transformers(tiny, arch, cls):
    d = tiny(arch, "bf16")
    ref = hf_model(d)
    assert type(ref).__name__ == cls
    mine = runtime_model(d)
    with torch.no_grad():
        want_logits = ref(torch.tensor([PROMPT])).logits
    got_logits = mine(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], TABLE.flip(1))  # another sequence's blocks
    assert (got_logits - want_logits).abs().max() < 1e-4
    assert greedy_runtime(mine, PROMPT, N_NEW) == greedy_hf(ref, PROMPT, N_NEW)


def test_yarn_rope_matches_transformers(tiny, tmp_path):
    src = tiny("deepseek_v3", "bf16")
    d = tmp_path / "yarn"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    (d / "config.json").write_text(json.dumps(cfg))
    ref, mine = hf_model(d), runtime_model(d)
    prompt = list(range(3, 40))
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits
    got = mine(torch.tensor([prompt]), torch.arange(len(prompt))[None], TABLE)
    assert (got - want).abs().max() < 1e-4


def test_unsupported_rope_scaling_is_rejected(tiny, tmp_path):
    from moe_runtime.errors import RuntimeFailure

    d = tmp_path / "dyn"
    shutil.copytree(tiny("qwen3_moe", "bf16"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeFailure, match="rope_scaling type 'dynamic' is not supported"):
        runtime_model(d)


def dequantized_copy(src, dst):
    """An F32 checkpoint holding the exact dequantised values of a quantized one (for transformers)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("hf_quant_config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    fmt = cfg.pop("quantization_config")["quant_method"]
    (dst / "config.json").write_text(json.dumps(cfg))
    weight_map = {}
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            t = {k: h.get_tensor(k) for k in h.keys()}
        out = {}
        for k, v in t.items():
            stem = k[: -len("weight")]
            if not k.endswith(".weight"):
                continue
            if stem + "weight_scale_inv" in t:
                v = dequantize(Fp8BlockTensor(v, t[stem + "weight_scale_inv"]), torch.float32)
            elif stem + "weight_scale" in t and fmt == "modelopt":
                v = dequantize(NvFp4Tensor(v, t[stem + "weight_scale"], t[stem + "weight_scale_2"]), torch.float32)
            elif stem + "weight_scale" in t:
                v = dequantize(MxFp4Tensor(v, t[stem + "weight_scale"]), torch.float32)
            out[k] = v.to(torch.float32).contiguous()
        out.update({k: v for k, v in t.items() if k.endswith("e_score_correction_bias")})
        save_file(out, str(dst / f.name))
        weight_map.update({k: f.name for k in out})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("arch,fmt", [("deepseek_v3", "nvfp4"), ("deepseek_v3", "mxfp4"), ("deepseek_v3", "fp8"),
                                      ("qwen3_moe", "nvfp4"), ("qwen3_moe", "mxfp4")])
def test_quantized_matches_dequantized(tiny, tmp_path, arch, fmt):
    d = tiny(arch, fmt)
    exact = runtime_model(d)  # fp32 math on the dequantised weights
    serving = runtime_model(d, torch.bfloat16, backend="torch", deferred=arch == "deepseek_v3")
    ids, pos = torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None]
    a = exact(ids, pos, TABLE)
    b = serving(ids, pos, TABLE)
    scale = a.abs().max()
    assert (a - b).abs().max() / scale < 0.05, "bf16 serving path vs fp32 dequantised reference"
    ref = hf_model(dequantized_copy(d, tmp_path / "deq"))
    with torch.no_grad():
        c = ref(ids).logits
    # same weights, both fp32: only summation order differs
    assert (a - c).abs().max() / scale < 1e-4, "transformers on the dequantised weights"


def test_batched_decode_equals_sequential(tiny):
    from moe_runtime.engine import Engine, Finished, Request, SamplingParams

    m = runtime_model(tiny("deepseek_v3", "nvfp4"))
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [100, 3]]
    solo = [greedy_runtime(m, p, 10) for p in prompts]
    eng = Engine(m, "cpu", max_batch=3, max_queue=8, max_len=64, stop_ids=set(), block_size=4, kv_blocks=64)

    async def run():
        loop = asyncio.get_running_loop()
        reqs = [Request(p, SamplingParams(max_tokens=10, temperature=0.0), loop, asyncio.Queue()) for p in prompts]
        for r in reqs:
            eng.submit(r)
        outs = []
        for r in reqs:
            toks = []
            while not isinstance(item := await r.out.get(), Finished):
                toks.append(item)
            assert item.reason == "length" and item.completion_tokens == 10
            outs.append(toks)
        return outs

    eng.start()
    try:
        assert asyncio.run(run()) == solo
    finally:
        eng.stop()


def test_modelopt_checkpoint_with_quantized_shared_and_dense_mlps(tiny, tmp_path):
    """ModelOpt NVFP4 exports often quantize dense MLPs and shared experts too: accepted and
    dequantised at load; the result is exactly transformers on the dequantised weights."""
    d = tmp_path / "mo"
    shutil.copytree(tiny("deepseek_v3", "nvfp4"), d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    for f in {d / v for v in index["weight_map"].values()}:
        with safe_open(str(f), "pt") as h:
            t = {k: h.get_tensor(k) for k in h.keys()}
        for k in [k for k in t if ("shared_experts." in k or "layers.0.mlp." in k) and k.endswith("_proj.weight")]:
            q = quantize_nvfp4(t[k].float())
            stem = k[: -len("weight")]
            t[k], t[stem + "weight_scale"] = q.packed, q.block_scale
            t[stem + "weight_scale_2"] = q.global_scale.reshape(()).float()
            t[stem + "input_scale"] = torch.tensor(1.0)
            index["weight_map"].update({stem + s: f.name for s in ("weight_scale", "weight_scale_2", "input_scale")})
        save_file(t, str(f))
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    mine = runtime_model(d)
    ids = torch.tensor([PROMPT])
    a = mine(ids, torch.arange(len(PROMPT))[None], TABLE)
    ref = hf_model(dequantized_copy(d, tmp_path / "deq"))
    with torch.no_grad():
        c = ref(ids).logits
    assert (a - c).abs().max() / a.abs().max() < 1e-4
