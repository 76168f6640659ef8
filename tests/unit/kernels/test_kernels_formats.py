"""Formats: bit-exact against ml_dtypes' independent decoders, RNE ties, quantizer invariants."""

import ml_dtypes
import numpy as np
import pytest
import torch

from moe_kernels import formats as F

F4 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu


def _rng(seed=0):
    return np.random.default_rng(seed)


def _e2m1_np(codes: np.ndarray) -> np.ndarray:
    """Independent E2M1 decode: ml_dtypes reads the low 4 bits of a byte as float4_e2m1fn."""
    return codes.astype(np.uint8).view(F4).astype(np.float32)


def _nibbles_np(packed: np.ndarray) -> np.ndarray:
    lo, hi = packed & 0x0F, packed >> 4
    return np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], -1)


def _random_e4m3_bytes(rng, shape, positive=False):
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b = np.where((b & 0x7F) == 0x7F, b ^ 0x01, b)  # 0x7F / 0xFF are NaN: not scales
    return b & 0x7F if positive else b


# ------------------------------------------------------------------------------------ E2M1
def test_e2m1_table_matches_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    ref = _e2m1_np(codes)
    ours = F.e2m1_to_float(torch.from_numpy(codes)).numpy()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))  # includes -0.0 (code 8)
    assert ours[8] == 0 and np.signbit(ours[8]) and ours[7] == 6.0 and ours[15] == -6.0


def test_pack_layout_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert F.pack_e2m1(codes).tolist() == [[0x21, 0x8F]]


def test_pack_unpack_roundtrip_random_bytes():
    packed = torch.from_numpy(_rng(1).integers(0, 256, size=(3, 5, 64), dtype=np.uint8))
    codes = F.unpack_e2m1(packed)
    assert codes.shape == (3, 5, 128)
    assert np.array_equal(codes.numpy(), _nibbles_np(packed.numpy()))
    assert torch.equal(F.pack_e2m1(codes), packed)


def test_float_to_e2m1_matches_ml_dtypes_rne_random_and_ties():
    rng = _rng(2)
    mags = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
    mids = (mags[1:] + mags[:-1]) / 2  # exact ties
    x = np.concatenate([rng.normal(0, 3, 20000).astype(np.float32), mids, -mids, mags, -mags,
                        np.nextafter(mids, 0), np.nextafter(mids, 10), [7.0, 1e9, -1e9, -0.0, -0.1]]
                       ).astype(np.float32)
    ours = F.float_to_e2m1(torch.from_numpy(x)).numpy()
    ref = x.astype(F4).view(np.uint8) & 0x0F
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("value,code", [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6),
                                        (5.0, 6), (-0.25, 8), (-5.0, 14), (6.5, 7), (-0.0, 8)])
def test_e2m1_ties_to_even(value, code):
    assert F.float_to_e2m1(torch.tensor([value])).item() == code


