"""Fragment-order FP4 storage of the decode/small-batch GEMM (moe_kernels.triton_frag), on the CPU:
the packing is inverted through the kernel's own bit operations and compared bit-exactly with the
formats' decoders, and the kernel's lane/fragment schedule (activation addresses, m16n8k16 products,
accumulator multipliers) is replayed in torch against a plain matmul. The GPU kernel itself is
tested against the torch reference in tests/gpu."""

import pytest
import torch

from moe_kernels import formats as F
from moe_kernels.triton_frag import FragWeights, _asm, _constraints, emulate


def _nvfp4(e, n, k, gen, gs_shape=None):
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    # every e4m3 bit pattern but NaN, negative and zero scales and subnormals included
    codes = torch.randint(0, 256, (e, n, k // 16), dtype=torch.uint8, generator=gen)
    codes = torch.where((codes & 0x7F) == 0x7F, torch.full_like(codes, 0x38), codes)
    gs = torch.rand(gs_shape or (e,), generator=gen) * 1e-2 + 1e-4
    return F.NvFp4Tensor(packed, codes.view(torch.float8_e4m3fn), gs)


def _mxfp4(e, n, k, gen, lo=100, hi=140):
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(lo, hi, (e, n, k // 32), dtype=torch.uint8, generator=gen)
    return F.MxFp4Tensor(packed, scale)


@pytest.mark.parametrize("gs_shape", [None, (2, 2)])
def test_nvfp4_fragments_decode_bit_exact(gs_shape):
    gen = torch.Generator().manual_seed(1)
    t = _nvfp4(2, 32, 256, gen, gs_shape)
    fw = FragWeights.pack(t, "nvfp4")
    assert fw.w.shape == (2, 2, 2, 2, 32, 4) and fw.w.dtype == torch.int32
    ours = fw.dequantize()
    ref = F.dequantize_nvfp4(t, torch.float32)
    assert torch.equal(ours, ref)


def test_nvfp4_every_scale_pattern():
    # one row per e4m3 pattern (NaN excluded): scale decode, zero and negative handling all exact
    pats = [c for c in range(256) if (c & 0x7F) != 0x7F]
    n = 16 * ((len(pats) + 15) // 16)
    codes = torch.tensor(pats + [0x38] * (n - len(pats)), dtype=torch.uint8)
    scales = codes.view(1, n, 1).expand(1, n, 8).contiguous()
    gen = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (1, n, 64), dtype=torch.uint8, generator=gen)
    t = F.NvFp4Tensor(packed, scales.view(torch.float8_e4m3fn), torch.tensor([1.0]))
    assert torch.equal(FragWeights.pack(t, "nvfp4").dequantize(), F.dequantize_nvfp4(t, torch.float32))


def test_mxfp4_fragments_decode_bit_exact():
    gen = torch.Generator().manual_seed(3)
    t = _mxfp4(2, 48, 512, gen)
    fw = FragWeights.pack(t, "mxfp4")
    assert fw.w.shape == (2, 3, 2, 4, 32, 4)
    assert torch.equal(fw.dequantize(), F.dequantize_mxfp4(t, torch.float32))


def test_mxfp4_scales_far_below_the_largest_flush_to_zero():
    # bf16 products cannot hold weights more than ~2^133 below the expert's largest scale: those
    # blocks come out as zero (|ref| < 1e-36 there); every other block stays bit-exact
    gen = torch.Generator().manual_seed(4)
    t = _mxfp4(1, 16, 256, gen, 120, 124)
    t.scale[0, 0, 0] = 250          # expert offset c = 123
    t.scale[0, 1, 0] = 1            # 2^-126: below the bf16 product range
    t.scale[0, 2, 0] = 0            # B = 126 - 123 + 0 = 3 > 0, also underflows
    fw = FragWeights.pack(t, "mxfp4")
    ours, ref = fw.dequantize(), F.dequantize_mxfp4(t, torch.float32)
    tiny = torch.zeros_like(ref, dtype=torch.bool)
    tiny[0, 1:3, :32] = True
    assert torch.equal(ours[~tiny], ref[~tiny])
    assert ours[tiny].abs().max() <= ref[tiny].abs().max() < 1e-36


def test_nan_scales_are_refused():
    gen = torch.Generator().manual_seed(5)
    t = _nvfp4(1, 16, 128, gen)
    t.block_scale.view(torch.uint8)[0, 3, 1] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        FragWeights.pack(t, "nvfp4")
    m = _mxfp4(1, 16, 256, gen)
    m.scale[0, 0, 0] = 255
    with pytest.raises(ValueError, match="NaN"):
        FragWeights.pack(m, "mxfp4")


def test_shapes_the_fragment_kernel_cannot_take_are_refused():
    gen = torch.Generator().manual_seed(6)
    with pytest.raises(ValueError, match="K % 256"):
        FragWeights.pack(_mxfp4(1, 16, 384, gen), "mxfp4")
    with pytest.raises(ValueError, match="N % 16"):
        FragWeights.pack(_nvfp4(1, 24, 128, gen), "nvfp4")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_lane_schedule_matches_matmul(fmt):
    gen = torch.Generator().manual_seed(7)
    t = _nvfp4(2, 32, 256, gen, (2, 2)) if fmt == "nvfp4" else _mxfp4(2, 32, 512, gen)
    fw = FragWeights.pack(t, fmt)
    deq = (F.dequantize_nvfp4 if fmt == "nvfp4" else F.dequantize_mxfp4)(t, torch.float32)
    x = torch.randn(5, fw.k, generator=gen).bfloat16()
    for e in range(2):
        ours = emulate(fw, e, x)
        ref = x.float() @ deq[e].T
        assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_inline_ptx_operands_line_up():
    # every operand of the generated PTX is declared by its constraint string, every output and
    # weight/activation/accumulator register is used (only 1 of each lane's 4 scale copies is read)
    import re
    for nt in (1, 2):
        for rt in (1, 2, 4):
            asm = _asm(nt, rt, 1, 16, 0x75007500)
            used = {int(m) for m in re.findall(r"\$(\d+)", asm)}
            n = len(_constraints(nt, rt).split(","))
            scale_copies = {4 * rt * nt + 4 * rt + 4 * r + i for r in range(rt) for i in (1, 2, 3)}
            tied = set(range(n - 4 * rt * nt, n))   # accumulator inputs: the outputs' registers
            assert used == set(range(n)) - scale_copies - tied
            assert asm.count("mma.sync") == 4 * nt * rt


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_default_configs_are_ones_the_fragment_kernel_takes(fmt):
    # every default below FRAG_MAX_ROWS is a fragment config whose (rt, nt) has generated PTX, with
    # block_m matching its token tiles; above it the tiled kernel takes over
    from moe_kernels.triton_frag import frag_asm_args
    from moe_kernels.triton_config import FRAG_MAX_ROWS, FRAG_MIXED_ROWS, FRAG_NT1_ROWS, FragConfig, default_config
    for tokens in (1, 2, 8, 16, 64, 128, 200, 256, 384, 1024, 1280, 2048, 2600, 4096, 8192):
        cfg = default_config(fmt, tokens * 8, 256, frag=True)
        rows = tokens * 8 / min(256, tokens * 8)
        assert cfg.frag == (rows <= FRAG_MAX_ROWS)
        if cfg.frag:
            for g in (cfg.gemm1, cfg.gemm2):
                assert isinstance(g, FragConfig) and cfg.block_m == 8 * g.nt
                frag_asm_args(fmt, g.nt, g.rt)
            # mixed blocks (above FRAG_NT1_ROWS): 8-row configs for the experts that fit in one block
            assert (cfg.small is not None) == (FRAG_NT1_ROWS < rows <= FRAG_MIXED_ROWS)
            for g in cfg.small or ():
                assert isinstance(g, FragConfig) and g.nt == 1
                frag_asm_args(fmt, g.nt, g.rt)
        else:
            # tl.dot tiles with 16-row fragment tail blocks for remainders of up to a quarter tile
            assert cfg.block_m == 128 and cfg.tail is not None and cfg.tail_rows == cfg.block_m // 4
            for g in cfg.tail:
                assert isinstance(g, FragConfig) and g.nt == 2
                frag_asm_args(fmt, g.nt, g.rt)
        assert default_config(fmt, tokens * 8, 256, frag=False).tail is None   # no fragment copy, no tails
    assert not default_config(fmt, 8, 256, frag=False).frag


def _run_ptx_ints(lines, regs):
    """The integer PTX the decode uses (and / shf.r.wrap / mul.lo on .b32/.u32), on Python ints."""
    import re
    m32 = 0xFFFFFFFF
    val = lambda tok: int(tok, 16) if tok.startswith("0x") else (int(tok) if tok.isdigit() else regs[tok])  # noqa: E731
    for line in lines:
        op, args = line.rstrip(";").split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "shf.r.wrap.b32":
            assert a[1] == a[2], "the decode only rotates"
            r = val(a[3]) % 32
            x = val(a[1])
            regs[a[0]] = ((x >> r) | (x << (32 - r))) & m32
        elif op == "mul.lo.u32":
            regs[a[0]] = (val(a[1]) * val(a[2])) & m32
        else:
            assert re.match(r"fma\.rn\.bf16x2", op), op
            return regs[a[1]]   # the bf16x2 bits that get scaled
    raise AssertionError("no fma in the decode")


def test_word_decode_ptx_is_what_the_cpu_mirror_computes():
    # the PTX text the GPU runs and the torch/int mirror that the bit-exact tests go through are
    # generated from one table (fp4_ptx.WORD_OPS); check they agree on random words
    import random
    from moe_kernels import fp4_ptx
    rng = random.Random(5)
    for _ in range(2000):
        w = rng.getrandbits(32)
        for k in range(4):
            lines = fp4_ptx.word_pair("d", "w", k, "s")
            assert _run_ptx_ints(lines, {"w": w}) == fp4_ptx.word_pair_bits(w, k)


def test_word_layout_places_every_bit_once():
    from moe_kernels.triton_frag import WORD_POS
    assert sorted(WORD_POS.flatten().tolist()) == list(range(32))
