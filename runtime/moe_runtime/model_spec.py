"""What a checkpoint of a supported architecture must contain: tensor names, shapes and dtypes.

Pure functions of config.json (+ the expert weight format). The checkpoint writer generates exactly
these tensors and the loader validates a checkpoint's safetensors headers against them, so the two
cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moe_core.formats import FP4_EXPERT
from moe_core.runtime import BUNDLED

from .errors import RuntimeFailure

FLOAT_DTYPES = ("BF16", "F16", "F32")


def arch_of(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else None
    if name not in BUNDLED.architectures:
        raise RuntimeFailure(f"unsupported architecture {name!r}: the bundled runtime serves "
                             f"{', '.join(BUNDLED.architectures)}")
    return BUNDLED.architectures[name]


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts under any spelling (config_keys.ALIASES: n_routed_experts / num_experts /
    num_local_experts)."""
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def is_moe_layer(cfg: dict[str, Any], i: int) -> bool:
    if arch_of(cfg) == "deepseek_v3":
        return num_experts(cfg) > 0 and i >= int(cfg.get("first_k_dense_replace") or 0) and \
            i % int(cfg.get("moe_layer_freq") or 1) == 0
    step = int(cfg.get("decoder_sparse_step") or 1)
    return i not in (cfg.get("mlp_only_layers") or []) and num_experts(cfg) > 0 and (i + 1) % step == 0


