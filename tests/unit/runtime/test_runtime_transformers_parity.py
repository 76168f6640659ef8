"""Checkpoints that transformers itself writes load in the runtime and compute what transformers computes.

Tiny Qwen3-MoE and DeepSeek-V3 models are built by transformers (random init, fixed seed, norms and
the router bias perturbed so that nothing is a no-op; weights rounded to bf16 values, which the
runtime's bf16 routed experts then hold exactly), written with `save_pretrained` (transformers
5.x spellings: `num_local_experts`, `rope_parameters`), loaded by the runtime on CPU in fp32, and
compared with transformers' own forward on the same prompts:
- logits: max |runtime - transformers| <= 1e-4 (fp32 on both sides; observed ~1e-6),
- greedy generation: token for token equal to `generate(do_sample=False)`.
The same checkpoints rewritten with the older spellings (`num_experts`/`n_routed_experts`,
`rope_theta` + `rope_scaling`) and with fused expert tensors (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) give the same logits.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_kernels.reference import TorchExperts
from moe_runtime.loader import build_model, load_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 17, 99, 4, 250, 8, 31], [7], [200, 201, 202, 5, 5, 5, 9, 11, 13, 60, 61, 62, 63]]
N_NEW = 12
ATOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _quiet(*a, **k):
    pass


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
        # bf16-representable weights (stored as F32): the runtime holds unquantized routed experts in
        # bf16 (the kernels' bf16 expert format), so this makes its fp32 path exact, not approximate
        for p in model.parameters():
            p.copy_(p.bfloat16().float())


def _qwen3():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, mlp_only_layers=[0], norm_topk_prob=True, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, eos_token_id=None)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _deepseek(rope):
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256, initializer_range=0.1,
        routed_scaling_factor=2.5, rope_parameters=rope, eos_token_id=None)
    return transformers.DeepseekV3ForCausalLM(cfg)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
MODELS = {
    "qwen3_moe": _qwen3,
    "deepseek_v3": lambda: _deepseek({"rope_type": "default", "rope_theta": 10000.0}),
    "deepseek_v3_yarn": lambda: _deepseek(dict(YARN)),
    "deepseek_v3_yarn_untruncated": lambda: _deepseek(dict(YARN, truncate=False)),  # gpt-oss's yarn setting
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for i, (name, make) in enumerate(MODELS.items()):
        torch.manual_seed(1234 + i)
        m = make().eval()
        _perturb(m, 99 + i)
        d = tmp_path_factory.mktemp(name)
        m.save_pretrained(str(d))
        out[name] = (d, m)
    return out


def runtime(path):
    ck = load_checkpoint(path, "cpu", torch.float32, log=_quiet)
    m = build_model(ck, lambda w: TorchExperts(w, torch.float32), False)
    m.allocate_kv(8, 8)  # 64 tokens in blocks of 8, in TABLE's scattered order
    return m


TABLE = torch.tensor([[6, 1, 7, 3, 0, 5, 2, 4]])


def runtime_logits(m, prompt):
    return m(torch.tensor([prompt]), torch.arange(len(prompt))[None], TABLE)[0]


def runtime_greedy(m, prompt, n):
    logits = runtime_logits(m, prompt)[-1:]
    out = [int(logits[0].argmax())]
    for i in range(n - 1):
        logits = m(torch.tensor([[out[-1]]]), torch.tensor([[len(prompt) + i]]), TABLE)[0]
        out.append(int(logits[-1].argmax()))
    return out


def hf_logits(m, prompt):
    with torch.no_grad():
        return m(torch.tensor([prompt])).logits[0].float()


def test_save_pretrained_writes_the_new_spellings(saved):
    """Guards the premise: if transformers stops writing these, the alias tests below test nothing new."""
    q = json.loads((saved["qwen3_moe"][0] / "config.json").read_text())
    assert "num_local_experts" in q and "num_experts" not in q
    assert "rope_parameters" in q and "rope_theta" not in q
    d = json.loads((saved["deepseek_v3_yarn"][0] / "config.json").read_text())
    assert d["rope_parameters"]["rope_type"] == "yarn" and "rope_scaling" not in d


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_greedy_match_transformers(saved, name):
    path, hf = saved[name]
    m = runtime(path)
    worst = 0.0
    for p in PROMPTS:
        a, b = runtime_logits(m, p), hf_logits(hf, p)
        assert a.shape == b.shape
        worst = max(worst, float((a - b).abs().max()))
    assert worst <= ATOL, f"{name}: max |logit diff| {worst:.3g} > {ATOL}"
    for p in PROMPTS:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW,
                              pad_token_id=0)[0, len(p):].tolist()
        assert runtime_greedy(m, p, N_NEW) == ref, name


def _rewrite_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _old_spelling(cfg):
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    kind = rp.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rp}
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")


def _local_experts_spelling(cfg):  # DeepseekV3Config.attribute_map: num_local_experts -> n_routed_experts
    cfg["num_local_experts"] = cfg.pop("n_routed_experts")


@pytest.mark.parametrize("name,edit", [("qwen3_moe", _old_spelling), ("deepseek_v3_yarn", _old_spelling),
                                       ("deepseek_v3", _local_experts_spelling)])
def test_other_spellings_load_the_same(saved, tmp_path, name, edit):
    path, hf = saved[name]
    alt = _rewrite_config(path, tmp_path / "alt", edit)
    # transformers reads the rewritten config as the same model (else the premise is wrong)
    hf_alt = transformers.AutoModelForCausalLM.from_pretrained(str(alt), dtype=torch.float32).eval()
    ref = hf_logits(hf, PROMPTS[0])
    assert float((hf_logits(hf_alt, PROMPTS[0]) - ref).abs().max()) <= 1e-6
    got = runtime_logits(runtime(alt), PROMPTS[0])
    assert float((got - ref).abs().max()) <= ATOL


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_fused_expert_tensors_load_the_same(saved, tmp_path, name):
    path, hf = saved[name]
    dst = tmp_path / "fused"
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    E = cfg.get("n_routed_experts") or cfg["num_local_experts"]
    t = load_file(str(dst / "model.safetensors"))
    fused_layers = 0
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" not in t:
            continue
        t[p + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")])
                                             for e in range(E)])
        t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
        fused_layers += 1
    assert fused_layers >= 1
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ref = hf_logits(hf, PROMPTS[2])
    got = runtime_logits(runtime(dst), PROMPTS[2])
    assert float((got - ref).abs().max()) <= ATOL
