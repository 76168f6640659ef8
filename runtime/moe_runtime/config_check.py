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

from functools import lru_cache
from types import MappingProxyType
from pathlib import Path
from typing import Any

from . import models
from .errors import BadInput
from .model_spec import is_moe_layer, num_experts
from .models.common.config import COMMON_KEYS, ROPE_KEYS, Key

SUPPORTED_ROPE = ("default", "yarn")  # models.common.rope_parameters


@lru_cache(maxsize=None)
def all_keys() -> MappingProxyType[str, Key]:
    """Every top-level key the runtime reads, with its type: the shared ones (models.common.config) and
    each architecture's own (its Arch.config_keys). The types are checked before the architecture is
    known (a config that names none is refused after its values), so every architecture's keys count;
    two that type one key differently are refused here, not left to whichever comes first."""
    out = dict(COMMON_KEYS)
    for module in models.names():
        for k, key in models.get(module).config_keys.items():
            if out.setdefault(k, key) != key:
                raise AssertionError(f"config key {k!r}: {module} types it {key}, another {out[k]}")
    return MappingProxyType(out)


def __getattr__(name: str):
    if name == "KEYS":  # the whole table, asked of the architectures at first use (they load lazily)
        return all_keys()
    raise AttributeError(name)


# What each architecture cannot be built without is its Arch.required (models/<arch>/arch.py); the
# experts' keys only when the model has experts, intermediate_size only with a dense layer.
MOE_REQUIRED = ("moe_intermediate_size", "num_experts_per_tok")


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def type_problems(cfg: dict[str, Any]) -> list[str]:
    """`key = value: why` for each key (as written, under any spelling) whose value is not of its type."""
    keys = all_keys()
    out = [f"{k} = {_show(v)}: {why}" for k, v in cfg.items()
           if k in keys and v is not None and (why := keys[k].problem(v))]
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
