"""Tokenizer: build a small byte-level BPE locally (no network) and load/use HF tokenizer files.

`build_tokenizer_files` trains a byte-level BPE on a built-in English corpus with the `tokenizers`
library and writes `tokenizer.json`, `tokenizer_config.json` (with a chat template) and
`special_tokens_map.json`, the files a Hugging Face checkpoint ships. `Tokenizer` reads those files
back for serving: encode, decode (incremental, for streaming), and chat templating (jinja2, as HF does).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from .errors import RuntimeFailure

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [BOS, EOS, IM_START, IM_END]

# ChatML-style template (what Qwen checkpoints ship); rendered with jinja2 like HF's apply_chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts model routes every token to a few
experts chosen by a router, so only a small part of the weights is read for each token.
Kubernetes schedules pods onto nodes; an operator watches custom resources and reconciles them.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
Once upon a time there was a small model that wanted to serve requests quickly and correctly.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.71; code: def main(): return 0
The weights are stored in safetensors files, the configuration in config.json, and the tokenizer
in tokenizer.json. Quantized experts use four bits per weight with a scale for each block.
"""


def build_tokenizer(vocab_size: int) -> _HFTokenizer:
    tok = _HFTokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def build_tokenizer_files(out: Path, vocab_size: int, max_len: int) -> dict[str, int]:
    """Write the tokenizer files; returns the special token ids (for config.json)."""
    tok = build_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "add_bos_token": False, "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, indent=2))
    return {"bos": tok.token_to_id(BOS), "eos": tok.token_to_id(EOS), "im_end": tok.token_to_id(IM_END),
            "size": tok.get_vocab_size()}


