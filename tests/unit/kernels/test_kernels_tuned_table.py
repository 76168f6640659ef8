"""Tuned-config tables (moe_kernels.triton_config): lookup, fallback, round trip. CPU only: no Triton,
no GPU; the tables here are fakes written by the test, not tuned numbers."""

import json
from dataclasses import replace

import pytest

from moe_kernels.triton_config import (TABLE_ENV, TABLE_VERSION, FragConfig, GemmConfig, MoEConfig, PrefillConfig,
                                       TILE128,
                                       choose_config, config_from_dict, config_to_dict, default_config,
                                       device_file_name, load_table, nearest_bucket, shape_key, table_path,
                                       tuned_configs)

FRAG = MoEConfig(8, FragConfig(1, 2, 2, 1, 3), FragConfig(1, 4, 1, 1, 4, 2), gate_up_pdl=False)
TILE = MoEConfig(64, GemmConfig(128, 64, 8, 3, 8, swap=True), GemmConfig(64, 64, 4, 2))
MIXED = MoEConfig(16, FragConfig(2, 4, 1, 1, 3), FragConfig(2, 4, 1, 1, 3),
                  (FragConfig(1, 4, 1, 2, 3), FragConfig(1, 4, 1, 1, 4, 2)))
SPLIT = MoEConfig(128, TILE128, TILE128, tail=(FragConfig(2, 4, 1, 1, 3),) * 2, tail_rows=32)
PREFILL = MoEConfig(128, PrefillConfig(256, 32, 8, 4, swap=True), PrefillConfig(128, 64, 4, 3, progs_per_sm=2),
                    tail=(FragConfig(2, 4, 1, 1, 3),) * 2, tail_rows=32)


def _table(entries):
    return {"format_version": TABLE_VERSION, "device": "NVIDIA H200", "entries": entries}


@pytest.mark.parametrize("cfg", [FRAG, TILE, MIXED, SPLIT, PREFILL, default_config("nvfp4", 1, 256, False)])
def test_config_round_trip(cfg):
    d = config_to_dict(cfg)
    assert config_from_dict(json.loads(json.dumps(d))) == cfg


def test_config_from_dict_rejects_unknown_fields():
    d = config_to_dict(FRAG)
    with pytest.raises(ValueError):
        config_from_dict({**d, "warp_specialize": True})
    bad = dict(d, gemm1={**d["gemm1"], "kind": "wgmma"})
    with pytest.raises(ValueError):
        config_from_dict(bad)
    bad = dict(d, gemm1={**d["gemm1"], "stages": 3})
    with pytest.raises(ValueError):
        config_from_dict(bad)


def test_nearest_bucket_in_ratio():
    b = [1, 8, 64, 4096]
    assert nearest_bucket(b, 1) == 1 and nearest_bucket(b, 2) == 1 and nearest_bucket(b, 3) == 8
    assert nearest_bucket(b, 30) == 64 and nearest_bucket(b, 512) == 64 and nearest_bucket(b, 513) == 4096
    assert nearest_bucket(b, 100000) == 4096 and nearest_bucket([8], 1) == 8
    assert nearest_bucket([1, 4], 2) == 1   # a tie goes to the smaller bucket


def test_lookup_by_shape_format_and_top_k():
    key = shape_key("nvfp4", 256, 7168, 256, 8)
    table = _table({key: {"1": {"config": config_to_dict(FRAG), "us": 10.0}, "64": config_to_dict(TILE)}})
    got = tuned_configs(table, "nvfp4", 256, 7168, 256, 8)
    assert got == {1: FRAG, 64: TILE}
    assert tuned_configs(table, "mxfp4", 256, 7168, 256, 8) == {}
    assert tuned_configs(table, "nvfp4", 256, 7168, 256, 6) == {}
    assert tuned_configs(table, "nvfp4", 128, 7168, 256, 8) == {}
    assert tuned_configs(None, "nvfp4", 256, 7168, 256, 8) == {}
    # tokens = pairs / top_k, nearest bucket
    assert choose_config("nvfp4", 8, 256, True, top_k=8, tuned=got) == FRAG
    assert choose_config("nvfp4", 8 * 40, 256, True, top_k=8, tuned=got) == TILE
    assert choose_config("nvfp4", 8 * 128, 256, True, top_k=8, tuned=got) == TILE     # 2x the bucket: still it
    # further than TUNED_REACH from every bucket: the default's rules (a 64-token winner is no 4096 config)
    for t in (129, 4096):
        assert choose_config("nvfp4", 8 * t, 256, True, top_k=8, tuned=got) == default_config("nvfp4", 8 * t, 256, True)


def test_fallback_to_default_rules():
    for pairs in (1, 8, 512, 32768):
        for frag in (False, True):
            want = default_config("nvfp4", pairs, 256, frag)
            assert choose_config("nvfp4", pairs, 256, frag, top_k=8, tuned={}) == want
            assert choose_config("nvfp4", pairs, 256, frag, top_k=8, tuned=None) == want
            assert choose_config("nvfp4", pairs, 256, frag) == want
    # a fragment-kernel (or mixed, or tail-block) config needs the fragment copy: without it, the default
    for cfg in (FRAG, MIXED, SPLIT):
        assert choose_config("nvfp4", 8, 256, False, top_k=8, tuned={1: cfg}) == default_config("nvfp4", 8, 256, False)
        assert choose_config("nvfp4", 8, 256, True, top_k=8, tuned={1: cfg}) == cfg
    assert choose_config("nvfp4", 8, 256, False, top_k=8, tuned={1: TILE}) == TILE


