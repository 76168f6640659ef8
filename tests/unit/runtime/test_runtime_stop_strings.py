"""Streaming text: the incremental decoder (bounded work per token) and stop strings that never leak
their start (issue 31 items 1-2). Pure parts, on the project's own byte-level BPE tokenizer."""

import pytest

from moe_runtime.stop_strings import StopScanner, partial_suffix
from moe_runtime.tokenizer import IncrementalDecoder, Tokenizer, build_tokenizer_files


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer_files(d, 512, 1024)
    return Tokenizer(d)


class CountingTokenizer:
    """Counts the token ids the decoder hands to the tokenizer (the cost of detokenization)."""

    def __init__(self, tok):
        self.inner, self.decoded, self.calls = tok._tok, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tok, ids, **kw):
    dec = IncrementalDecoder(tok, **kw)
    return [dec.push(i) for i in ids] + [dec.flush()]


TEXTS = ["Hello world! How are you today? The quick brown fox jumps over the lazy dog.",
         "Ünïcödé — 東京 🙂 mixture of experts ✓ 3.14", "  leading spaces\n\ttabs and\nnew lines  "]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_join_to_the_full_decode(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # a character split across tokens is sent whole


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hello") + [tok.token_id("<|im_end|>")] + tok.encode(" world")
    assert "".join(stream(tok, ids)) == "Hello world"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "Hello<|im_end|> world"


def test_an_8k_token_stream_decodes_in_linear_work(tok):
    """The old decoder re-decoded the whole list on every token: 8k tokens = 32M ids decoded.
    Now each token decodes a window of at most MAX_WINDOW ids (twice)."""
    ids = (tok.encode(" ".join(TEXTS)) * 400)[:8192]
    counting = CountingTokenizer(tok)
    dec = IncrementalDecoder(tok)
    dec.tok = type("T", (), {"_tok": counting})()
    out = "".join(dec.push(i) for i in ids) + dec.flush()
    assert out == tok.decode(ids)
    assert counting.calls <= 2 * len(ids) + 2
    assert counting.decoded <= 2 * IncrementalDecoder.MAX_WINDOW * len(ids)


def test_invalid_bytes_do_not_grow_the_window_forever(tok):
    lone = [i for i in range(tok.vocab_size) if tok.token_text(i) == "\ufffd"][:1]
    if not lone:
        pytest.skip("no token decodes to a lone partial byte")
    pieces = stream(tok, lone * 100)
    assert "".join(pieces).count("\ufffd") > 0 and max(len(p) for p in pieces) <= 2 * IncrementalDecoder.MAX_WINDOW


def scan(stops, pieces, include=False):
    s = StopScanner(stops, include)
    sent = []
    for p in pieces:
        sent.append(s.push(p))
        if s.matched:
            return sent, s.matched
    sent.append(s.flush())
    return sent, None


def test_the_start_of_a_multi_token_stop_string_is_never_sent():
    sent, hit = scan(["Wh mix"], ["Hello", " Wh", " mi", "x of", " experts"])
    assert hit == "Wh mix" and "".join(sent) == "Hello "
    assert sent[1] == " "  # " Wh" could start the stop string: "Wh" held back


def test_held_text_is_released_when_it_does_not_match():
    sent, hit = scan(["Wh mix"], ["Hello", " Wh", "y not", "?"])
    assert hit is None and sent == ["Hello", " ", "Why not", "?", ""]
    sent, hit = scan(["Wh mix"], ["end W"])  # held to the end of the sequence: sent by flush
    assert hit is None and "".join(sent) == "end W" and sent[-1] == "W"


def test_include_stop_str_in_output_and_earliest_match():
    sent, hit = scan(["Wh mix"], ["a Wh", " mix b"], include=True)
    assert "".join(sent) == "a Wh mix" and sent[0] == "a Wh"
    sent, hit = scan(["fox", "quick"], ["The quick brown fox"])
    assert hit == "quick" and "".join(sent) == "The "


def test_the_scan_only_looks_at_the_tail():
    s = StopScanner(["zzz"])
    for _ in range(10000):
        s.push("abc ")
    assert s.held == "" and len(s.push("zz")) == 0 and s.held == "zz"


@pytest.mark.parametrize("text,stops,n", [("abcWh", ["Wh mix"], 2), ("abc", ["x"], 0), ("aab", ["aabc", "b"], 3),
                                         ("xyz", ["yzq", "zq"], 2), ("", ["ab"], 0)])
def test_partial_suffix(text, stops, n):
    assert partial_suffix(text, stops) == n
