"""`moe-runtime make-checkpoint`: random-weight checkpoints in the real Hugging Face on-disk layout.

Layouts written (formats-and-kernels.md section 4):
- bf16:  plain BF16 tensors, no quantization config.
- fp8:   DeepSeek-V3 style block FP8: every linear weight of the decoder layers (attention, dense MLP,
         shared and routed experts) is F8_E4M3 with a `weight_scale_inv` F32 tensor of
         [ceil(out/128), ceil(in/128)]; config.json `quantization_config = {quant_method: fp8,
         fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]}`. Router, norms,
         embeddings and lm_head stay BF16 (as in the real checkpoint).
- nvfp4: ModelOpt NVFP4: routed experts only, per expert and projection `weight` U8 [out, in/2],
         `weight_scale` F8_E4M3 [out, in/16], `weight_scale_2` F32 scalar, `input_scale` F32 scalar;
         gate_proj and up_proj of one expert share weight_scale_2 and input_scale (ModelOpt fuses
         their amax because they are one GEMM at run time). Both `hf_quant_config.json` and the
         newer in-config `quantization_config {quant_method: modelopt, quant_algo: NVFP4, ...}`.
- mxfp4: OCP MXFP4 on routed experts only (our documented layout, per expert like ModelOpt rather than
         gpt-oss's fused blocks): `weight` U8 [out, in/2] packed E2M1 (low nibble = even element),
         `weight_scale` U8 E8M0 [out, in/32]; `quantization_config = {quant_method: mxfp4,
         modules_to_not_convert: [...]}`.
Attention, dense MLPs, shared experts, router, norms and embeddings are BF16 except under fp8.

Sizes: `tiny` (hidden 64, 3 layers, 8 experts; CPU tests in seconds) and `small`
(DeepSeek-V3-shaped: hidden 2048, 4 layers of which 3 MoE, 256 experts top-8 in 8 groups (top-4
groups), moe_intermediate 768, MLA q_lora 768/kv_lora 256; about 7.4 GB in bf16, 2.2 GB NVFP4 —
small enough to write and load in seconds on an H200 host, big enough that decode reads are
expert-dominated like the real model).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from . import kcompat
from .errors import RuntimeFailure
from .tokenizer import build_tokenizer_files

ARCHS = ("deepseek_v3", "qwen3_moe")
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
SIZES = ("tiny", "small")

_COMMON = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "initializer_range": 0.02, "attention_bias": False,
           "attention_dropout": 0.0, "use_cache": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

_DEEPSEEK = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                 q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                 n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                 max_position_embeddings=1024),
    "small": dict(vocab_size=16384, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=768,
                  num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
                  q_lora_rank=768, kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                  n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                  max_position_embeddings=4096),
}
_QWEN = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024),
    "small": dict(vocab_size=16384, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096),
}


def make_config(arch: str, size: str) -> dict[str, Any]:
    if arch == "deepseek_v3":
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **_COMMON, **_DEEPSEEK[size],
                "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                "norm_topk_prob": True, "rope_theta": 10000.0, "rope_scaling": None, "rope_interleave": True,
                "num_nextn_predict_layers": 0}
    if arch == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_COMMON, **_QWEN[size],
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "rope_theta": 1000000.0,
                "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
                "output_router_logits": False, "router_aux_loss_coef": 0.001}
    raise RuntimeFailure(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")


# ------------------------------------------------------------------------------------------------
# Random weights (BF16 dense), named exactly as the HF checkpoints name them

def _layer_is_moe(cfg: dict[str, Any], i: int) -> bool:
    if cfg["model_type"] == "deepseek_v3":
        return i >= cfg["first_k_dense_replace"]
    step = cfg.get("decoder_sparse_step", 1)
    return i not in (cfg.get("mlp_only_layers") or []) and cfg["num_experts"] > 0 and (i + 1) % step == 0


def iter_dense_weights(cfg: dict[str, Any], gen: torch.Generator, device: str):
    """Yield (layer index or None, {name: bf16/f32 tensor}) groups, one per decoder layer plus the ends.

    Scales keep activations O(1) so greedy decoding of a random model has clear argmax margins
    (needed for token-for-token comparisons)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]

    def lin(out: int, inp: int) -> torch.Tensor:
        return (torch.randn(out, inp, generator=gen, device=device) * (inp ** -0.5)).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen, device=device)).to(torch.bfloat16)

    yield None, {"model.embed_tokens.weight": torch.randn(V, H, generator=gen, device=device).to(torch.bfloat16)}
    ds = cfg["model_type"] == "deepseek_v3"
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t: dict[str, torch.Tensor] = {p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H)}
        a = p + "self_attn."
        nh = cfg["num_attention_heads"]
        if ds:
            qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            if cfg.get("q_lora_rank"):
                t[a + "q_a_proj.weight"] = lin(cfg["q_lora_rank"], H)
                t[a + "q_a_layernorm.weight"] = norm(cfg["q_lora_rank"])
                t[a + "q_b_proj.weight"] = lin(nh * qk, cfg["q_lora_rank"])
            else:
                t[a + "q_proj.weight"] = lin(nh * qk, H)
            t[a + "kv_a_proj_with_mqa.weight"] = lin(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], H)
            t[a + "kv_a_layernorm.weight"] = norm(cfg["kv_lora_rank"])
            t[a + "kv_b_proj.weight"] = lin(nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"])
            t[a + "o_proj.weight"] = lin(H, nh * cfg["v_head_dim"])
        else:
            hd, nkv = cfg["head_dim"], cfg["num_key_value_heads"]
            t[a + "q_proj.weight"] = lin(nh * hd, H)
            t[a + "k_proj.weight"] = lin(nkv * hd, H)
            t[a + "v_proj.weight"] = lin(nkv * hd, H)
            t[a + "o_proj.weight"] = lin(H, nh * hd)
            t[a + "q_norm.weight"] = norm(hd)
            t[a + "k_norm.weight"] = norm(hd)
        m = p + "mlp."
        if _layer_is_moe(cfg, i):
            E = cfg["n_routed_experts"] if ds else cfg["num_experts"]
            inter = cfg["moe_intermediate_size"]
            t[m + "gate.weight"] = lin(E, H)
            if ds:
                # noaux_tc bias: positive so that HF's masking of dropped groups cannot change the pick
                t[m + "gate.e_score_correction_bias"] = 0.1 * torch.rand(E, generator=gen, device=device)
                si = inter * cfg["n_shared_experts"]
                t[m + "shared_experts.gate_proj.weight"] = lin(si, H)
                t[m + "shared_experts.up_proj.weight"] = lin(si, H)
                t[m + "shared_experts.down_proj.weight"] = lin(H, si)
            for e in range(E):
                t[m + f"experts.{e}.gate_proj.weight"] = lin(inter, H)
                t[m + f"experts.{e}.up_proj.weight"] = lin(inter, H)
                t[m + f"experts.{e}.down_proj.weight"] = lin(H, inter)
        else:
            inter = cfg["intermediate_size"]
            t[m + "gate_proj.weight"] = lin(inter, H)
            t[m + "up_proj.weight"] = lin(inter, H)
            t[m + "down_proj.weight"] = lin(H, inter)
        yield i, t
    yield None, {"model.norm.weight": norm(H), "lm_head.weight": lin(V, H)}


# ------------------------------------------------------------------------------------------------
# Quantization of one layer's tensors into the on-disk layout of each format

def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def _is_quantizable_linear(name: str) -> bool:
    """Linears that DeepSeek-V3/Qwen3 FP8 checkpoints quantize: decoder projections, not router/embeddings."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()  # own storage: safetensors refuses shared memory


def quantize_layer(tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if fmt == "bf16":
        return {k: _to_cpu(v) for k, v in tensors.items()}
    if fmt == "fp8":
        for k, v in tensors.items():
            if _is_quantizable_linear(k):
                q = kcompat.quantize_fp8_block(v.float())
                out[k] = _to_cpu(q.weight)
                out[k[: -len("weight")] + "weight_scale_inv"] = _to_cpu(q.scale_inv.float())
            else:
                out[k] = _to_cpu(v)
        return out
    done: set[str] = set()
    for k, v in tensors.items():
        if k in done:
            continue
        if not _is_routed_expert(k):
            out[k] = _to_cpu(v)
            continue
        base = k.rsplit(".", 2)[0]  # ...experts.{e}
        if k.endswith("down_proj.weight"):
            groups = [[k]]
        else:
            groups = [[base + ".gate_proj.weight", base + ".up_proj.weight"]]
        for names in groups:
            w = torch.cat([tensors[n].float() for n in names], dim=0)  # gate+up share the global scale
            rows = [tensors[n].shape[0] for n in names]
            if fmt == "nvfp4":
                q = kcompat.quantize_nvfp4(w)
                gs = torch.as_tensor(q.global_scale, dtype=torch.float32).reshape(())
                for n, packed, bs in zip(names, q.packed.split(rows), q.block_scale.split(rows)):
                    stem = n[: -len("weight")]
                    out[n] = _to_cpu(packed)
                    out[stem + "weight_scale"] = _to_cpu(bs)
                    out[stem + "weight_scale_2"] = _to_cpu(gs)
                    # static activation scale (W4A4 kernels); amax of a unit-RMS activation / (6*448)
                    out[stem + "input_scale"] = torch.tensor(4.0 / 2688.0, dtype=torch.float32)
            elif fmt == "mxfp4":
                q = kcompat.quantize_mxfp4(w)
                for n, packed, sc in zip(names, q.packed.split(rows), q.scale.split(rows)):
                    out[n] = _to_cpu(packed)
                    out[n[: -len("weight")] + "weight_scale"] = _to_cpu(sc)
            else:
                raise RuntimeFailure(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
            done.update(names)
    return out


def quant_config(fmt: str, cfg: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(config.json quantization_config, hf_quant_config.json) as the real producers write them."""
    not_converted = ["lm_head", "model.embed_tokens", "*.mlp.gate", "*self_attn*", "*shared_experts*", "*mlp.gate_proj",
                     "*mlp.up_proj", "*mlp.down_proj"]
    if fmt == "bf16":
        return None, None
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, None
    if fmt == "nvfp4":
        q = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_scheme": None,
             "ignore": not_converted, "producer": {"name": "modelopt", "version": "0.37.0"}}
        hf = {"producer": {"name": "modelopt", "version": "0.37.0"},
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                               "exclude_modules": not_converted}}
        return q, hf
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": not_converted,
                "weight_layout": "per-expert weight U8 [out,in/2] + weight_scale U8 E8M0 [out,in/32]"}, None
    raise RuntimeFailure(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")


def make_checkpoint(out_dir: str | Path, arch: str, fmt: str, size: str = "tiny", seed: int = 0,
                    device: str = "cpu", shard_bytes: int | None = None,
                    log: Callable[[str], None] = lambda s: None) -> Path:
    if fmt not in FORMATS:
        raise RuntimeFailure(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if size not in SIZES:
        raise RuntimeFailure(f"unknown --size {size!r}; choose one of {', '.join(SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(arch, size)
    ids = build_tokenizer_files(out, min(cfg["vocab_size"], 512), cfg["max_position_embeddings"])
    cfg.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["eos"])
    qc, hfq = quant_config(fmt, cfg)
    if qc is not None:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if hfq is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(hfq, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "do_sample": False}, indent=2))

    # Tiny checkpoints are split per layer so multi-shard loading is always exercised.
    shard_bytes = shard_bytes or (1 << 16 if size == "tiny" else 2 << 30)
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    t0 = time.time()
    for layer, dense in iter_dense_weights(cfg, gen, device):
        q = quantize_layer(dense, fmt)
        cur = sum(v.numel() * v.element_size() for v in shards[-1].values())
        if shards[-1] and cur + sum(v.numel() * v.element_size() for v in q.values()) > shard_bytes:
            shards.append({})
        shards[-1].update(q)
        log(f"make-checkpoint: {'layer ' + str(layer) if layer is not None else 'embeddings/head'} done ({time.time() - t0:.1f}s)")
    weight_map, total = {}, 0
    n = len(shards)
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    log(f"make-checkpoint: wrote {n} shards, {total / 1e9:.3f} GB to {out} in {time.time() - t0:.1f}s")
    return out
