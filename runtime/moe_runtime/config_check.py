"""config.json, typed: every key the runtime reads has a type and a range, and the keys together
must describe a model the runtime can run. Pure functions of the parsed JSON, run on headers
alone (loader.validate_checkpoint), so a config that cannot work is refused before the port opens
instead of giving a server that reports Ready and then fails or answers garbage.

Python's json reads what transformers would write for a broken config (`NaN`, `Infinity`,
`1e999` as inf, `64.0` for an int, `"1e-6"` for a float), and the models would take any of them
as given: a NaN `rms_norm_eps` gives NaN logits, a float dimension a TypeError mid-request, top-k
above the expert count an index error in the router. So each value is checked here and a refusal
names the file, the key and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import models
from .errors import BadInput
from .model_spec import is_moe_layer, num_experts

MAX_INT = 2**31 - 1  # beyond int32 a dimension or count is an overflow or a typo, not a model
SUPPORTED_ROPE = ("default", "yarn")  # models.common.rope_parameters


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

# Every top-level key the runtime reads (models/, model_spec, parallel, serve), with its type.
KEYS: dict[str, Key] = {
    **dict.fromkeys(("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                     "intermediate_size", "moe_intermediate_size", "num_experts_per_tok", "head_dim",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "n_group",
                     "topk_group", "moe_layer_freq", "decoder_sparse_step", "max_position_embeddings",
                     "original_max_position_embeddings", "sliding_window"), POSITIVE),
    **dict.fromkeys(("n_routed_experts", "num_experts", "num_local_experts", "n_shared_experts", "first_k_dense_replace",
                     "num_nextn_predict_layers", "num_mtp_layers",
                     "q_lora_rank"), COUNT),  # q_lora_rank 0 (or null): no query compression, as the model reads it
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit"), POS_FLOAT),
    **dict.fromkeys(("tie_word_embeddings", "norm_topk_prob", "rope_interleave", "attention_bias"), BOOL),
    **dict.fromkeys(("scoring_func", "topk_method", "model_type"), STR),
    "mlp_only_layers": Key("ints"), "layer_types": Key("strs"),
}
# ... and inside rope_scaling / rope_parameters (config_keys.rope_dict, models.common.rope_parameters)
ROPE_KEYS: dict[str, Key] = {
    "rope_type": STR, "type": STR, "rope_theta": POS_FLOAT, "factor": POS_FLOAT,
    "original_max_position_embeddings": POSITIVE, "beta_fast": POS_FLOAT, "beta_slow": POS_FLOAT,
    "mscale": Key("float", 0), "mscale_all_dim": Key("float", 0), "attention_factor": POS_FLOAT, "truncate": BOOL,
}
# What each architecture cannot be built without is its Arch.required (models/<arch>/arch.py); the
# experts' keys only when the model has experts, intermediate_size only with a dense layer.
MOE_REQUIRED = ("moe_intermediate_size", "num_experts_per_tok")


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def type_problems(cfg: dict[str, Any]) -> list[str]:
    """`key = value: why` for each key (as written, under any spelling) whose value is not of its type."""
    out = [f"{k} = {_show(v)}: {why}" for k, v in cfg.items()
           if k in KEYS and v is not None and (why := KEYS[k].problem(v))]
    for name in ("rope_scaling", "rope_parameters"):
        rp = cfg.get(name)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            out.append(f"{name} = {_show(rp)}: must be an object")
            continue
        out += [f"{name}.{k} = {_show(v)}: {why}" for k, v in rp.items()
                if k in ROPE_KEYS and v is not None and (why := ROPE_KEYS[k].problem(v))]
    return out


def consistency_problems(cfg: dict[str, Any], module: str) -> list[str]:
    """What the keys of a typed, normalized config (config_keys.normalize) say together that cannot
    run: missing keys, top-k above the experts, groups that do not divide them, heads that do not
    share, odd rope dims, rope or routing variants the models do not implement (the architecture's
    own checks: its Arch.config_problems)."""
    arch = models.get(module)
    layers = cfg.get("num_hidden_layers") or 0
    moe = [i for i in range(layers) if is_moe_layer(cfg, i)]
    need = arch.required + (MOE_REQUIRED if moe else ()) + (("intermediate_size",) if len(moe) < layers else ())
    if (missing := [k for k in need if cfg.get(k) is None]):
        return [f"missing {', '.join(missing)} (required by {module})"]
    out: list[str] = []
    E, k = num_experts(cfg), cfg.get("num_experts_per_tok")
    experts_key = arch.experts_key
    if moe and k > E:
        out.append(f"num_experts_per_tok = {k}: more than the {E} routed experts ({experts_key})")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE:
        out.append(f"rope_scaling type {rope.get('rope_type')!r} is not supported by the bundled runtime "
                   f"(supported: {', '.join(SUPPORTED_ROPE)})")  # (models.common's words, as before)
    elif rope.get("rope_type") == "yarn" and rope.get("factor") is None:
        out.append("rope_scaling type 'yarn' without a factor")
    return out + arch.config_problems(cfg, moe)


def check_types(cfg: dict[str, Any], where: str | Path) -> None:
    """Before config_keys.normalize reads any value: every problem in one BadInput (exit 1)."""
    if (problems := type_problems(cfg)):
        raise BadInput(f"{where}: " + "; ".join(problems))


def check_consistency(cfg: dict[str, Any], module: str, where: str | Path) -> None:
    if (problems := consistency_problems(cfg, module)):
        raise BadInput(f"{where}: " + "; ".join(problems))
