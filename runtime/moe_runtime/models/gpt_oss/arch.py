"""GptOssForCausalLM: its checkpoint tensors, config keys and checks, shard rules, expert stacking,
the configs and on-disk layout `make-checkpoint` writes, and its experts backend.

Tensor names read from transformers 5.24's modeling_gpt_oss.py and the openai/gpt-oss release.
Every layer is MoE; attention has q/k/v/o biases (attention_bias) and a per-head `sinks` logit; the
router is `mlp.router` with a bias; the experts are fused and stored transposed against the other
families: `experts.gate_up_proj` [E, H, 2I] (gate and up columns interleaved: gate = [..., ::2],
up = [..., 1::2]), `experts.down_proj` [E, I, H], each with a bias. The release stores the experts in
MXFP4 as `*_blocks` uint8 [E, N, K/32, 16] (two E2M1 codes per byte, low nibble first) and
`*_scales` uint8 E8M0 [E, N, K/32] over the untransposed [E, N, K] weight (gate_up: N = 2I rows,
interleaved, K = H; down: N = H, K = I). It is written and read in bf16 and mxfp4 only
(moe_core.runtime: the formats the runtime reads for it).
"""

from __future__ import annotations

from typing import Any

import torch
from moe_kernels.formats import quantize_mxfp4

from ...errors import RuntimeFailure
from ..common.arch import ArchBase, gqa_problems, num_experts
from ..common.config import BOOL, POS_FLOAT, POSITIVE, Key
from ..common.spec import FLOAT_DTYPES, Spec, model_ends
from . import model
from .experts import stack_experts

SIZES = {
    # sliding_window 8 (real: 128) so that short CPU prompts cross it; YaRN as the release writes it,
    # scaled down (factor 32 over 4096 positions there)
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                 max_position_embeddings=1024,
                 rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 256}),
    # gpt-oss-20b's layer (hidden 2880, 32 experts top-4, 64 heads / 8 KV of 64), 4 layers, small vocab
    "small": dict(vocab_size=16384, hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
                  num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                  num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                  rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 4096}),
}


def dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    """(H, V, heads, kv heads, head_dim, experts, expert intermediate)."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    return (H, cfg["vocab_size"], nh, cfg.get("num_key_value_heads") or nh, cfg.get("head_dim") or H // nh,
            num_experts(cfg), cfg["intermediate_size"])


def quantize_experts(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The fused expert weight `name` as held in bf16, [E, K, N] (gate_up: [E, H, 2I] with gate and up
    interleaved; down: [E, I, H]), in the release's MXFP4 layout: the blocks run along K of the
    [E, N, K] weight, `name_blocks` U8 [E, N, K/32, 16] (byte j of a block holds elements 2j (low
    nibble) and 2j+1) and `name_scales` U8 E8M0 [E, N, K/32]. The interleaved rows stay interleaved."""
    q = quantize_mxfp4(w.float().transpose(1, 2))  # packed [E, N, K/2], scale [E, N, K/32]
    E, N, half = q.packed.shape
    own = lambda t: t.detach().to("cpu", copy=True).contiguous()  # noqa: E731 - safetensors refuses shared memory
    return {name + "_blocks": own(q.packed.reshape(E, N, half // 16, 16)), name + "_scales": own(q.scale)}


class GptOssArch(ArchBase):
    name = "gpt_oss"
    hf_class = "GptOssForCausalLM"
    aliases = {"num_local_experts": ("num_experts",),  # GptOssConfig's attribute_map
               # not a transformers rename: GptOssConfig's intermediate_size is its experts' width,
               # which the other families (and config checks) call moe_intermediate_size
               "moe_intermediate_size": ("intermediate_size",)}
    default_theta = 150000.0  # GptOssConfig's default_theta
    required = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
    experts_key = "num_local_experts"
    # its own config.json keys (the shared ones: models.common.config.COMMON_KEYS)
    config_keys = {"sliding_window": POSITIVE, "swiglu_alpha": POS_FLOAT, "swiglu_limit": POS_FLOAT,
                   "attention_bias": BOOL, "layer_types": Key("strs")}

    def dense_shapes(self, cfg: dict[str, Any]):
        H, V, nh, nkv, hd, E, inter = dims(cfg)
        bias = cfg.get("attention_bias", True)  # GptOssConfig's default
        layers = []
        for i in range(cfg["num_hidden_layers"]):
            p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            t: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
            for proj, out, inp in (("q_proj", nh * hd, H), ("k_proj", nkv * hd, H), ("v_proj", nkv * hd, H),
                                   ("o_proj", H, nh * hd)):
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
            layers.append((i, t))
        return model_ends(cfg, layers)

    def tensor_specs(self, cfg: dict[str, Any], expert_format: str, quantized_linears=None,
                     fused_layers=frozenset()) -> dict[str, Spec]:
        """bf16: every tensor float. mxfp4: the experts' two weights as `*_blocks` / `*_scales` (their
        biases stay float), as the release and transformers' Mxfp4 integration store them. (Its experts
        are always fused: `fused_layers` says nothing here.)"""
        if expert_format not in ("bf16", "mxfp4"):
            raise RuntimeFailure(f"gpt-oss experts are read in bf16 or mxfp4 checkpoints, not {expert_format}")
        specs: dict[str, Spec] = {}
        for _, group in self.dense_shapes(cfg):
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

    def stack_experts(self, raw, prefix, num_experts, fmt, dtype, log, expert_rank0=True):
        # TP inside the experts: one rank of the expert group adds down's bias (the combine sums them)
        return stack_experts(raw, prefix, fmt, dtype, down_bias=expert_rank0)

    def config_problems(self, cfg: dict[str, Any], moe_layers: list[int]) -> list[str]:
        out = []
        layers = cfg.get("num_hidden_layers") or 0
        if (types := cfg.get("layer_types")) is not None and (
                len(types) != layers or set(types) - {"sliding_attention", "full_attention"}):
            shown = repr(types) if len(repr(types)) <= 80 else repr(types)[:77] + "..."
            out.append(f"layer_types = {shown}: must name sliding_attention or full_attention for each of the "
                       f"{layers} layers")
        return out + gqa_problems(cfg)

    def dense_intermediate(self, cfg: dict[str, Any]) -> int:
        return 0  # no dense MLP: its intermediate_size is the experts'

    # ---- shard rules

    def shard_rule(self, plan, name: str):
        if ".mlp.experts." in name:
            parts = name.split(".")
            return self._expert_rule(plan, parts[parts.index("experts") + 1])
        return plan.default_rule(name)

    def _expert_rule(self, plan, tag: str):
        """The fused expert tensors (dense_shapes): this rank's experts [lo, hi) on dimension 0 and, with
        TP inside the experts (etp > 1), its part of the intermediate dimension: gate_up's 2I columns
        (bf16 [E, H, 2I], its bias [E, 2I]) or rows (mxfp4 blocks [E, 2I, H/32, 16], scales
        [E, 2I, H/32]), a contiguous part of the gate/up-interleaved 2I holding gate and up of the same
        intermediate slice; down's I rows (bf16 [E, I, H]) or its I/32 blocks (mxfp4 [E, H, I/32, 16]
        and [E, H, I/32]). down's bias [E, H] is read whole by every rank of the expert group; only etp
        rank 0 adds it (the loader zeroes it elsewhere: experts.stack_experts). The intermediate parts
        may be uneven (_inter_range): gpt-oss-20b/120b's 2880 is 90 MXFP4 blocks, which 4 or 8 ranks
        do not divide."""
        lay, rules = plan.lay, []
        if lay.ep > 1:
            rules.append(("range", 0, plan.expert_lo, plan.expert_hi))
        if lay.etp > 1:
            lo, hi = self._inter_range(plan)
            g = 32 if plan.fmt == "mxfp4" else 1
            dim_range = {"gate_up_proj": (2, 2 * lo, 2 * hi), "gate_up_proj_bias": (1, 2 * lo, 2 * hi),
                         "gate_up_proj_blocks": (1, 2 * lo, 2 * hi), "gate_up_proj_scales": (1, 2 * lo, 2 * hi),
                         "down_proj": (1, lo, hi), "down_proj_blocks": (2, lo // g, hi // g),
                         "down_proj_scales": (2, lo // g, hi // g)}.get(tag)
            if dim_range is not None:
                rules.append(("range", *dim_range))
        if not rules:
            return None
        return rules[0] if len(rules) == 1 else ("all", *rules)

    @staticmethod
    def _inter_range(plan) -> tuple[int, int]:
        """This rank's intermediate rows [lo, hi) inside its experts: whole blocks of the expert format
        (mxfp4 32, bf16 1), spread as evenly as they go (parts differ by at most one block)."""
        lay, g = plan.lay, 32 if plan.fmt == "mxfp4" else 1
        nb = plan.cfg["intermediate_size"] // g
        return lay.etp_rank * nb // lay.etp * g, (lay.etp_rank + 1) * nb // lay.etp * g

    def shard_problems(self, plan) -> list[str]:
        lay, key = plan.lay, "intermediate_size"
        inter, group = plan.cfg[key], plan.block()
        if lay.etp > 1 and inter % group == 0:
            # its own torch experts take uneven parts (whole blocks: _inter_range)
            if inter // group < lay.etp:
                return [f"{key} {inter} split {lay.etp} ways inside the experts (world {lay.world} / --ep "
                        f"{lay.ep}) needs a whole {plan.fmt} block of {group} per rank ({inter // group} "
                        f"blocks); use --ep {lay.world} (whole experts per rank)"]
            return []
        return plan.even_expert_split_problems(key)

    # ---- checkpoint writer

    def writer_config(self, size: str, common: dict[str, Any]) -> dict[str, Any]:
        c = {"architectures": [self.hf_class], "model_type": "gpt_oss", **common, **SIZES[size],
             "rms_norm_eps": 1e-5, "attention_bias": True, "rope_theta": 150000.0, "swiglu_alpha": 1.702,
             "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9, "output_router_logits": False}
        c["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(c["num_hidden_layers"])]
        return c

    def quantize_tensor(self, name: str, tensor: torch.Tensor, fmt: str):
        if fmt == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return quantize_experts(name, tensor)
        return None

    def quant_config(self, fmt: str):
        if fmt == "mxfp4":  # openai/gpt-oss-20b's config.json
            return {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}, None
        return None

    # ---- the model

    def experts(self, cfg: dict[str, Any], weights, factory):
        """The plan's kernel backend when it computes the clamped SwiGLU with biases (its fp32
        epilogues: closer to the fp32 model than transformers' own bf16 math, tests/gpu); for the
        torch backend (or none) its own torch path (experts.Experts), which computes them in x's
        dtype exactly as transformers does."""
        return model.experts_backend(cfg, weights, factory)

    def build(self, cfg: dict[str, Any], w, experts, deferred: bool, group=None):
        return model.build(cfg, w, experts, deferred, group)


ARCH = GptOssArch()
