"""The tokenizer's side files (tokenizer_config.json, generation_config.json, config.json) are read
typed: a value the server would silently ignore (an eos id it never stops on) is refused, naming
the file, the key and the value; the shapes transformers writes are accepted."""

from __future__ import annotations

import json

import pytest

from moe_runtime.errors import RuntimeFailure
from moe_runtime.tokenizer import Tokenizer, build_tokenizer_files


@pytest.fixture
def tok_dir(tmp_path):
    ids = build_tokenizer_files(tmp_path, 300, 128)
    return tmp_path, ids


def _patch(path, **kv):
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg.update(kv)
    path.write_text(json.dumps(cfg))


def test_transformers_shapes_are_accepted(tok_dir):
    root, ids = tok_dir
    eos = Tokenizer(root).eos_token
    # AddedToken as transformers serialises it, named templates, an eos id list
    _patch(root / "tokenizer_config.json", eos_token={"__type": "AddedToken", "content": eos, "lstrip": False},
           chat_template=[{"name": "default", "template": "{{ messages[0].content }}"},
                          {"name": "tool_use", "template": "x"}])
    _patch(root / "generation_config.json", eos_token_id=[ids["eos"], 7])
    t = Tokenizer(root)
    assert t.eos_token == eos and t.chat_template == "{{ messages[0].content }}"
    assert {ids["eos"], 7} <= t.stop_ids


@pytest.mark.parametrize("name,key,value,want", [
    ("tokenizer_config.json", "eos_token", 5, "a token string"),
    ("tokenizer_config.json", "eos_token", {"text": "x"}, "a token string"),
    ("tokenizer_config.json", "chat_template", {"default": "x"}, "a string or a list"),
    ("tokenizer_config.json", "chat_template", [{"name": "default"}], "a string or a list"),
    ("generation_config.json", "eos_token_id", "2", "a token id"),
    ("generation_config.json", "eos_token_id", True, "a token id"),
    ("generation_config.json", "eos_token_id", -1, "a token id"),
    ("generation_config.json", "eos_token_id", 10**6, "a token id"),
    ("generation_config.json", "eos_token_id", [2, 2.5], "a token id"),
    ("config.json", "eos_token_id", [None], "a token id"),
])
def test_wrong_values_are_refused_naming_file_key_value(tok_dir, name, key, value, want):
    root, _ = tok_dir
    _patch(root / name, **{key: value})
    with pytest.raises(RuntimeFailure) as e:
        Tokenizer(root)
    msg = str(e.value)
    assert name in msg and key in msg and want in msg and e.value.exit_code == 1


@pytest.mark.parametrize("text", ["{", "[1, 2]", '{"eos_token_id": NaN}', "\xff\xfe"])
def test_unreadable_side_files_are_refused_naming_the_file(tok_dir, text):
    root, _ = tok_dir
    (root / "generation_config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(RuntimeFailure) as e:
        Tokenizer(root)
    assert "generation_config.json" in str(e.value)
