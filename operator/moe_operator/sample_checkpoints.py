"""Header-faithful sample checkpoints for the planner demo and tests (stdlib only, no torch).

Each sample has the config.json keys and quantization config a real checkpoint of that family
writes, plus a tiny safetensors file whose tensor *names and dtypes* match the real layout (the
planner only reads headers). They are not runnable models: `moe-runtime make-checkpoint` makes those.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

_DT_BYTES = {"BF16": 2, "F32": 4, "F16": 2, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I32": 4}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], seed: int = 0) -> None:
    """Write a valid safetensors file with random bytes for each (dtype, shape)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name, (dtype, shape) in tensors.items():
        n = _DT_BYTES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        blobs.append(os.urandom(n))
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


_FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}

_DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "first_k_dense_replace": 3,
    "num_hidden_layers": 61, "kv_lora_rank": 512, "q_lora_rank": 1536, "vocab_size": 129280,
}
_DSV4 = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "num_hidden_layers": 43, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "expert_dtype": "fp4",
    "vocab_size": 129280,
}

SAMPLES: dict[str, dict] = {
    "deepseek-v4-flash-fp4": {
        "config": {**_DSV4, "quantization_config": {**_FP8_BLOCK, "scale_fmt": "ue8m0"}},
        "tensors": {
            "model.embed_tokens.weight": ("BF16", [16, 8]),
            "model.layers.3.mlp.experts.0.w1.weight": ("I8", [8, 4]),
            "model.layers.3.mlp.experts.0.w1.scale": ("F8_E8M0", [8, 1]),
            "model.layers.3.self_attn.wq_a.weight": ("F8_E4M3", [8, 8]),
            "model.layers.3.self_attn.wq_a.scale": ("F32", [1, 1]),
        },
    },
    "deepseek-v4-pro-nvfp4": {
        "config": {**_DSV4, "hidden_size": 7168, "num_experts_per_tok": 6, "n_routed_experts": 384,
                   "quantization_config": {**_FP8_BLOCK, "quant_algo": "MIXED_PRECISION", "moe_quant_algo": "NVFP4",
                                           "group_size": 16}},
        "hf_quant_config": {"producer": {"name": "modelopt"},
                            "quantization": {"quant_algo": "MIXED_PRECISION", "group_size": 16, "exclude_modules": []}},
        "tensors": {
            "model.layers.3.mlp.experts.0.w1.weight": ("U8", [8, 8]),
            "model.layers.3.mlp.experts.0.w1.weight_scale": ("F8_E4M3", [8, 1]),
            "model.layers.3.mlp.experts.0.w1.weight_scale_2": ("F32", []),
        },
    },
    "deepseek-v3-nvfp4": {
        "config": {**_DSV3, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                                    "kv_cache_scheme": {"type": "float", "num_bits": 8}, "ignore": ["lm_head"]}},
        "hf_quant_config": {"producer": {"name": "modelopt"},
                            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                                             "exclude_modules": ["lm_head"]}},
        "tensors": {
            "model.layers.3.mlp.experts.0.gate_proj.weight": ("U8", [16, 8]),
            "model.layers.3.mlp.experts.0.gate_proj.weight_scale": ("F8_E4M3", [16, 1]),
            "model.layers.3.mlp.experts.0.gate_proj.weight_scale_2": ("F32", []),
            "model.layers.3.mlp.experts.0.gate_proj.input_scale": ("F32", []),
            "model.layers.3.mlp.shared_experts.gate_proj.weight": ("BF16", [16, 16]),
        },
    },
    "deepseek-v3-fp8": {
        "config": {**_DSV3, "quantization_config": _FP8_BLOCK},
        "tensors": {
            "model.layers.3.mlp.experts.0.gate_proj.weight": ("F8_E4M3", [16, 16]),
            "model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv": ("F32", [1, 1]),
        },
    },
    "kimi-k2-fp8": {
        "config": {**_DSV3, "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
                   "quantization_config": _FP8_BLOCK},
        "tensors": {"model.layers.3.mlp.experts.0.gate_proj.weight": ("F8_E4M3", [16, 16]),
                    "model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv": ("F32", [1, 1])},
    },
    "gpt-oss-120b-mxfp4": {
        "config": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
                   "intermediate_size": 2880, "num_local_experts": 128, "num_experts_per_tok": 4,
                   "num_hidden_layers": 36, "quantization_config": {"quant_method": "mxfp4",
                                                                    "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}},
        "tensors": {
            "model.layers.0.mlp.experts.gate_up_proj_blocks": ("U8", [2, 8, 1, 16]),
            "model.layers.0.mlp.experts.gate_up_proj_scales": ("U8", [2, 8, 1]),
            "model.layers.0.mlp.experts.gate_up_proj_bias": ("BF16", [2, 8]),
        },
    },
    "qwen3-moe-235b-fp8": {
        "config": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
                   "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128,
                   "num_experts_per_tok": 8, "norm_topk_prob": True, "num_hidden_layers": 94,
                   "quantization_config": _FP8_BLOCK},
        "tensors": {
            "model.layers.0.mlp.experts.0.gate_proj.weight": ("F8_E4M3", [16, 16]),
            "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv": ("F32", [1, 1]),
        },
    },
}