class Tokenizer:
    """What the server needs from a checkpoint's tokenizer files."""

    def __init__(self, model_dir: str | Path):
        root = Path(model_dir)
        self._tok = _HFTokenizer.from_file(str(root / "tokenizer.json"))
        cfg = _json_object(root / "tokenizer_config.json")
        self.config = cfg  # tokenizer_config.json as read (/tokenizer_info)
        self.chat_template = _chat_template(root / "tokenizer_config.json", cfg.get("chat_template"))
        # transformers >= 4.52 saves the template as its own file (gpt-oss ships one); like
        # PreTrainedTokenizerBase.from_pretrained, the file wins over tokenizer_config.json's key
        if (root / "chat_template.jinja").is_file():
            self.chat_template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        self.eos_token = _token_text(root / "tokenizer_config.json", "eos_token", cfg.get("eos_token"))
        self.bos_token = _token_text(root / "tokenizer_config.json", "bos_token", cfg.get("bos_token"))
        add_bos_eos(self._tok, root / "tokenizer_config.json", cfg, self.bos_token, self.eos_token)
        # every special token the files name (transformers passes special_tokens_map to the template)
        self.special_tokens = {k: t for k in _SPECIAL_KEYS
                               if (t := _token_text(root / "tokenizer_config.json", k, cfg.get(k))) is not None}
        self.stop_ids = {i for i in (self.token_id(self.eos_token), self.token_id(IM_END)) if i is not None}
        # generation_config.json / config.json eos ids (an int or a list, e.g. Qwen's two)
        for name in ("generation_config.json", "config.json"):
            self.stop_ids.update(_token_ids(root / name, "eos_token_id", _json_object(root / name).get("eos_token_id"),
                                            self.vocab_size))
        try:  # compiled now, so a broken template fails the start (before Ready), not the first chat
            self._chat_template
        except Exception as e:  # noqa: BLE001 - jinja's TemplateSyntaxError and what an extension raises
            raise RuntimeFailure(f"{root}: the chat template does not compile: {type(e).__name__}: {e}") from None

    def to_str(self) -> str:
        """tokenizer.json as this tokenizer encodes (with the BOS/EOS that tokenizer_config.json adds):
        for another process that must encode the same way (tokenize_worker)."""
        return self._tok.to_str()

    def token_id(self, token: str | None) -> int | None:
        return self._tok.token_to_id(token) if token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Without the GIL (the batch API releases it), so the HTTP event loop keeps answering while
        another thread tokenizes a long prompt. `add_special_tokens`: tokenizer.json's post-processor
        (a BOS template, where the checkpoint has one) runs, as transformers' tokenizer(text) does."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters: a text of N characters is at least
        N / max_token_chars tokens (how the server refuses a huge prompt without tokenizing it)."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    def token_text(self, token_id: int) -> str:
        """One token as text (for logprobs), decoded on its own."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
        """As transformers' apply_chat_template (4.5x): the caller's template kwargs over the special
        tokens; continue_final_message cuts the text after the last message's content, so the model
        continues that message (the last message must be the assistant's prefix)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        kw = {"bos_token": "", "eos_token": "", **self.special_tokens, **(template_kwargs or {})}
        text = self._chat_template.render(**{**kw, "messages": messages, "add_generation_prompt": add_generation_prompt})
        if continue_final_message:
            final = (messages[-1].get("content") or "").strip() if messages else ""
            if not final or final not in text:
                raise ValueError("continue_final_message: the final message's content is not in the rendered "
                                 "template")
            text = text[:text.rindex(final) + len(final)]
        return text

    @functools.cached_property
    def _chat_template(self):
        """The chat template, compiled once (not on every request)."""
        import datetime

        import jinja2.ext
        import jinja2.sandbox

        # what transformers' chat_template_utils._compile_jinja_template gives templates (gpt-oss's
        # calls strftime_now for its "Current date" line)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols, _GenerationTag])

        def raise_exception(message):  # HF templates call this to reject a conversation
            raise ValueError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson  # jinja's own escapes HTML characters; transformers' does not
        return env.from_string(self.chat_template or CHAT_TEMPLATE)


# The fast tokenizer classes of transformers 4.57.1 (what vLLM 0.11.0 runs: transformers>=4.55.2) whose
# __init__ rebuilds tokenizer.json's post-processor from add_bos_token / add_eos_token (their
# update_post_processor: models/{llama,code_llama,gemma,cohere,gpt_neox}/tokenization_*_fast.py), with
# their defaults (bos, eos). DeepSeek-V3 ships LlamaTokenizerFast with add_bos_token: true. Every other
# class encodes with tokenizer.json's post-processor as it is (transformers 5.x does so for all: it
# drops the two keys when a tokenizer.json exists, tokenization_utils_base._from_pretrained).
POST_PROCESSOR_CLASSES = {"LlamaTokenizer": (True, False), "CodeLlamaTokenizer": (True, False),
                          "GemmaTokenizer": (True, False), "CohereTokenizer": (True, False),
                          "GPTNeoXTokenizer": (False, False)}


def add_bos_eos(tok: _HFTokenizer, path: Path, cfg: dict[str, Any], bos: str | None, eos: str | None) -> None:
    """What transformers' tokenizer(text) adds to a prompt (vLLM 0.11.0 encodes a completion's string
    prompt so, add_special_tokens=True): for a class of POST_PROCESSOR_CLASSES, the post-processor
    becomes `[bos] $A [eos]` per add_bos_token / add_eos_token, the string LlamaTokenizerFast
    .update_post_processor (4.57.1) builds; chat templates, which write their own BOS, are encoded
    without it (add_special_tokens=False), so they never get two."""
    cls = str(cfg.get("tokenizer_class") or "").removesuffix("Fast")
    if cls not in POST_PROCESSOR_CLASSES:
        return
    d_bos, d_eos = POST_PROCESSOR_CLASSES[cls]
    add_bos, add_eos = _flag(path, cfg, "add_bos_token", d_bos), _flag(path, cfg, "add_eos_token", d_eos)
    for want, token, key in ((add_bos, bos, "bos_token"), (add_eos, eos, "eos_token")):
        if want and (token is None or tok.token_to_id(token) is None):
            raise RuntimeFailure(f"{path}: add_{key} is true but {key} {token!r} is not a token of tokenizer.json")
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = ([(bos, tok.token_to_id(bos))] if add_bos else []) + ([(eos, tok.token_to_id(eos))] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _flag(path: Path, cfg: dict[str, Any], key: str, default: bool) -> bool:
    v = cfg.get(key, default)
    if v is None:
        return default
    return v if isinstance(v, bool) else _refuse(path, key, v, "true or false")


_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _generation_tag():
    import jinja2.ext
    from jinja2 import nodes

    class GenerationTag(jinja2.ext.Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (chat_template_utils.AssistantTracker,
        4.5x): marks the assistant's part for training masks; when serving it renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    return GenerationTag


_GenerationTag = _generation_tag()


class IncrementalDecoder:
    """Streams text for a growing token list without splitting multi-byte characters, decoding only
    a short window per token (O(1) per token, not the whole text every time).

    The offsets scheme of vLLM's `detokenize_incrementally` (vllm/transformers_utils/detokenizer_utils.py,
    v0.11.0): decode ids[prefix:] and ids[prefix:read] and send the difference; the prefix tokens
    give the decoder its context (SentencePiece's leading space, byte-level merges)."""

    # a window that never becomes valid text (invalid bytes, a run of skipped special tokens) is sent
    # as decoded once it is this long, so the per-token cost stays bounded
    MAX_WINDOW = 16

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.ids, self.skip = tok, [], skip_special_tokens
        self.prefix = self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok._tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        new = self._decode(self.ids[self.prefix:])
        held = len(self.ids) - self.prefix > self.MAX_WINDOW
        if new.endswith("\ufffd") and not held:  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        old = self._decode(self.ids[self.prefix:self.read])
        if len(new) <= len(old) and not held:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return new[len(old):]

    def flush(self) -> str:
        """At the end of the sequence: whatever was held back (an incomplete character, as U+FFFD)."""
        new = self._decode(self.ids[self.prefix:])
        old = self._decode(self.ids[self.prefix:self.read])
        self.prefix, self.read = self.read, len(self.ids)
        return new[len(old):]


# Typed reads of the tokenizer's side files: a wrong value is refused naming file, key and value
# (a silently ignored eos id is a server that never stops generating).

def _json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"),
                           parse_constant=lambda c: _refuse(path, "a number", c))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise RuntimeFailure(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise RuntimeFailure(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value


def _refuse(path: Path, key: str, value: Any, want: str = "") -> Any:
    raise RuntimeFailure(f"{path}: {key} = {str(value)[:80]!r} is not {want or 'allowed (NaN/Infinity)'}")


def _chat_template(path: Path, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        # named templates [{name, template}]: transformers uses "default"
        return next((t["template"] for t in value if t["name"] == "default"), None)
    return _refuse(path, "chat_template", value, "a string or a list of {name, template}")


def _token_text(path: Path, key: str, value: Any) -> str | None:
    """A special token: a string, or transformers' serialised AddedToken ({"content": ...})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return _refuse(path, key, value, "a token string or {\"content\": ...}")


def _token_ids(path: Path, key: str, value: Any, vocab: int) -> set[int]:
    if value is None:
        return set()
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
            _refuse(path, key, value, f"a token id (or list of ids) in [0, {vocab})")
    return set(ids)
