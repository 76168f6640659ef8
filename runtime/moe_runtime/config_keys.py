"""config.json under every spelling transformers has used: one canonical dict for the runtime.

transformers renames config keys and keeps the old ones readable through each config class's
`attribute_map` (read from transformers 5.24's configuration_*.py, not guessed); each
architecture's map is its `Arch.aliases` (models/<arch>/arch.py). RoPE moved from `rope_theta` +
`rope_scaling` to one `rope_parameters` dict
(modeling_rope_utils.RotaryEmbeddingConfigMixin.convert_rope_params_to_dict / standardize_rope_params):
`rope_scaling` wins over `rope_parameters` when both are set, `type` is read as `rope_type`,
`rope_theta` comes from the dict, else the top-level key, else the class's `default_theta` (10000,
or the architecture's `Arch.default_theta`), and YaRN/llama3/longrope get
`original_max_position_embeddings` from the top-level key if present, else `max_position_embeddings`.

`normalize(cfg, module)` returns a copy where the runtime's canonical key is set whenever any
spelling is, and `rope_parameters` is the standardized dict; the models and model_spec read only
canonical keys.
"""

from __future__ import annotations

import copy
from typing import Any

from . import models
from .errors import RuntimeFailure

DEFAULT_THETA = 10000.0  # transformers' default_theta, unless the architecture's class has its own
_SCALED = ("llama3", "yarn", "longrope")


def rope_dict(cfg: dict[str, Any], module: str) -> dict[str, Any]:
    """The standardized rope dict; `module` "" (an already normalized config): the default theta."""
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
    if theta is None:
        theta = models.get(module).default_theta if module else DEFAULT_THETA
    rp["rope_theta"] = float(theta)
    if rp["rope_type"] in _SCALED:
        if cfg.get("original_max_position_embeddings") is not None:
            rp["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        elif cfg.get("max_position_embeddings") is not None:
            rp.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return rp


def normalize(cfg: dict[str, Any], module: str) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    for canon, alts in models.get(module).aliases.items():
        if out.get(canon) is None:
            for a in alts:
                if out.get(a) is not None:
                    out[canon] = out[a]
                    break
    out["rope_parameters"] = rope_dict(out, module)
    out["rope_theta"] = out["rope_parameters"]["rope_theta"]
    out.pop("rope_scaling", None)
    return out
