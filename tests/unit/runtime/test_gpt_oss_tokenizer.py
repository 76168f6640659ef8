"""A checkpoint's chat formatting as transformers reads it (issue 18 item 4: gpt-oss's tokenizer and
chat template come from the checkpoint).

gpt-oss ships its template as `chat_template.jinja` beside `tokenizer_config.json` (what
transformers >= 4.52 saves), and the template calls `strftime_now` for its date line. The runtime's
Tokenizer takes the file over the config key, as transformers does, and renders with the helpers
transformers gives templates (strftime_now, loop controls, its non-escaping tojson): the rendered
prompt equals transformers' apply_chat_template on the same directory. The template below is a small
harmony-style one written for this test, not the release's.
"""

import json

import pytest

from moe_runtime.tokenizer import Tokenizer, build_tokenizer_files

transformers = pytest.importorskip("transformers")

TEMPLATE = """{%- set ns = namespace(system=none) -%}
<|start|>system<|message|>Knowledge cutoff: 2024-06
Current date: {{ strftime_now("%Y-%m-%d") }}
{%- for m in messages %}{% if m.role == "system" %}{% set ns.system = m.content %}{% break %}{% endif %}{% endfor %}
{%- if ns.system %}

{{ ns.system }}{% endif %}<|end|>
{%- for m in messages if m.role != "system" %}
<|start|>{{ m.role }}{% if m.tool_calls is defined %} to={{ m.tool_calls[0].name }}<|message|>{{ m.tool_calls[0].arguments | tojson }}{% else %}<|message|>{{ m.content }}{% endif %}<|end|>
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 < 3 & \u00e9?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "calc", "arguments": {"expr": "2<3", "x": "\u00e9"}}]}]


@pytest.fixture
def ckpt(tmp_path):
    build_tokenizer_files(tmp_path, 256, 1024)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return tmp_path


def test_chat_template_file_wins_and_renders_as_transformers_does(ckpt):
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert cfg.get("chat_template")  # the config has one too: the file must win, as in transformers
    tok = Tokenizer(ckpt)
    assert tok.chat_template == TEMPLATE
    ours = tok.apply_chat_template(MESSAGES)
    theirs = transformers.AutoTokenizer.from_pretrained(str(ckpt)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '{"expr": "2<3", "x": "\u00e9"}' in ours and "Current date: 20" in ours


def test_named_templates_in_the_config_use_default(tmp_path):
    build_tokenizer_files(tmp_path, 256, 1024)
    p = tmp_path / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]
    p.write_text(json.dumps(cfg))
    assert Tokenizer(tmp_path).apply_chat_template(MESSAGES) == "D3"
