"""FP8 W8A8 experts (issue 29 item 3) on the CPU: the activation quantization that defines them
(reference.act_fp8_roundtrip), argument checks and configs. The kernel itself runs in
test_kernels_triton_interpreter.py (interpreter) and tests/gpu."""

import json

import pytest
import torch

from moe_kernels.experts import ExpertWeights
from moe_kernels.reference import TorchExperts, act_fp8_roundtrip
from moe_kernels.triton_config import MoEConfig, W8A8Config, config_from_dict, config_to_dict, default_w8a8_config


def test_roundtrip_is_per_row_and_group_on_the_e4m3_grid():
    torch.manual_seed(0)
    a = torch.randn(5, 256) * torch.tensor([1.0, 1e-3, 30.0, 1.0, 0.0])[:, None]
    a[3, 128:] *= 100.0   # one group much larger: scales are per 128 columns
    out = act_fp8_roundtrip(a)
    g = a.reshape(5, 2, 128)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = out.reshape(5, 2, 128) / s    # (q * s / s: exact up to fp32 rounding)
    assert torch.allclose(q.to(torch.float8_e4m3fn).float(), q, rtol=1e-5, atol=0)      # on the grid
    want_max = torch.where(g.abs().amax(-1) > 0, 448.0, 0.0)
    assert torch.allclose(q.abs().amax(-1), want_max, rtol=1e-5, atol=0)                  # the max -> 448
    rel = ((out - a).abs() / (g.abs().amax(-1, keepdim=True).expand(-1, -1, 128).reshape(5, 256) + 1e-30))
    assert rel.max() <= 2.0 ** -4 + 1e-6    # half an e4m3 quantum of the group's largest value at most
    assert torch.equal(out[4], torch.zeros(256))
    with pytest.raises(ValueError, match="multiple of 128"):
        act_fp8_roundtrip(torch.randn(2, 200))


def test_reference_w8a8_differs_from_w8a16_by_the_quantization_only():
    torch.manual_seed(1)
    e, h, i = 4, 256, 128
    ew = ExpertWeights.from_dense(torch.randn(e, 2 * i, h) / 16, torch.randn(e, h, i) / 11, "fp8")
    x = torch.randn(6, h).bfloat16()
    w = torch.full((6, 2), 0.5)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    exact = TorchExperts(ew).forward(x, w, ids).float()
    w8a8 = TorchExperts(ew, act_quant="fp8").forward(x, w, ids).float()
    err = float((w8a8 - exact).norm() / exact.norm())
    assert 5e-3 < err < 8e-2
    with pytest.raises(ValueError, match="activation quantization"):
        TorchExperts(ew, act_quant="int8")


def test_triton_w8a8_argument_checks():
    from moe_kernels.triton_moe import TritonExperts
    e, h, i = 2, 256, 128
    fp4 = ExpertWeights.from_dense(torch.randn(e, 2 * i, h), torch.randn(e, h, i), "nvfp4")
    with pytest.raises(ValueError, match="needs fp8 block weights"):
        TritonExperts(fp4, act_quant="fp8")
    with pytest.raises(ValueError, match="activation quantization"):
        TritonExperts(fp4, act_quant="fp4")
    odd = ExpertWeights.from_dense(torch.randn(e, 2 * 64, h), torch.randn(e, h, 64), "fp8")
    with pytest.raises(ValueError, match="multiples of 128"):
        TritonExperts(odd, act_quant="fp8")


def test_w8a8_configs():
    for pairs, bm in ((8, 16), (256 * 16, 16), (256 * 40, 32), (256 * 90, 64), (256 * 128, 128)):
        cfg = default_w8a8_config(pairs, 256)
        assert cfg.block_m == bm and isinstance(cfg.gemm1, W8A8Config) and cfg.tail is None
        assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
    assert MoEConfig(64, W8A8Config(), W8A8Config()).gemm1.block_n == 128
