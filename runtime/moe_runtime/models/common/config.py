"""config.json key types: `Key` (a type and a range) and the keys every architecture's generic code
reads (the decoder stack, attention heads, experts under any spelling, norms, rope). An architecture's
own keys are its `Arch.config_keys` (models/<arch>/arch.py); config_check asks them all.

Below config_check and every models/<arch>/, so an architecture declares its keys without importing
the checker."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_INT = 2**31 - 1  # beyond int32 a dimension or count is an overflow or a typo, not a model


@dataclass(frozen=True)
class Key:
    kind: str  # "int" | "float" | "bool" | "str" | "ints" (a list of layer indices) | "strs"
    low: float = 1  # smallest accepted value ("int", "float")
    open_low: bool = False  # "float": strictly above `low`

    def problem(self, v: Any) -> str | None:
        """Why `v` (a non-null JSON value) is not of this key's type, or None."""
        if self.kind == "bool":
            return None if isinstance(v, bool) else "must be true or false"
        if self.kind == "str":
            return None if isinstance(v, str) else "must be a string"
        if self.kind == "strs":
            return None if isinstance(v, list) and all(isinstance(i, str) for i in v) else "must be a list of strings"
        if self.kind == "ints":
            ok = isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_INT for i in v)
            return None if ok else "must be a list of layer indices (integers >= 0)"
        if self.kind == "int":
            if not isinstance(v, int) or isinstance(v, bool):
                return f"must be an integer in {int(self.low)}..{MAX_INT}"
            return None if self.low <= v <= MAX_INT else f"must be an integer in {int(self.low)}..{MAX_INT}"
        # float: a JSON int is a float too (rope_theta: 10000), a bool or a string is not
        bound = f"> {self.low:g}" if self.open_low else f">= {self.low:g}"
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return f"must be a finite number {bound}"
        return None if (v > self.low if self.open_low else v >= self.low) else f"must be a finite number {bound}"


POSITIVE, COUNT = Key("int"), Key("int", 0)
POS_FLOAT, BOOL, STR = Key("float", 0, True), Key("bool"), Key("str")

# The keys the shared code reads (models/common, model_spec, dist, loader, serve, the writer), with their types.
COMMON_KEYS: dict[str, Key] = {
    **dict.fromkeys(("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                     "intermediate_size", "moe_intermediate_size", "num_experts_per_tok", "head_dim",
                     "decoder_sparse_step", "max_position_embeddings", "original_max_position_embeddings"), POSITIVE),
    # the routed-expert count under each spelling (common.arch.num_experts); the MTP layers the loader skips
    **dict.fromkeys(("n_routed_experts", "num_experts", "num_local_experts", "num_nextn_predict_layers"), COUNT),
    **dict.fromkeys(("rms_norm_eps", "rope_theta"), POS_FLOAT),
    "tie_word_embeddings": BOOL, "model_type": STR, "mlp_only_layers": Key("ints"),
}
# ... and inside rope_scaling / rope_parameters (config_keys.rope_dict, models.common.rope_parameters)
ROPE_KEYS: dict[str, Key] = {
    "rope_type": STR, "type": STR, "rope_theta": POS_FLOAT, "factor": POS_FLOAT,
    "original_max_position_embeddings": POSITIVE, "beta_fast": POS_FLOAT, "beta_slow": POS_FLOAT,
    "mscale": Key("float", 0), "mscale_all_dim": Key("float", 0), "attention_factor": POS_FLOAT, "truncate": BOOL,
}