def _write_configs(name: str, directory: str | Path) -> Path:
    sample = SAMPLES[name]
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(sample["config"], indent=2) + "\n")
    if "hf_quant_config" in sample:
        (d / "hf_quant_config.json").write_text(json.dumps(sample["hf_quant_config"], indent=2) + "\n")
    return d


def write_sample(name: str, directory: str | Path) -> Path:
    d = _write_configs(name, directory)
    write_safetensors(d / "model-00001-of-00001.safetensors", SAMPLES[name]["tensors"])
    return d


# ---------------------------------------------------------------------------------------------
# Full-size layouts: every tensor of the real checkpoint with its real shape, in sparse files (the
# data section is a hole: no disk used), so sizing reads the true byte count through the same
# header path as a real checkpoint. DeepSeek-V3 family (MLA attention, dense first layers, routed +
# shared experts, the MTP layer the real checkpoints ship).

def deepseek_v3_layout(config: dict, experts: str) -> dict[str, tuple[str, list[int]]]:
    """experts: 'nvfp4' (ModelOpt: U8 E2M1 pairs, F8_E4M3 scale per 16, F32 global/input scales) or 'fp8'
    (F8_E4M3 with F32 128x128 block scales). Attention, shared experts, dense MLPs, embeddings: BF16."""
    h, inter, moe_inter = config["hidden_size"], config["intermediate_size"], config["moe_intermediate_size"]
    heads = config.get("num_attention_heads", 128)
    q_rank, kv_rank = config.get("q_lora_rank", 1536), config.get("kv_lora_rank", 512)
    rope, nope, v_dim = config.get("qk_rope_head_dim", 64), config.get("qk_nope_head_dim", 128), config.get("v_head_dim", 128)
    vocab, n_exp, dense = config["vocab_size"], config["n_routed_experts"], config.get("first_k_dense_replace", 3)
    layers = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 1)
    t: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [vocab, h]), "model.norm.weight": ("BF16", [h]),
                                           "lm_head.weight": ("BF16", [vocab, h])}

    def linear(name: str, out: int, inp: int, quant: str) -> None:
        if quant == "nvfp4":
            t[name + ".weight"] = ("U8", [out, inp // 2])
            t[name + ".weight_scale"] = ("F8_E4M3", [out, inp // 16])
            t[name + ".weight_scale_2"] = ("F32", [])
            t[name + ".input_scale"] = ("F32", [])
        elif quant == "fp8":
            t[name + ".weight"] = ("F8_E4M3", [out, inp])
            t[name + ".weight_scale_inv"] = ("F32", [-(-out // 128), -(-inp // 128)])
        else:
            t[name + ".weight"] = ("BF16", [out, inp])

    for i in range(layers):
        p = f"model.layers.{i}"
        t[p + ".input_layernorm.weight"] = ("BF16", [h])
        t[p + ".post_attention_layernorm.weight"] = ("BF16", [h])
        a = p + ".self_attn"
        linear(a + ".q_a_proj", q_rank, h, "bf16")
        t[a + ".q_a_layernorm.weight"] = ("BF16", [q_rank])
        linear(a + ".q_b_proj", heads * (nope + rope), q_rank, "bf16")
        linear(a + ".kv_a_proj_with_mqa", kv_rank + rope, h, "bf16")
        t[a + ".kv_a_layernorm.weight"] = ("BF16", [kv_rank])
        linear(a + ".kv_b_proj", heads * (nope + v_dim), kv_rank, "bf16")
        linear(a + ".o_proj", h, heads * v_dim, "bf16")
        if i < dense:
            for proj, (o, n) in {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}.items():
                linear(f"{p}.mlp.{proj}", o, n, "bf16")
            continue
        t[p + ".mlp.gate.weight"] = ("BF16", [n_exp, h])
        t[p + ".mlp.gate.e_score_correction_bias"] = ("F32", [n_exp])
        shapes = {"gate_proj": (moe_inter, h), "up_proj": (moe_inter, h), "down_proj": (h, moe_inter)}
        for proj, (o, n) in shapes.items():
            s = config.get("n_shared_experts", 1)  # the shared experts are one MLP s times as wide
            linear(f"{p}.mlp.shared_experts.{proj}", o * s if proj != "down_proj" else o, n if proj != "down_proj" else n * s, "bf16")
            for e in range(n_exp):
                linear(f"{p}.mlp.experts.{e}.{proj}", o, n, experts)
    return t


def write_sparse_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A valid safetensors file whose data section is a hole of the right size; returns the data bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = _DT_BYTES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


FULL_SIZE = {"deepseek-v3-nvfp4": "nvfp4", "deepseek-v3-fp8": "fp8", "kimi-k2-fp8": "fp8"}


def write_full_size(name: str, directory: str | Path) -> Path:
    """The sample's config files with a full-size sparse safetensors file of the real layout."""
    d = _write_configs(name, directory)
    write_sparse_safetensors(d / "model-00001-of-00001.safetensors",
                             deepseek_v3_layout(SAMPLES[name]["config"], FULL_SIZE[name]))
    return d


if __name__ == "__main__":  # regenerate deploy/samples/checkpoints
    import sys

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "deploy/samples/checkpoints")
    for n in SAMPLES:
        print(write_sample(n, root / n))