def test_table_files(tmp_path):
    assert device_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert device_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert table_path("NVIDIA H200", env={}, table_dir=str(tmp_path)) == str(tmp_path / "NVIDIA_H200.json")
    assert table_path("NVIDIA H200", env={TABLE_ENV: str(tmp_path)}) == str(tmp_path / "NVIDIA_H200.json")
    f = tmp_path / "mine.json"
    assert table_path("NVIDIA H200", env={TABLE_ENV: str(f)}) == str(f)
    assert load_table(str(f)) is None   # no file: no table
    table = _table({shape_key("mxfp4", 8, 256, 128, 2): {"8": config_to_dict(TILE)}})
    f.write_text(json.dumps(table))
    assert tuned_configs(load_table(str(f)), "mxfp4", 8, 256, 128, 2) == {8: TILE}
    f.write_text(json.dumps({"format_version": 99, "entries": {}}))
    with pytest.raises(ValueError):
        load_table(str(f))


def test_committed_tables_are_measured_data():
    # tables are data written by the tune command on a GPU: each entry carries its measured time,
    # the default's time and its error against the torch reference, and loads through the lookup
    import os
    from moe_kernels import triton_config
    d = triton_config.TABLE_DIR
    for name in [n for n in os.listdir(d) if n.endswith(".json")] if os.path.isdir(d) else []:
        table = load_table(os.path.join(d, name))
        assert device_file_name(table["device"]) == name
        for key, entry in table["entries"].items():
            for tokens, cell in entry.items():
                assert int(tokens) >= 1 and cell["us"] > 0 and cell["default_us"] >= cell["us"] * 0.999
                assert cell["rel_err"] < 2e-2 and cell["checked"] >= 1
                config_from_dict(cell["config"])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "bf16", "fp8"])
@pytest.mark.parametrize("frag", [False, True])
def test_tune_candidates(fmt, frag):
    from moe_kernels.tune import candidate_configs
    for pairs in (8, 64, 2048, 8192, 32768):
        cands = candidate_configs(fmt, pairs, 256, frag)
        base = default_config(fmt, pairs, 256, frag)
        assert cands[0] == base and len(cands) == len(set(cands)) > 1
        rest = cands[1:]
        if base.frag and base.block_m == 16 and base.small is None and fmt in ("nvfp4", "mxfp4"):
            # 16-row fragment blocks: the prefill kernel at 32 / 64 / 128 rows per block comes next
            alt, rest = rest[:3], rest[3:]
            assert [c.block_m for c in alt] == [32, 64, 128]
            assert all(isinstance(c.gemm1, PrefillConfig) and (c.tail is not None) == frag for c in alt)
        for c in rest:   # one GEMM varied at a time, the rest of the default kept
            assert (c.gemm1 == base.gemm1) != (c.gemm2 == base.gemm2)
            assert (c.block_m, c.small, c.tail, c.tail_rows) == (base.block_m, base.small, base.tail, base.tail_rows)
            # same kernel, except the tile kernel's TILE128 among the prefill kernel's variants (its old path)
            for g, b in ((c.gemm1, base.gemm1), (c.gemm2, base.gemm2)):
                assert type(g) is type(b) or (isinstance(b, PrefillConfig) and g == TILE128)
        if isinstance(base.gemm1, PrefillConfig):
            assert replace(base, gemm1=TILE128) in cands and replace(base, gemm2=TILE128) in cands
        assert candidate_configs(fmt, pairs, 256, frag, 3) == cands[:3]


def test_tune_writes_and_merges_a_table(tmp_path):
    from moe_kernels.tune import write_table
    path = str(tmp_path / "sub" / "NVIDIA_H200.json")
    key = shape_key("nvfp4", 8, 256, 256, 2)
    win = {1: {"config": config_to_dict(FRAG), "us": 10.0}, 16: {"config": config_to_dict(TILE), "us": 20.0}}
    write_table(path, "NVIDIA H200", key, win, {"date": "x"})
    other = shape_key("mxfp4", 8, 256, 256, 2)
    write_table(path, "NVIDIA H200", other, {4: {"config": config_to_dict(TILE), "us": 1.0}}, {})
    write_table(path, "NVIDIA H200", key, {16: {"config": config_to_dict(MIXED), "us": 5.0}}, {})
    table = load_table(path)
    assert tuned_configs(table, "nvfp4", 8, 256, 256, 2) == {1: FRAG, 16: MIXED}
    assert tuned_configs(table, "mxfp4", 8, 256, 256, 2) == {4: TILE}
    with pytest.raises(ValueError):
        write_table(path, "NVIDIA H100", key, win, {})
