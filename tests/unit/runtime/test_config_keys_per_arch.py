"""config.json key types are declared where they are read (issue 33): the shared keys in
models/common/config.py, each architecture's own in its Arch.config_keys (models/<arch>/arch.py);
config_check asks them, and its KEYS is their union."""

import math

import pytest

from moe_runtime import config_check, models
from moe_runtime.models.common.config import COMMON_KEYS, Key


def test_each_architecture_declares_its_own_keys_and_keys_is_the_union():
    union = dict(COMMON_KEYS)
    for m in models.names():
        own = models.get(m).config_keys
        assert own and all(isinstance(k, Key) for k in own.values()), m
        assert not set(own) & set(COMMON_KEYS), f"{m} re-declares a shared key"
        union.update(own)
    assert dict(config_check.KEYS) == union
    assert "kv_lora_rank" not in models.get("qwen3_moe").config_keys  # one architecture's key is not another's


def test_an_architectures_own_key_is_type_checked():
    got = config_check.type_problems({"swiglu_limit": math.nan, "q_lora_rank": -1, "hidden_size": 64})
    assert got == ["swiglu_limit = nan: must be a finite number > 0", "q_lora_rank = -1: must be an integer in 0..2147483647"]


def test_two_architectures_typing_one_key_differently_are_refused(monkeypatch):
    arch = models.get("qwen3_moe")
    monkeypatch.setattr(arch, "config_keys", {"norm_topk_prob": Key("str")})
    config_check.all_keys.cache_clear()
    try:
        with pytest.raises(AssertionError, match="norm_topk_prob"):
            config_check.all_keys()
    finally:
        monkeypatch.undo()
        config_check.all_keys.cache_clear()
    assert config_check.KEYS["norm_topk_prob"] == Key("bool")


def test_keys_is_read_only():
    with pytest.raises(TypeError):
        config_check.KEYS["hidden_size"] = Key("str")
