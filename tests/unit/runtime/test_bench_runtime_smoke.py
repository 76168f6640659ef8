"""bench/bench_runtime.py: the roofline math against a hand count, and a --tiny CPU run (engine and
`moe-runtime serve` over HTTP) whose tables have every column filled."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import bench_runtime as br  # noqa: E402
from runtime_roofline import attention_spec, expected_touched, model_bytes, prefill_flops, roofline_bytes  # noqa: E402

from moe_runtime.checkpoint_writer import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("q") / "ck", "qwen3_moe", "nvfp4", "tiny", overrides=br.TINY["qwen3_moe"])


def test_roofline_hand_count(qwen_tiny):
    # tiny Qwen3-MoE, one layer: hidden 64, vocab 512, 4 heads / 2 KV heads of 16, 8 experts top-2 of
    # intermediate 32, NVFP4 experts, bf16 rest
    mb = model_bytes(qwen_tiny)
    head = 512 * 64 * 2
    attn = (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64) * 2 + 2 * 16 * 2  # q, k, v, o; q_norm, k_norm
    dense = head + 64 * 2 + 2 * 64 * 2 + attn + 8 * 64 * 2  # + final norm, the layer's 2 norms, router
    # one NVFP4 projection [32, 64] or [64, 32]: 2048 values -> 1024 packed bytes, 128 e4m3 block
    # scales (one per 16), weight_scale_2 and input_scale (f32 scalars)
    proj = 1024 + 128 + 4 + 4
    assert (mb.dense_bytes, mb.embed_row_bytes, mb.expert_bytes, mb.moe_layers) == (dense, 128, 3 * proj, 1)
    assert mb.kv_bytes_per_token == (2 * 2 * 16 * 2,)
    r = roofline_bytes(mb, batch=2, ctx=10)
    touched = 8 * (1 - (1 - 2 / 8) ** 2)  # 3.5 experts
    assert r == {"dense": dense + 2 * 128, "experts": touched * 3 * proj, "kv": 2 * 10 * 128,
                 "total": dense + 2 * 128 + touched * 3 * proj + 2 * 10 * 128}
    matmul = (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64) + 8 * 64  # attention + router
    keys = 4 * 5 / 2  # causal, 4 tokens
    assert prefill_flops(mb, 4) == 2 * 4 * (matmul + 2 * 3 * 32 * 64) + 2 * 512 * 64 + keys * 2 * 4 * (16 + 16)


def test_expected_touched_and_window():
    assert expected_touched(8, 2, 1) == 2
    assert expected_touched(256, 8, 64) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 64))
    assert expected_touched(0, 0, 4) == 0
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "hidden_size": 64, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    kv, windows, pair = attention_spec(cfg)
    assert windows == (8, None) and kv == (128, 128) and pair == (2 * 4 * 32,) * 2
    mb = br.ModelBytes(0, 0, 0, 0, 0, 0, 0, 0, 0, kv, windows, pair)
    assert roofline_bytes(mb, 3, 20)["kv"] == 3 * (128 * 8 + 128 * 20)  # the window layer reads 8 tokens
    brute = sum(min(i + 1, 8) for i in range(20)) + sum(i + 1 for i in range(20))
    assert prefill_flops(mb, 20) == pytest.approx(pair[0] * brute)


@pytest.mark.parametrize("arch", sorted(br.TINY))
def test_kv_bytes_match_the_model(arch, tmp_path):
    """The config-derived KV bytes are what the runtime's own model allocates per token."""
    ck = make_checkpoint(tmp_path / arch, arch, br.REAL[arch][1], "tiny", overrides=br.TINY[arch])
    model, _, _ = br.load_model(br.serve_args(ck, "cpu"))
    assert sum(model_bytes(ck).kv_bytes_per_token) * 16 == model.kv_bytes_per_block(16)
    assert sum(model_bytes(ck, 1).kv_bytes_per_token) * 16 == model.kv_bytes_per_block(16, kv_cache_dtype="fp8")


def test_tiny_run_every_column(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert br.main(["--tiny", "--model", "gpt_oss", "--json", str(out), "--workdir", str(tmp_path / "w")]) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    for columns, n in ((br.DECODE_COLUMNS, 2), (br.PREFILL_COLUMNS, 2)):
        head = "| " + " | ".join(columns) + " |"
        lines = text.splitlines()
        i = lines.index(head)
        rows = lines[i + 2:i + 2 + n]
        for row in rows:
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert len(cells) == len(columns) and "-" not in cells, row  # every value measured
    (m,) = res["models"]
    assert [d["batch"] for d in m["decode"]] == [1, 2] and [p["prompt"] for p in m["prefill"]] == [16, 48]
    for d in m["decode"]:
        assert d["roofline_ms"] == pytest.approx(1e3 * d["bytes"]["total"] / res["copy_bw"])
        assert d["http_tok_s"] > 0 and d["engine_tok_s"] == pytest.approx(d["batch"] * 1e3 / d["step_ms"])


def test_extend_tokenizer_gives_every_id_text(tmp_path):
    from moe_runtime.tokenizer import Tokenizer

    ck = make_checkpoint(tmp_path / "ck", "qwen3_moe", "nvfp4", "tiny", overrides={**br.TINY["qwen3_moe"], "vocab_size": 1024})
    before = Tokenizer(ck)
    assert before.vocab_size == 512 and before.decode([1000]) == ""  # no text: such a token streams no chunk
    assert br.extend_tokenizer(ck, 1024) == 512 and br.extend_tokenizer(ck, 1024) == 0
    after = Tokenizer(ck)
    assert after.vocab_size == 1024 and after.decode([1000]).strip() == "t1000"
    assert after.decode([5, 6]) == before.decode([5, 6])  # the writer's ids unchanged


def test_the_time_budget_counts_from_the_run_not_the_import(tmp_path, monkeypatch):
    monkeypatch.setattr(br, "T0", br.T0 - 10_000)  # imported long ago (a whole test session before)
    out = tmp_path / "r.json"
    assert br.main(["--tiny", "--model", "qwen3_moe", "--no-http", "--json", str(out), "--workdir", str(tmp_path / "w")]) == 0
    assert not [n for n in json.loads(out.read_text())["notes"] if "time budget" in n]
