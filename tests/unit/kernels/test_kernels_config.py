"""Launch configs of the Triton experts (moe_kernels.triton_config), on the CPU."""

from dataclasses import replace

import pytest

from moe_kernels.triton_config import FRAG_MAX_ROWS, ONE_ROW_MAX_ROWS, GemmConfig, PrefillConfig, default_config


def test_one_row_loop_needs_a_pipelined_stage():
    # the hand-prefetched loop (pipe=0) is retired: asking for it is an error, not a silent fallback
    with pytest.raises(ValueError, match="pipe=0"):
        GemmConfig(32, 64, 4, 1, one_row=True, pipe=0)
    GemmConfig(128, 64, 8, 2, 8, pipe=0)   # tiles do not use it


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_defaults_take_the_measured_paths(fmt):
    # path switches on (the A/B winners in bench/README.md); the one-row loop only for FP4 decode
    # without the fragment copy
    for pairs in (1, 8, 64, 512, 2048, 8192, 32768):
        for frag in (False, True):
            cfg = default_config(fmt, pairs, 256, frag)
            assert cfg.pdl and cfg.fuse_finalize and cfg.coalesce and cfg.asm
            one_row = isinstance(cfg.gemm1, GemmConfig) and cfg.gemm1.one_row
            decode = pairs / min(256, pairs) <= ONE_ROW_MAX_ROWS
            assert one_row == (fmt in ("nvfp4", "mxfp4") and not frag and decode), (pairs, frag)
            if one_row:
                assert cfg.block_m == 1 and cfg.gemm2.one_row and cfg.gemm1.pipe >= 1


def test_switches_are_config_fields():
    # A/Bs turn a path off on a copy of the config; the config itself is immutable
    cfg = default_config("nvfp4", 8, 256, True)
    off = replace(cfg, coalesce=False, fuse_finalize=False, pdl=False)
    assert not (off.coalesce or off.fuse_finalize or off.pdl) and off.gemm1 == cfg.gemm1 and cfg.coalesce
    with pytest.raises(AttributeError):
        cfg.coalesce = False   # frozen dataclass


def test_one_token_on_small_intermediate_splits_k_over_more_programs():
    from moe_kernels.triton_config import DECODE_MIN_PROGRAMS
    for fmt in ("nvfp4", "mxfp4"):
        shard = default_config(fmt, 8, 256, True, inter=256)        # DeepSeek-V3 TP8: 32 programs at rt=4
        assert (shard.gemm1.rt, shard.gemm1.wk) == (1, 4) and not shard.gate_up_pdl
        layer = default_config(fmt, 8, 256, True, inter=2048)       # 8 * 2048 / 64 = 256 programs: kept
        assert layer == default_config(fmt, 8, 256, True) and layer.gemm1.rt == 4
        assert 8 * 2048 // 64 >= DECODE_MIN_PROGRAMS > 8 * 256 // 64
        # only one token: 8 tokens keep their configs
        assert default_config(fmt, 64, 256, True, inter=256) == default_config(fmt, 64, 256, True)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_prefill_runs_the_prefill_kernel(fmt):
    # past the fragment kernel's rows per expert (and past 96 without the fragment copy): the prefill
    # kernel for both GEMMs, with fragment tail blocks where the copy exists; bf16 / fp8 keep the tiles
    for frag in (False, True):
        cfg = default_config(fmt, 256 * 128, 256, frag)
        assert isinstance(cfg.gemm1, PrefillConfig) and isinstance(cfg.gemm2, PrefillConfig)
        assert (cfg.tail is not None) == frag and cfg.block_m == 128
    assert not isinstance(default_config(fmt, 256 * FRAG_MAX_ROWS, 256, True).gemm1, PrefillConfig)
    for dense in ("bf16", "fp8"):
        assert isinstance(default_config(dense, 256 * 128, 256, True).gemm1, GemmConfig)


def test_prefill_config_and_step_checks():
    from moe_kernels.triton_prefill import step_bytes
    for bad in (dict(bkh=48), dict(bkh=16), dict(block_n=96)):
        with pytest.raises(ValueError):
            PrefillConfig(**bad)
    assert step_bytes(3584, 128) == 128 and step_bytes(1440, 128) == 32 and step_bytes(1024, 64) == 64
    assert step_bytes(96, 64) == 32
    with pytest.raises(ValueError, match="multiple of 64"):
        step_bytes(40, 64)
