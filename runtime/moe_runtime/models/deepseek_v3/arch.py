"""DeepseekV3ForCausalLM (also Kimi-K2, which declares it): its checkpoint tensors, config keys and
checks, and the configs `make-checkpoint` writes. Shard rules, expert stacking and experts backend
are the shared ones (models.common.arch)."""

from __future__ import annotations

from typing import Any

from ..common.arch import ArchBase, num_experts
from ..common.config import BOOL, COUNT, POS_FLOAT, POSITIVE, STR
from ..common.spec import model_ends, per_expert_shapes
from . import model

SIZES = {
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


class DeepseekV3Arch(ArchBase):
    name = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    # DeepseekV3Config's attribute_map (transformers 5.24): {num_local_experts: n_routed_experts,
    # num_mtp_layers: num_nextn_predict_layers}
    aliases = {"n_routed_experts": ("num_local_experts", "num_experts"),
               "num_nextn_predict_layers": ("num_mtp_layers",)}
    required = ("hidden_size", "vocab_size", "num_attention_heads", "num_hidden_layers", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    experts_key = "n_routed_experts"
    # its own config.json keys (the shared ones: models.common.config.COMMON_KEYS)
    config_keys = {
        **dict.fromkeys(("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "n_group", "topk_group",
                         "moe_layer_freq"), POSITIVE),
        **dict.fromkeys(("n_shared_experts", "first_k_dense_replace", "num_mtp_layers",
                         "q_lora_rank"), COUNT),  # q_lora_rank 0 (or null): no query compression, as the model reads it
        "routed_scaling_factor": POS_FLOAT, "rope_interleave": BOOL, "norm_topk_prob": BOOL,
        "scoring_func": STR, "topk_method": STR,
    }

    def is_moe_layer(self, cfg: dict[str, Any], i: int) -> bool:
        return num_experts(cfg) > 0 and i >= int(cfg.get("first_k_dense_replace") or 0) and \
            i % int(cfg.get("moe_layer_freq") or 1) == 0

    def dense_shapes(self, cfg: dict[str, Any]):
        H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
        layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            t: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
            a = p + "self_attn."
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
            m = p + "mlp."
            if self.is_moe_layer(cfg, i):
                E, inter = num_experts(cfg), cfg["moe_intermediate_size"]
                t[m + "gate.weight"] = (E, H)
                t[m + "gate.e_score_correction_bias"] = (E,)
                si = inter * int(cfg.get("n_shared_experts") or 0)
                if si:
                    t[m + "shared_experts.gate_proj.weight"] = (si, H)
                    t[m + "shared_experts.up_proj.weight"] = (si, H)
                    t[m + "shared_experts.down_proj.weight"] = (H, si)
                t.update(per_expert_shapes(m, E, inter, H))
            else:
                inter = cfg["intermediate_size"]
                t[m + "gate_proj.weight"] = (inter, H)
                t[m + "up_proj.weight"] = (inter, H)
                t[m + "down_proj.weight"] = (H, inter)
            layers.append((i, t))
        return model_ends(cfg, layers)

    def config_problems(self, cfg: dict[str, Any], moe_layers: list[int]) -> list[str]:
        out = []
        E, k = num_experts(cfg), cfg.get("num_experts_per_tok")
        if cfg.get("qk_rope_head_dim") % 2:
            out.append(f"qk_rope_head_dim = {cfg['qk_rope_head_dim']}: must be even (rope rotates pairs)")
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if cfg.get(key, want) != want:
                out.append(f"{key} = {cfg[key]!r}: the bundled runtime routes DeepSeek-V3 with {want} only")
        g, tg = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
        if moe_layers and E % g:
            out.append(f"n_group = {g}: does not divide the {E} routed experts")
        elif moe_layers:
            if tg > g:
                out.append(f"topk_group = {tg}: more than n_group = {g}")
            elif E // g < 2:
                out.append(f"n_group = {g}: {E} experts give groups of {E // g}; a group's score is its top-2 experts")
            elif E >= k > tg * (E // g):
                out.append(f"num_experts_per_tok = {k}: more than the {tg * (E // g)} experts of the topk_group = {tg} "
                           f"groups kept")
        return out

    def writer_config(self, size: str, common: dict[str, Any]) -> dict[str, Any]:
        return {"architectures": [self.hf_class], "model_type": "deepseek_v3", **common, **SIZES[size],
                "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                "norm_topk_prob": True, "rope_theta": 10000.0, "rope_scaling": None, "rope_interleave": True,
                "num_nextn_predict_layers": 0}

    def build(self, cfg: dict[str, Any], w, experts, deferred: bool, group=None):
        return model.build(cfg, w, experts, deferred, group)


ARCH = DeepseekV3Arch()
