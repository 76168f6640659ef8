"""Weight formats: E2M1 packing, NVFP4 (ModelOpt), MXFP4 (OCP), FP8 block-scale (DeepSeek).

Every function accepts leading batch dims, so a stack of experts [E, N, K] is quantized at once;
blocks always run along the last (input, K) dim.

Conventions (formats-and-kernels.md section 4):
- E2M1 code: bit 3 sign, bits 2-1 exponent, bit 0 mantissa; byte i of a packed row holds element
  2i in its low nibble and 2i+1 in its high nibble.
- NVFP4: 16-element blocks, float8_e4m3fn block scale, fp32 global scale = amax / (6 * 448);
  value = e2m1 * block_scale * global_scale.
- MXFP4: 32-element blocks, E8M0 scale stored as uint8; value = e2m1 * 2^(scale - 127).
- FP8 block: float8_e4m3fn weight, fp32 `scale_inv` per 128x128 block; value = w * scale_inv.
All roundings are round-to-nearest-even.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
FP8_BLOCK = 128

# Midpoints between consecutive E2M1 magnitudes. At an exact tie round-to-nearest-even picks the
# code with mantissa bit 0, i.e. the even code: ties at 0.75, 1.75, 3.5 go up (to codes 2, 4, 6),
# ties at 0.25, 1.25, 2.5, 5.0 go down (codes 0, 2, 4, 6 are below them).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


# ---------------------------------------------------------------------------------------- E2M1
def e2m1_lut(device=None, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] (values 0..15) -> uint8 [..., n]; even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> uint8 codes [..., 2n]."""
    p = packed.to(torch.uint8)
    return torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)


