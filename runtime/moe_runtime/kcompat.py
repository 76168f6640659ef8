"""The runtime's single door into `moe_kernels`.

Everything the runtime needs from the kernels package is imported here, so that the rest of the
runtime names one module. Where a kernels function is not (yet) available, a minimal local version
with the same contract is used instead (formats-and-kernels.md section 4 conventions), and
`MISSING` lists what was substituted so the log and the report can say so.
"""

from __future__ import annotations

import math

import torch

MISSING: list[str] = []

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_MAX = 448.0


# ------------------------------------------------------------------------------------------------
# Local format implementations (used only where moe_kernels.formats is missing)

def _e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit code (uint8), round to nearest even, saturating at 6."""
    a = x.abs().float()
    # Thresholds between grid points; ties go to the even code (">=" rounds the tie up).
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0)).to(torch.uint8)
    sign = (torch.signbit(x) & (code > 0)).to(torch.uint8) << 3
    return code | sign


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


class _Local:
    class NvFp4Tensor:
        def __init__(self, packed, block_scale, global_scale):
            self.packed, self.block_scale, self.global_scale = packed, block_scale, global_scale

    class MxFp4Tensor:
        def __init__(self, packed, scale):
            self.packed, self.scale = packed, scale

    class Fp8BlockTensor:
        def __init__(self, weight, scale_inv):
            self.weight, self.scale_inv = weight, scale_inv

    @staticmethod
    def quantize_nvfp4(w: torch.Tensor, global_scale=None):
        w = w.float()
        *lead, n, k = w.shape
        blocks = w.reshape(*lead, n, k // 16, 16)
        if global_scale is None:  # per leading index (per expert), as ModelOpt does per linear
            global_scale = w.abs().amax(dim=(-1, -2)).clamp_min(1e-12) / (6.0 * FP8_MAX)
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device)
        gs_b = gs.reshape(*gs.shape, 1, 1)
        bs = (blocks.abs().amax(-1) / 6.0 / gs_b).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
        denom = (bs.float() * gs_b).unsqueeze(-1)
        q = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, 1.0), torch.zeros_like(blocks))
        packed = _pack(_e2m1_encode(q.reshape(*lead, n, k)))
        return _Local.NvFp4Tensor(packed, bs, gs)

    @staticmethod
    def dequantize_nvfp4(t, dtype=torch.float32):
        vals = _e2m1_decode(_unpack(t.packed))
        *lead, n, k = vals.shape
        gs = torch.as_tensor(t.global_scale, dtype=torch.float32, device=vals.device)
        scale = t.block_scale.float() * gs.reshape(*gs.shape, 1, 1)
        return (vals.reshape(*lead, n, k // 16, 16) * scale.unsqueeze(-1)).reshape(*lead, n, k).to(dtype)

    @staticmethod
    def quantize_mxfp4(w: torch.Tensor):
        w = w.float()
        *lead, n, k = w.shape
        blocks = w.reshape(*lead, n, k // 32, 32)
        amax = blocks.abs().amax(-1)
        # OCP MX: shared exponent = floor(log2(amax)) - emax(E2M1)=2
        e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-38))) - 2, torch.full_like(amax, -127))
        e = e.clamp(-127, 127)
        q = blocks / torch.exp2(e).unsqueeze(-1)
        packed = _pack(_e2m1_encode(q.reshape(*lead, n, k)))
        return _Local.MxFp4Tensor(packed, (e + 127).to(torch.uint8))

    @staticmethod
    def dequantize_mxfp4(t, dtype=torch.float32):
        vals = _e2m1_decode(_unpack(t.packed))
        *lead, n, k = vals.shape
        scale = torch.exp2(t.scale.float() - 127)
        return (vals.reshape(*lead, n, k // 32, 32) * scale.unsqueeze(-1)).reshape(*lead, n, k).to(dtype)

    @staticmethod
    def quantize_fp8_block(w: torch.Tensor, block=128):
        w = w.float()
        *lead, n, k = w.shape
        nb, kb = math.ceil(n / block), math.ceil(k / block)
        pad = torch.zeros(*lead, nb * block, kb * block, device=w.device)
        pad[..., :n, :k] = w
        blocks = pad.reshape(*lead, nb, block, kb, block)
        scale_inv = (blocks.abs().amax(dim=(-1, -3)) / FP8_MAX).clamp_min(1e-12)
        q = (blocks / scale_inv[..., :, None, :, None]).reshape(*lead, nb * block, kb * block)
        return _Local.Fp8BlockTensor(q[..., :n, :k].to(torch.float8_e4m3fn), scale_inv)

    @staticmethod
    def dequantize_fp8_block(t, dtype=torch.float32, block=128):
        w = t.weight.float()
        *lead, n, k = w.shape
        s = t.scale_inv.float().repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :n, :k]
        return (w * s).to(dtype)


try:  # the kernels engineer's implementation, when it exists
    from moe_kernels import formats as _formats  # type: ignore
    quantize_nvfp4 = _formats.quantize_nvfp4
    dequantize_nvfp4 = _formats.dequantize_nvfp4
    quantize_mxfp4 = _formats.quantize_mxfp4
    dequantize_mxfp4 = _formats.dequantize_mxfp4
    quantize_fp8_block = _formats.quantize_fp8_block
    dequantize_fp8_block = _formats.dequantize_fp8_block
    NvFp4Tensor = _formats.NvFp4Tensor
    MxFp4Tensor = _formats.MxFp4Tensor
    Fp8BlockTensor = _formats.Fp8BlockTensor
except Exception:  # ImportError or an incomplete module while it is being written
    MISSING.append("moe_kernels.formats")
    quantize_nvfp4 = _Local.quantize_nvfp4
    dequantize_nvfp4 = _Local.dequantize_nvfp4
    quantize_mxfp4 = _Local.quantize_mxfp4
    dequantize_mxfp4 = _Local.dequantize_mxfp4
    quantize_fp8_block = _Local.quantize_fp8_block
    dequantize_fp8_block = _Local.dequantize_fp8_block
    NvFp4Tensor = _Local.NvFp4Tensor
    MxFp4Tensor = _Local.MxFp4Tensor
    Fp8BlockTensor = _Local.Fp8BlockTensor
