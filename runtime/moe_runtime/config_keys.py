"""config.json under every spelling transformers has used: one canonical dict for the runtime.

transformers renames config keys and keeps the old ones readable through each config class's
`attribute_map` (read from transformers 5.24's configuration_*.py, not guessed):
- Qwen3MoeConfig:    attribute_map {num_experts: num_local_experts} (5.x writes num_local_experts)
- DeepseekV3Config:  attribute_map {num_local_experts: n_routed_experts, num_mtp_layers: num_nextn_predict_layers}
- GptOssConfig:      attribute_map {num_experts: num_local_experts}
and RoPE moved from `rope_theta` + `rope_scaling` to one `rope_parameters` dict
(modeling_rope_utils.RotaryEmbeddingConfigMixin.convert_rope_params_to_dict / standardize_rope_params):
`rope_scaling` wins over `rope_parameters` when both are set, `type` is read as `rope_type`,
`rope_theta` comes from the dict, else the top-level key, else the class's `default_theta` (10000;
gpt-oss 150000), and YaRN/llama3/longrope get `original_max_position_embeddings` from the top-level
key if present, else `max_position_embeddings`.

`normalize(cfg, module)` returns a copy where the runtime's canonical key (the left column) is set
whenever any spelling is, and `rope_parameters` is the standardized dict; the models and
model_spec read only canonical keys.
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import RuntimeFailure

# runtime model module -> {canonical key: other spellings}
ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "deepseek_v3": {"n_routed_experts": ("num_local_experts", "num_experts"),
                    "num_nextn_predict_layers": ("num_mtp_layers",)},
    "qwen3_moe": {"num_experts": ("num_local_experts",)},
    "gpt_oss": {"num_local_experts": ("num_experts",),
                # not a transformers rename: GptOssConfig's intermediate_size is its experts' width,
                # which the runtime's other families (and config checks) call moe_intermediate_size
                "moe_intermediate_size": ("intermediate_size",)},
}
DEFAULT_THETA = {"gpt_oss": 150000.0}
_SCALED = ("llama3", "yarn", "longrope")


def rope_dict(cfg: dict[str, Any], module: str) -> dict[str, Any]:
    rp = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise RuntimeFailure(f"config.json rope_parameters/rope_scaling must be an object, not {type(rp).__name__}")
    if any(isinstance(v, dict) for v in rp.values()):
        raise RuntimeFailure("config.json rope_parameters nested per layer type "
                             f"({', '.join(k for k, v in rp.items() if isinstance(v, dict))}) is not supported "
                             "by the bundled runtime")
    rp = dict(rp)
    rp["rope_type"] = rp.get("rope_type") or rp.get("type") or "default"
    rp.pop("type", None)
    theta = rp.get("rope_theta")
    if theta is None:
        theta = cfg.get("rope_theta")
    rp["rope_theta"] = float(theta if theta is not None else DEFAULT_THETA.get(module, 10000.0))
    if rp["rope_type"] in _SCALED:
        if cfg.get("original_max_position_embeddings") is not None:
            rp["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        elif cfg.get("max_position_embeddings") is not None:
            rp.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return rp


def normalize(cfg: dict[str, Any], module: str) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    for canon, alts in ALIASES.get(module, {}).items():
        if out.get(canon) is None:
            for a in alts:
                if out.get(a) is not None:
                    out[canon] = out[a]
                    break
    out["rope_parameters"] = rope_dict(out, module)
    out["rope_theta"] = out["rope_parameters"]["rope_theta"]
    out.pop("rope_scaling", None)
    return out
