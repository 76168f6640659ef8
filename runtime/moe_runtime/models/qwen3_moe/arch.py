"""Qwen3MoeForCausalLM: its checkpoint tensors, config keys and checks, and the configs
`make-checkpoint` writes. MoE layers, shard rules, expert stacking and the experts backend are the
shared ones (models.common.arch)."""

from __future__ import annotations

from typing import Any

from ..common.arch import ArchBase, gqa_problems, num_experts
from ..common.config import BOOL
from ..common.spec import model_ends, per_expert_shapes
from . import model

SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024),
    "small": dict(vocab_size=16384, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096),
}


class Qwen3MoeArch(ArchBase):
    name = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    aliases = {"num_experts": ("num_local_experts",)}  # Qwen3MoeConfig's attribute_map (5.x writes num_local_experts)
    required = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
    experts_key = "num_experts"
    config_keys = {"norm_topk_prob": BOOL}  # its own config.json keys (the shared ones: models.common.config)

    def dense_shapes(self, cfg: dict[str, Any]):
        H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
        layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            t: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
            a = p + "self_attn."
            hd = cfg.get("head_dim") or H // nh
            nkv = cfg["num_key_value_heads"]
            t[a + "q_proj.weight"] = (nh * hd, H)
            t[a + "k_proj.weight"] = (nkv * hd, H)
            t[a + "v_proj.weight"] = (nkv * hd, H)
            t[a + "o_proj.weight"] = (H, nh * hd)
            t[a + "q_norm.weight"] = (hd,)
            t[a + "k_norm.weight"] = (hd,)
            m = p + "mlp."
            if self.is_moe_layer(cfg, i):
                E, inter = num_experts(cfg), cfg["moe_intermediate_size"]
                t[m + "gate.weight"] = (E, H)
                t.update(per_expert_shapes(m, E, inter, H))
            else:
                inter = cfg["intermediate_size"]
                t[m + "gate_proj.weight"] = (inter, H)
                t[m + "up_proj.weight"] = (inter, H)
                t[m + "down_proj.weight"] = (H, inter)
            layers.append((i, t))
        return model_ends(cfg, layers)

    def config_problems(self, cfg: dict[str, Any], moe_layers: list[int]) -> list[str]:
        return gqa_problems(cfg)

    def writer_config(self, size: str, common: dict[str, Any]) -> dict[str, Any]:
        return {"architectures": [self.hf_class], "model_type": "qwen3_moe", **common, **SIZES[size],
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "rope_theta": 1000000.0,
                "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
                "output_router_logits": False, "router_aux_loss_coef": 0.001}

    def build(self, cfg: dict[str, Any], w, experts, deferred: bool, group=None):
        return model.build(cfg, w, experts, deferred, group)


ARCH = Qwen3MoeArch()