def dense_shapes(cfg: dict[str, Any]) -> list[tuple[int | None, dict[str, tuple[int, ...]]]]:
    """[(layer or None, {name: shape})] of the unquantized model, in checkpoint order."""
    if arch_of(cfg) == "gpt_oss":
        return gpt_oss_shapes(cfg)
    ds = arch_of(cfg) == "deepseek_v3"
    H, V, nh = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    groups: list[tuple[int | None, dict[str, tuple[int, ...]]]] = [(None, {"model.embed_tokens.weight": (V, H)})]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
        a = p + "self_attn."
        if ds:
            qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            if cfg.get("q_lora_rank"):
                t[a + "q_a_proj.weight"] = (cfg["q_lora_rank"], H)
                t[a + "q_a_layernorm.weight"] = (cfg["q_lora_rank"],)
                t[a + "q_b_proj.weight"] = (nh * qk, cfg["q_lora_rank"])
            else:
                t[a + "q_proj.weight"] = (nh * qk, H)
            t[a + "kv_a_proj_with_mqa.weight"] = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], H)
            t[a + "kv_a_layernorm.weight"] = (cfg["kv_lora_rank"],)
            t[a + "kv_b_proj.weight"] = (nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"])
            t[a + "o_proj.weight"] = (H, nh * cfg["v_head_dim"])
        else:
            hd = cfg.get("head_dim") or H // nh
            nkv = cfg["num_key_value_heads"]
            t[a + "q_proj.weight"] = (nh * hd, H)
            t[a + "k_proj.weight"] = (nkv * hd, H)
            t[a + "v_proj.weight"] = (nkv * hd, H)
            t[a + "o_proj.weight"] = (H, nh * hd)
            t[a + "q_norm.weight"] = (hd,)
            t[a + "k_norm.weight"] = (hd,)
        m = p + "mlp."
        if is_moe_layer(cfg, i):
            E, inter = num_experts(cfg), cfg["moe_intermediate_size"]
            t[m + "gate.weight"] = (E, H)
            if ds:
                t[m + "gate.e_score_correction_bias"] = (E,)
                si = inter * int(cfg.get("n_shared_experts") or 0)
                if si:
                    t[m + "shared_experts.gate_proj.weight"] = (si, H)
                    t[m + "shared_experts.up_proj.weight"] = (si, H)
                    t[m + "shared_experts.down_proj.weight"] = (H, si)
            for e in range(E):
                t[m + f"experts.{e}.gate_proj.weight"] = (inter, H)
                t[m + f"experts.{e}.up_proj.weight"] = (inter, H)
                t[m + f"experts.{e}.down_proj.weight"] = (H, inter)
        else:
            inter = cfg["intermediate_size"]
            t[m + "gate_proj.weight"] = (inter, H)
            t[m + "up_proj.weight"] = (inter, H)
            t[m + "down_proj.weight"] = (H, inter)
        groups.append((i, t))
    tail = {"model.norm.weight": (H,)}
    if not cfg.get("tie_word_embeddings"):
        tail["lm_head.weight"] = (V, H)
    groups.append((None, tail))
    return groups


def is_routed_expert_weight(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def is_fp8_linear(name: str) -> bool:
    """Decoder projections: what block-FP8 checkpoints (DeepSeek-V3, Qwen3-FP8) quantize, and what
    ModelOpt may quantize besides the routed experts (dense MLPs, shared experts)."""
    return name.startswith("model.layers.") and name.endswith("proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    optional: bool = False
    alt_shapes: tuple[tuple[int, ...], ...] = ()

    def shape_ok(self, shape: tuple[int, ...]) -> bool:
        return shape == self.shape or shape in self.alt_shapes

    def describe(self) -> str:
        return f"shape {list(self.shape)} dtype {'/'.join(self.dtypes)}"


def fused_expert_layers(cfg: dict[str, Any], names) -> set[int]:
    """MoE layers whose routed experts are stored fused, as transformers >= 5 holds them in memory
    (Qwen3MoeExperts / DeepseekV3NaiveMoe: `experts.gate_up_proj` [E, 2I, H] with gate rows first,
    `experts.down_proj` [E, H, I]) rather than per expert (`experts.{e}.gate_proj.weight`, what
    save_pretrained writes back through its conversion mapping and what the hub has)."""
    names = set(names)
    return {i for i in range(cfg["num_hidden_layers"])
            if is_moe_layer(cfg, i) and f"model.layers.{i}.mlp.experts.gate_up_proj" in names}


def tensor_specs(cfg: dict[str, Any], expert_format: str, quantized_linears: set[str] | None = None,
                 fused_layers: set[int] = frozenset()) -> dict[str, Spec]:
    """Expected tensors. Routed experts must be in `expert_format`. `quantized_linears`: other
    decoder linears that the headers show quantized in the same scheme (F8 for fp8, U8 for
    nvfp4/mxfp4); real checkpoints differ in which of those they quantize (DeepSeek-V3 FP8: all,
    ModelOpt NVFP4: often dense MLPs and shared experts too), so those are accepted either way and
    dequantised at load. With None (fp8 only), every decoder linear is expected quantized."""
    if arch_of(cfg) == "gpt_oss":
        return gpt_oss_specs(cfg, expert_format)
    specs: dict[str, Spec] = {}
    for _, group in dense_shapes(cfg):
        for name, shape in group.items():
            stem = name[: -len("weight")]
            out = shape[0]
            inp = shape[-1]
            if is_routed_expert_weight(name) and expert_format in FP4_EXPERT or (
                    expert_format in FP4_EXPERT and quantized_linears and name in quantized_linears):
                block = 16 if expert_format == "nvfp4" else 32
                if inp % block:
                    raise RuntimeFailure(f"{name}: input dim {inp} is not a multiple of the {expert_format} block {block}")
                specs[name] = Spec((out, inp // 2), ("U8",))
                if expert_format == "nvfp4":
                    specs[stem + "weight_scale"] = Spec((out, inp // 16), ("F8_E4M3",))
                    specs[stem + "weight_scale_2"] = Spec((), ("F32",), alt_shapes=((1,),))
                    specs[stem + "input_scale"] = Spec((), ("F32",), optional=True, alt_shapes=((1,),))
                else:
                    specs[stem + "weight_scale"] = Spec((out, inp // 32), ("U8",))
            elif expert_format == "fp8" and is_fp8_linear(name) and (
                    is_routed_expert_weight(name) or quantized_linears is None or name in quantized_linears):
                specs[name] = Spec(shape, ("F8_E4M3",))
                specs[stem + "weight_scale_inv"] = Spec((math.ceil(out / 128), math.ceil(inp / 128)), ("F32", "BF16"))
            else:
                specs[name] = Spec(shape, FLOAT_DTYPES)
    for i in fused_layers:
        if expert_format != "bf16":
            raise RuntimeFailure(f"model.layers.{i}.mlp.experts.gate_up_proj: fused routed experts are read in bf16 "
                                 f"checkpoints only, this one has {expert_format} experts")
        m = f"model.layers.{i}.mlp."
        for n in [n for n in specs if n.startswith(m + "experts.")]:
            del specs[n]
        E, inter, H = num_experts(cfg), cfg["moe_intermediate_size"], cfg["hidden_size"]
        specs[m + "experts.gate_up_proj"] = Spec((E, 2 * inter, H), FLOAT_DTYPES)
        specs[m + "experts.down_proj"] = Spec((E, H, inter), FLOAT_DTYPES)
    return specs


# ------------------------------------------------------------------------------------------------
# gpt-oss (GptOssForCausalLM): its own names, read from transformers 5.24's modeling_gpt_oss.py and
# the openai/gpt-oss release. Every layer is MoE; attention has q/k/v/o biases (attention_bias) and a
# per-head `sinks` logit; the router is `mlp.router` with a bias; the experts are fused and stored
# transposed against the other families: `experts.gate_up_proj` [E, H, 2I] (gate and up columns
# interleaved: gate = [..., ::2], up = [..., 1::2]), `experts.down_proj` [E, I, H], each with a bias.
# The release stores the experts in MXFP4 as `*_blocks` uint8 [E, N, K/32, 16] (two E2M1 codes per
# byte, low nibble first) and `*_scales` uint8 E8M0 [E, N, K/32] over the untransposed [E, N, K]
# weight (gate_up: N = 2I rows, interleaved, K = H; down: N = H, K = I).

def gpt_oss_dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    """(H, V, heads, kv heads, head_dim, experts, expert intermediate)."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    return (H, cfg["vocab_size"], nh, cfg.get("num_key_value_heads") or nh, cfg.get("head_dim") or H // nh,
            num_experts(cfg), cfg["intermediate_size"])


def gpt_oss_shapes(cfg: dict[str, Any]) -> list[tuple[int | None, dict[str, tuple[int, ...]]]]:
    H, V, nh, nkv, hd, E, inter = gpt_oss_dims(cfg)
    bias = cfg.get("attention_bias", True)  # GptOssConfig's default
    groups: list[tuple[int | None, dict[str, tuple[int, ...]]]] = [(None, {"model.embed_tokens.weight": (V, H)})]
    for i in range(cfg["num_hidden_layers"]):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        t: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
        for proj, out, inp in (("q_proj", nh * hd, H), ("k_proj", nkv * hd, H), ("v_proj", nkv * hd, H), ("o_proj", H, nh * hd)):
            t[a + proj + ".weight"] = (out, inp)
            if bias:
                t[a + proj + ".bias"] = (out,)
        t[a + "sinks"] = (nh,)
        t[m + "router.weight"] = (E, H)
        t[m + "router.bias"] = (E,)
        t[m + "experts.gate_up_proj"] = (E, H, 2 * inter)
        t[m + "experts.gate_up_proj_bias"] = (E, 2 * inter)
        t[m + "experts.down_proj"] = (E, inter, H)
        t[m + "experts.down_proj_bias"] = (E, H)
        groups.append((i, t))
    tail = {"model.norm.weight": (H,)}
    if not cfg.get("tie_word_embeddings"):
        tail["lm_head.weight"] = (V, H)
    groups.append((None, tail))
    return groups


def gpt_oss_specs(cfg: dict[str, Any], expert_format: str) -> dict[str, Spec]:
    """bf16: every tensor float. mxfp4: the experts' two weights as `*_blocks` / `*_scales` (their
    biases stay float), as the release and transformers' Mxfp4 integration store them."""
    if expert_format not in ("bf16", "mxfp4"):
        raise RuntimeFailure(f"gpt-oss experts are read in bf16 or mxfp4 checkpoints, not {expert_format}")
    specs: dict[str, Spec] = {}
    for _, group in gpt_oss_shapes(cfg):
        for name, shape in group.items():
            if expert_format == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                E, k, n = shape  # stored transposed in bf16; the blocks are over [E, N, K]
                if k % 32:
                    raise RuntimeFailure(f"{name}: input dim {k} is not a multiple of the mxfp4 block 32")
                specs[name + "_blocks"] = Spec((E, n, k // 32, 16), ("U8",))
                specs[name + "_scales"] = Spec((E, n, k // 32), ("U8",))
            else:
                specs[name] = Spec(shape, FLOAT_DTYPES)
    return specs