def e2m1_to_float(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return e2m1_lut(codes.device, dtype)[codes.long()]


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (RNE, saturating at +-6; -0 and negative underflow keep the sign)."""
    x = x.float()
    a = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in zip(_MIDPOINTS, _TIE_UP):
        mag += ((a > mid) | ((a == mid) if tie_up else False)).to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return mag | sign


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block size {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


# --------------------------------------------------------------------------------------- NVFP4
@dataclass
class NvFp4Tensor:
    """packed uint8 [..., N, K/2]; block_scale float8_e4m3fn [..., N, K/16]; global_scale fp32 [...]
    (a scalar tensor for a plain matrix). global_scale may carry one extra trailing dim S > 1: the N
    rows then split into S equal shards with their own global scale (ModelOpt gate/up shards)."""

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def to(self, device) -> "NvFp4Tensor":
        return NvFp4Tensor(self.packed.to(device), self.block_scale.to(device), self.global_scale.to(device))

    def __getitem__(self, idx) -> "NvFp4Tensor":  # index leading (expert) dims
        return NvFp4Tensor(self.packed[idx], self.block_scale[idx], self.global_scale[idx])


def quantize_nvfp4(w: torch.Tensor) -> NvFp4Tensor:
    """ModelOpt NVFP4: global_scale = amax/(6*448) over the matrix; block_scale = e4m3(block_amax /
    (6*global_scale)); codes = e2m1(w / (block_scale * global_scale))."""
    w = w.float()
    lead = w.shape[:-2]
    amax = w.abs().amax(dim=(-2, -1))
    global_scale = amax / (E2M1_MAX * E4M3_MAX)
    gs_safe = torch.where(global_scale > 0, global_scale, torch.ones_like(global_scale))
    gs_b = gs_safe.reshape(*lead, 1, 1, 1)
    wb = _blocks(w, NVFP4_BLOCK)
    bamax = wb.abs().amax(dim=-1, keepdim=True)
    bs = (bamax / (E2M1_MAX * gs_b)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    bs_f = bs.float()
    denom = bs_f * gs_b
    scaled = torch.where(denom > 0, wb / torch.where(denom > 0, denom, torch.ones_like(denom)),
                         torch.zeros_like(wb))
    codes = float_to_e2m1(scaled).reshape(w.shape)
    return NvFp4Tensor(pack_e2m1(codes), bs.squeeze(-1), global_scale)


def _expand_global_scale(gs: torch.Tensor, lead: tuple[int, ...], n: int) -> torch.Tensor:
    """fp32 [..., N, 1] multiplier from a global scale of shape lead or lead + (S,)."""
    gs = gs.float()
    if gs.dim() == len(lead):
        return gs.reshape(*lead, 1, 1)
    shards = gs.shape[-1]
    if n % shards:
        raise ValueError(f"{n} rows do not split into {shards} global-scale shards")
    return gs.repeat_interleave(n // shards, dim=-1).reshape(*lead, n, 1)


def dequantize_nvfp4(t: NvFp4Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """(e2m1 * block_scale) * global_scale in fp32 (the first product is exact), rounded once to dtype."""
    codes = unpack_e2m1(t.packed)
    n, k = codes.shape[-2], codes.shape[-1]
    lead = codes.shape[:-2]
    v = _blocks(e2m1_to_float(codes), NVFP4_BLOCK) * t.block_scale.float().unsqueeze(-1)
    v = v.reshape(codes.shape) * _expand_global_scale(t.global_scale, lead, n)
    return v.to(dtype)


# --------------------------------------------------------------------------------------- MXFP4
@dataclass
class MxFp4Tensor:
    """packed uint8 [..., N, K/2]; scale uint8 E8M0 [..., N, K/32]."""

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def to(self, device) -> "MxFp4Tensor":
        return MxFp4Tensor(self.packed.to(device), self.scale.to(device))

    def __getitem__(self, idx) -> "MxFp4Tensor":
        return MxFp4Tensor(self.packed[idx], self.scale[idx])


def quantize_mxfp4(w: torch.Tensor) -> MxFp4Tensor:
    """OCP MX v1.0 section 6.3: shared exponent = floor(log2(block amax)) - 2 (emax of E2M1), stored
    biased by 127; elements = e2m1(w / 2^exp), saturating at 6. All-zero blocks get exponent -127."""
    wb = _blocks(w.float(), MXFP4_BLOCK)
    bamax = wb.abs().amax(dim=-1, keepdim=True)
    # frexp gives amax = m * 2^e with m in [0.5, 1): floor(log2(amax)) = e - 1, exact for all floats.
    _, e = torch.frexp(bamax)
    exp = torch.where(bamax > 0, (e - 1) - 2, torch.full_like(e, -127)).clamp(-127, 127)
    scaled = wb * torch.exp2(-exp.float())
    codes = float_to_e2m1(scaled).reshape(w.shape)
    return MxFp4Tensor(pack_e2m1(codes), (exp + 127).to(torch.uint8).squeeze(-1))


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 -> fp32 2^(s-127) (255 is NaN in the spec; returned as 2^128 = inf)."""
    return torch.exp2(scale.to(torch.int32).float() - 127.0)


def dequantize_mxfp4(t: MxFp4Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    codes = unpack_e2m1(t.packed)
    v = _blocks(e2m1_to_float(codes), MXFP4_BLOCK) * e8m0_to_float(t.scale).unsqueeze(-1)
    return v.reshape(codes.shape).to(dtype)


# ------------------------------------------------------------------------------------ FP8 block
@dataclass
class Fp8BlockTensor:
    """weight float8_e4m3fn [..., N, K]; scale_inv fp32 [..., ceil(N/128), ceil(K/128)]."""

    weight: torch.Tensor
    scale_inv: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def to(self, device) -> "Fp8BlockTensor":
        return Fp8BlockTensor(self.weight.to(device), self.scale_inv.to(device))

    def __getitem__(self, idx) -> "Fp8BlockTensor":
        return Fp8BlockTensor(self.weight[idx], self.scale_inv[idx])


def _pad_to_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    n, k = w.shape[-2:]
    pn, pk = (-n) % block, (-k) % block
    return torch.nn.functional.pad(w, (0, pk, 0, pn)) if (pn or pk) else w


def _expand_block_scale(s: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    return s.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :n, :k]


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> Fp8BlockTensor:
    """DeepSeek-V3 style: scale_inv = block amax / 448 (zero-padded blocks), weight = e4m3(w / scale_inv)."""
    w = w.float()
    n, k = w.shape[-2:]
    wp = _pad_to_blocks(w, block)
    nb, kb = wp.shape[-2] // block, wp.shape[-1] // block
    blocks = wp.reshape(*w.shape[:-2], nb, block, kb, block)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / _expand_block_scale(scale_inv, n, k, block)).clamp(-E4M3_MAX, E4M3_MAX)
    return Fp8BlockTensor(q.to(torch.float8_e4m3fn), scale_inv)


def dequantize_fp8_block(t: Fp8BlockTensor, dtype=torch.bfloat16, block: int = FP8_BLOCK) -> torch.Tensor:
    n, k = t.weight.shape[-2:]
    v = t.weight.float() * _expand_block_scale(t.scale_inv.float(), n, k, block)
    return v.to(dtype)
