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


# ------------------------------------------------------------------------------------------------
# add_bos_token (issue 31): a completion's string prompt is encoded as transformers' tokenizer(prompt)
# (vLLM 0.11.0: add_special_tokens=True), chat templates that write the BOS do not get a second one.
# transformers 4.57.1 (vLLM 0.11.0's) rebuilds the post-processor of LlamaTokenizerFast-class
# tokenizers from add_bos_token / add_eos_token in __init__ (update_post_processor); the installed
# transformers (5.x) drops those keys at load, so the reference sets them afterwards, which runs the
# same update_post_processor.

BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PROMPTS = ["Hello world! How are you today?", "", " leading space and 3.14"]


@pytest.fixture
def hf_dir(tmp_path):
    """A tokenizer saved by transformers itself (save_pretrained; 5.x writes a BOS template into
    tokenizer.json's post-processor) with the BOS chat template."""
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "src"
    src.mkdir()
    build_tokenizer_files(src, 300, 128)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    t = transformers.PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"), bos_token=cfg["bos_token"],
                                             eos_token=cfg["eos_token"], add_bos_token=True, chat_template=BOS_TEMPLATE)
    out = tmp_path / "hf"
    t.save_pretrained(out)
    return out, transformers


def _strip_post_processor(d):
    """tokenizer.json without a BOS in its post-processor (byte-level offsets only)."""
    j = json.loads((d / "tokenizer.json").read_text())
    j["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    (d / "tokenizer.json").write_text(json.dumps(j))


@pytest.mark.parametrize("cls,flags,strip,bos_count", [
    ("LlamaTokenizerFast", {"add_bos_token": True}, True, 1),  # DeepSeek-V3's: the BOS from the config
    ("LlamaTokenizerFast", {"add_bos_token": True}, False, 1),  # and in the post-processor: still one
    ("LlamaTokenizerFast", {}, True, 1),  # the class's default (add_bos_token=True)
    ("LlamaTokenizerFast", {"add_bos_token": False}, False, 0),  # the config turns the json's BOS off
    ("LlamaTokenizerFast", {"add_bos_token": True, "add_eos_token": True}, True, 1),
    ("PreTrainedTokenizerFast", {"add_bos_token": True}, True, 0),  # other classes: tokenizer.json as it is
    ("PreTrainedTokenizerFast", {}, False, 1),
])
def test_string_prompts_are_encoded_as_transformers(hf_dir, cls, flags, strip, bos_count):
    d, transformers = hf_dir
    if strip:
        _strip_post_processor(d)
    _patch(d / "tokenizer_config.json", tokenizer_class=cls, **flags)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    if cls == "LlamaTokenizerFast":  # LlamaTokenizerFast.__init__ (4.57.1): set both, update_post_processor
        hf.add_bos_token, hf.add_eos_token = flags.get("add_bos_token", True), flags.get("add_eos_token", False)
    ours = Tokenizer(d)
    bos, eos = ours.token_id(ours.bos_token), ours.token_id(ours.eos_token)
    for p in PROMPTS:
        want = hf(p).input_ids
        assert want.count(bos) == bos_count and (want[-1:] == [eos]) == bool(flags.get("add_eos_token"))
        assert ours.encode(p, add_special_tokens=True) == want
        assert ours.encode(p) == hf(p, add_special_tokens=False).input_ids  # chat's encode: nothing added


def test_chat_template_with_bos_gets_one(hf_dir):
    d, transformers = hf_dir
    _strip_post_processor(d)
    _patch(d / "tokenizer_config.json", tokenizer_class="LlamaTokenizerFast", add_bos_token=True)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    hf.add_bos_token = True
    ours = Tokenizer(d)
    msgs = [{"role": "user", "content": "Hello world!"}]
    ids = ours.encode(ours.apply_chat_template(msgs), add_special_tokens=False)  # what /v1/chat/completions sends
    want = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert ids == list(want) and ids.count(ours.token_id(ours.bos_token)) == 1


def test_add_bos_token_must_be_a_boolean(tok_dir):
    root, _ = tok_dir
    _patch(root / "tokenizer_config.json", tokenizer_class="LlamaTokenizerFast", add_bos_token="yes")
    with pytest.raises(RuntimeFailure, match="tokenizer_config.json: add_bos_token = 'yes' is not true or false"):
        Tokenizer(root)


def test_add_bos_token_without_such_a_token_is_refused(tok_dir):
    root, _ = tok_dir
    _patch(root / "tokenizer_config.json", tokenizer_class="LlamaTokenizerFast", bos_token="<s>", add_bos_token=True)
    with pytest.raises(RuntimeFailure, match="add_bos_token is true but bos_token '<s>' is not a token"):
        Tokenizer(root)
