"""Chat templates as transformers renders them (issue 31 item 6): the `{% generation %}` tag,
every special token given to the template, and a broken template refused when the tokenizer is
loaded (before Ready), not at the first chat request."""

import json

import pytest
from transformers import PreTrainedTokenizerFast

from moe_runtime.errors import RuntimeFailure
from moe_runtime.tokenizer import Tokenizer, build_tokenizer_files

GEN = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}"
       "{% endgeneration %}{% else %}{{ pad_token + unk_token + m['content'] }}{% endif %}{% endfor %}"
       "{% if add_generation_prompt %}{{ bos_token }}{% endif %}")


def files(tmp_path, template):
    build_tokenizer_files(tmp_path, 512, 64)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.update(chat_template=template, unk_token="<|im_start|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_generation_tag_and_special_tokens_render_as_in_transformers(tmp_path):
    d = files(tmp_path, GEN)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
    ours = Tokenizer(d).apply_chat_template(msgs)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(d)).apply_chat_template(msgs, tokenize=False,
                                                                                add_generation_prompt=True)
    assert ours == theirs
    assert "<|end_of_text|><|im_start|>hi" in ours  # pad_token and unk_token reached the template


def test_a_broken_template_fails_at_load(tmp_path):
    d = files(tmp_path, "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(RuntimeFailure, match="chat template does not compile"):
        Tokenizer(d)


def test_continue_final_message_and_template_kwargs(tmp_path):
    d = files(tmp_path, "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}{% if flag %}!{% endif %}")
    tok = Tokenizer(d)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The quick"}]
    assert tok.apply_chat_template(msgs, False, True) == "<user>hi</s><assistant>The quick"
    assert tok.apply_chat_template(msgs[:1], template_kwargs={"flag": True}).endswith("<assistant>!")
    with pytest.raises(ValueError, match="cannot both"):
        tok.apply_chat_template(msgs, True, True)