# ----------------------------------------------------------------------------------- NVFP4
def test_dequantize_nvfp4_bit_exact_random_patterns():
    rng = _rng(3)
    e, n, k = 2, 8, 64
    packed = rng.integers(0, 256, size=(e, n, k // 2), dtype=np.uint8)
    scales = _random_e4m3_bytes(rng, (e, n, k // 16), positive=True)
    scales[0, 0, 0] = 0x7E  # largest e4m3 (448)
    scales[0, 0, 1] = 0x01  # smallest subnormal
    gs = np.array([0.37, 1.0 / 2688.0], dtype=np.float32)
    t = F.NvFp4Tensor(torch.from_numpy(packed), torch.from_numpy(scales).view(torch.float8_e4m3fn),
                      torch.from_numpy(gs))
    ours = F.dequantize_nvfp4(t, dtype=torch.float32).numpy()
    vals = _e2m1_np(_nibbles_np(packed))
    sc = np.repeat(scales.view(E4M3).astype(np.float32), 16, axis=-1)
    ref = (vals * sc).astype(np.float32) * gs[:, None, None]
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    ours_bf16 = F.dequantize_nvfp4(t).float().numpy()
    assert np.array_equal(ours_bf16, ref.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_nvfp4_sharded_global_scale():
    rng = _rng(4)
    packed = torch.from_numpy(rng.integers(0, 256, size=(2, 8, 16), dtype=np.uint8))
    bs = torch.from_numpy(_random_e4m3_bytes(rng, (2, 8, 2), positive=True)).view(torch.float8_e4m3fn)
    gs2 = torch.tensor([[0.5, 2.0], [1.0, 4.0]])
    full = F.dequantize_nvfp4(F.NvFp4Tensor(packed, bs, torch.ones(2)), torch.float32)
    sharded = F.dequantize_nvfp4(F.NvFp4Tensor(packed, bs, gs2), torch.float32)
    assert torch.equal(sharded[:, :4], full[:, :4] * gs2[:, :1, None])
    assert torch.equal(sharded[:, 4:], full[:, 4:] * gs2[:, 1:, None])


def test_quantize_nvfp4_follows_modelopt():
    torch.manual_seed(0)
    w = torch.randn(3, 16, 64) * torch.logspace(-3, 1, 16)[:, None]
    q = F.quantize_nvfp4(w)
    assert q.packed.shape == (3, 16, 32) and q.block_scale.shape == (3, 16, 4) and q.global_scale.shape == (3,)
    amax = w.abs().amax(dim=(-2, -1))
    assert torch.equal(q.global_scale, amax / 2688.0)
    bamax = w.reshape(3, 16, 4, 16).abs().amax(-1)
    want_bs = (bamax / (6.0 * q.global_scale[:, None, None])).numpy().astype(E4M3)
    assert np.array_equal(q.block_scale.view(torch.uint8).numpy(), want_bs.view(np.uint8))
    # codes = RNE(w / (bs * gs)) decoded independently
    denom = np.repeat(want_bs.astype(np.float32), 16, -1) * q.global_scale.numpy()[:, None, None]
    want_codes = ((w.numpy() / denom).astype(np.float32).astype(F4).view(np.uint8)) & 0x0F
    assert np.array_equal(F.unpack_e2m1(q.packed).numpy(), want_codes)
    deq = F.dequantize_nvfp4(q, torch.float32)
    assert ((deq - w).norm() / w.norm()) < 0.12


def test_quantize_nvfp4_zero_tensor():
    q = F.quantize_nvfp4(torch.zeros(4, 32))
    assert torch.equal(F.dequantize_nvfp4(q, torch.float32), torch.zeros(4, 32))


# ----------------------------------------------------------------------------------- MXFP4
def test_dequantize_mxfp4_bit_exact_random_patterns():
    rng = _rng(5)
    packed = rng.integers(0, 256, size=(2, 4, 64), dtype=np.uint8)
    scale = rng.integers(0, 255, size=(2, 4, 4), dtype=np.uint8)  # 255 is NaN
    scale[0, 0, :3] = [0, 254, 127]  # smallest, largest, 1.0
    t = F.MxFp4Tensor(torch.from_numpy(packed), torch.from_numpy(scale))
    ours = F.dequantize_mxfp4(t, dtype=torch.float32).numpy()
    with np.errstate(over="ignore"):  # 6 * 2^127 overflows to inf on both sides
        ref = _e2m1_np(_nibbles_np(packed)) * np.repeat(scale.view(E8M0).astype(np.float32), 32, -1)
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_quantize_mxfp4_ocp_shared_exponent():
    torch.manual_seed(1)
    w = torch.randn(8, 128) * torch.logspace(-6, 3, 8)[:, None]
    q = F.quantize_mxfp4(w)
    assert q.packed.shape == (8, 64) and q.scale.shape == (8, 4)
    bamax = w.reshape(8, 4, 32).abs().amax(-1).numpy().astype(np.float64)
    want = np.floor(np.log2(bamax)).astype(np.int64) - 2 + 127
    assert np.array_equal(q.scale.numpy().astype(np.int64), want)
    sc = np.repeat(np.exp2(want - 127.0), 32, -1).astype(np.float32)
    want_codes = (w.numpy() / sc).astype(np.float32).astype(F4).view(np.uint8) & 0x0F
    assert np.array_equal(F.unpack_e2m1(q.packed).numpy(), want_codes)


# --------------------------------------------------------------------------------- FP8 block
def test_dequantize_fp8_block_bit_exact_random_patterns():
    rng = _rng(6)
    n, k = 200, 300  # not multiples of 128: partial blocks
    wbytes = _random_e4m3_bytes(rng, (n, k))
    wbytes[0, :4] = [0x7E, 0xFE, 0x80, 0x01]  # 448, -448, -0, smallest subnormal
    s = rng.uniform(1e-4, 1e-1, size=(2, 3)).astype(np.float32)
    t = F.Fp8BlockTensor(torch.from_numpy(wbytes).view(torch.float8_e4m3fn), torch.from_numpy(s))
    ours = F.dequantize_fp8_block(t, dtype=torch.float32).numpy()
    sfull = np.repeat(np.repeat(s, 128, 0), 128, 1)[:n, :k]
    ref = wbytes.view(E4M3).astype(np.float32) * sfull
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_quantize_fp8_block_deepseek_convention():
    torch.manual_seed(2)
    w = torch.randn(2, 130, 260)
    q = F.quantize_fp8_block(w)
    assert q.weight.dtype == torch.float8_e4m3fn and q.scale_inv.shape == (2, 2, 3)
    amax = w[0, :128, :128].abs().max()
    assert torch.equal(q.scale_inv[0, 0, 0], amax / 448.0)
    assert q.weight.float().abs().max() <= 448
    deq = F.dequantize_fp8_block(q, torch.float32)
    assert ((deq - w).norm() / w.norm()) < 0.05
