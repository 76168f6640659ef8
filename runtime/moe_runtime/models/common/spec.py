"""Checkpoint tensor specs: what a tensor must look like (shape, dtypes), and the specs of a model in
the Hugging Face layout the per-expert architectures share (routed experts as
`experts.{e}.{gate,up,down}_proj`, or fused as transformers >= 5 holds them), in each expert format.
Pure functions of the shapes an architecture declares (its `dense_shapes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moe_core.formats import FP4_EXPERT

from ...errors import RuntimeFailure

FLOAT_DTYPES = ("BF16", "F16", "F32")

Shapes = list[tuple[int | None, dict[str, tuple[int, ...]]]]  # [(layer or None, {name: shape})]


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


def is_routed_expert_weight(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def is_fp8_linear(name: str) -> bool:
    """Decoder projections: what block-FP8 checkpoints quantize, and what ModelOpt may quantize
    besides the routed experts (dense MLPs, shared experts)."""
    return name.startswith("model.layers.") and name.endswith("proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")


def per_expert_specs(shapes: Shapes, expert_format: str, quantized_linears: set[str] | None,
                     fused_layers: set[int], fused_dims: tuple[int, int, int]) -> dict[str, Spec]:
    """Expected tensors of `shapes` (the unquantized model). Routed experts must be in `expert_format`.
    `quantized_linears`: other decoder linears that the headers show quantized in the same scheme (F8
    for fp8, U8 for nvfp4/mxfp4); real checkpoints differ in which of those they quantize (block FP8:
    all, ModelOpt NVFP4: often dense MLPs and shared experts too), so those are accepted either way and
    dequantised at load. With None (fp8 only), every decoder linear is expected quantized.
    `fused_layers`: MoE layers stored fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
    [E, H, I], bf16 only); fused_dims = (E, I, H)."""
    specs: dict[str, Spec] = {}
    for _, group in shapes:
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
        E, inter, H = fused_dims
        specs[m + "experts.gate_up_proj"] = Spec((E, 2 * inter, H), FLOAT_DTYPES)
        specs[m + "experts.down_proj"] = Spec((E, H, inter), FLOAT_DTYPES)
    return specs


def per_expert_shapes(m: str, E: int, inter: int, H: int) -> dict[str, tuple[int, ...]]:
    """The routed experts of MoE layer prefix `m` (`model.layers.{i}.mlp.`), one tensor per expert and projection."""
    t: dict[str, tuple[int, ...]] = {}
    for e in range(E):
        t[m + f"experts.{e}.gate_proj.weight"] = (inter, H)
        t[m + f"experts.{e}.up_proj.weight"] = (inter, H)
        t[m + f"experts.{e}.down_proj.weight"] = (H, inter)
    return t


def model_ends(cfg: dict[str, Any], layers: Shapes) -> Shapes:
    """The embeddings before the decoder layers, the final norm and lm_head (unless tied) after them."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    tail = {"model.norm.weight": (H,)}
    if not cfg.get("tie_word_embeddings"):
        tail["lm_head.weight"] = (V, H)
    return [(None, {"model.embed_tokens.weight": (V, H)})] + layers + [(None, tail)]


# FP8 KV cache scales a checkpoint may carry per attention layer (vLLM 0.11.0 weight_utils.py
# maybe_remap_kv_scale_name: self_attn.{k,v}_scale, ModelOpt's k_proj.k_scale / v_proj.v_scale, the
# older single kv_scale); read only with --kv-cache-dtype fp8, never required.
KV_SCALE_NAMES = ("k_scale", "v_scale", "kv_scale", "k_proj.k_scale", "v_proj.v_scale")


def kv_scale_specs(cfg: dict[str, Any]) -> dict[str, Spec]:
    return {f"model.layers.{i}.self_attn.{n}": Spec((), ("F32", "BF16", "F16"), optional=True, alt_shapes=((1,),))
            for i in range(cfg["num_hidden_layers"]) for n in KV_SCALE_NAMES}

