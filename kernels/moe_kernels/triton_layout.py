"""Weight storage of the tile kernel (triton_tile.py), re-laid out once when the experts are built.

FP4:
- "split-half" packing: byte j of a row holds element j (low nibble) and element K/2 + j (high
  nibble), so one byte tile gives two contiguous K ranges; no nibble interleaving in registers.
- K-tiled: [E, K/2/32, N, 32] bytes, so a block of rows x one 64-weight K step is one contiguous
  read (row-major rows gave 32-byte pieces 3.5 KB apart, which streamed at under 1 TB/s). Scales:
  [E, K/2/32, N, 4], per row and K tile the scales of its low and its high half in one 4-byte entry
  (cp.async needs >= 4 bytes).
bf16 / fp8 stay row-major (fp8: fp32 scales per 128 x 128 block).
(The fragment kernel keeps its own copy: triton_frag.FragWeights.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import formats as F

# format ids as the kernels see them (constexpr FMT)
FMT_BF16, FMT_FP8, FMT_NVFP4, FMT_MXFP4 = 0, 1, 2, 3
FMT_ID = {"bf16": FMT_BF16, "fp8": FMT_FP8, "nvfp4": FMT_NVFP4, "mxfp4": FMT_MXFP4}
# elements per scale along K
GROUP = {FMT_BF16: 1, FMT_FP8: 128, FMT_NVFP4: F.NVFP4_BLOCK, FMT_MXFP4: F.MXFP4_BLOCK}

# FP4 K tile: 32 packed bytes (64 weights) per row, all rows of one K tile contiguous.
FP4_KT = 32

# In-register FP4 weights come out as weight * 2^-c (triton_decode.fp4_group_scale): NVFP4 uses c = 9
# so that e4m3 scales up to 448 times 2^(126-9) stay finite in bf16; the 2^9 goes into the global scale.
_NVFP4_C = 9


@dataclass
class Operand:
    w: torch.Tensor       # storage: bf16 / e4m3 [E, N, K], or FP4 K-tiled uint8 [E, K/2/KT, N, KT]
    s: torch.Tensor       # block scales (fp32 [E, N/128, K/128] fp8; FP4 K-tiled uint8 [E, ., N, 4])
    p: torch.Tensor       # fp32 [E, 4]: gate / up accumulator multipliers, FP4 scale multiplier, unused
    row_w: int = 0        # element stride between rows (within a K tile for FP4)
    tile_w: int = 0       # FP4: stride between K tiles
    row_s: int = 0
    tile_s: int = 0


def prepare(t, fmt: str) -> Operand:
    """One expert weight matrix ([E, N, K] in ExpertWeights' format) in the tile kernel's storage."""
    if fmt in ("bf16", "fp8"):
        w = t.contiguous() if fmt == "bf16" else t.weight.view(torch.uint8).contiguous()
        s = w if fmt == "bf16" else t.scale_inv.float().contiguous()
        return Operand(w, s, torch.ones(1, 4, dtype=torch.float32, device=w.device), w.stride(1), 0, s.stride(1), 0)
    w = _split_half_repack(t.packed.contiguous())
    e, n, half = w.shape
    if half % FP4_KT:
        raise ValueError(f"FP4 kernels need K to be a multiple of {2 * FP4_KT}, got {2 * half}")
    p = torch.zeros(e, 4, dtype=torch.float32, device=w.device)
    if fmt == "nvfp4":
        s = t.block_scale.view(torch.uint8).contiguous()
        gs = t.global_scale.float().reshape(e, -1)
        if gs.shape[1] not in (1, 2):
            raise ValueError(f"NVFP4 global scale must be [E] or [E, 2], got {tuple(t.global_scale.shape)}")
        p[:, :2] = gs.expand(-1, 2) * 2.0 ** _NVFP4_C
        p[:, 2] = 2.0 ** (126 - _NVFP4_C)
    else:
        s = t.scale.contiguous()
        # per-expert offset c keeps 2^(s-127) * 2^(126-c) finite for the largest scale of the expert
        c = (s.reshape(e, -1).amax(dim=1).to(torch.int32) - 127).clamp(min=0).float()
        p[:, 0] = p[:, 1] = torch.exp2(c)
        p[:, 2] = torch.exp2(126.0 - c)
    per_tile = FP4_KT // (F.NVFP4_BLOCK if fmt == "nvfp4" else F.MXFP4_BLOCK)
    return Operand(_tile_k(w, FP4_KT), _scale_tiles(s, per_tile), p, FP4_KT, n * FP4_KT, 4, n * 4)


def _split_half_repack(packed: torch.Tensor) -> torch.Tensor:
    """Standard E2M1 packing [..., N, K/2] -> split-half packing (byte j = elements j and K/2 + j).
    Done one expert at a time to keep the temporary small."""
    out = torch.empty_like(packed)
    for e in range(packed.shape[0]):
        codes = F.unpack_e2m1(packed[e])
        half = codes.shape[-1] // 2
        out[e] = (codes[..., :half] & 0x0F) | (codes[..., half:] << 4)
    return out


def _tile_k(t: torch.Tensor, width: int) -> torch.Tensor:
    """[E, N, C] -> [E, C/width, N, width] contiguous."""
    e, n, c = t.shape
    return t.reshape(e, n, c // width, width).permute(0, 2, 1, 3).contiguous()


def _scale_tiles(s: torch.Tensor, per_tile: int) -> torch.Tensor:
    """Block scales uint8 [E, N, K/G] -> [E, K/2/FP4_KT, N, 4]: per row and K tile of the split-half
    packing, the scales of its low half (bytes 0-1) and of its high half (bytes 2-3); MXFP4 (one
    scale per half and tile) leaves bytes 1 and 3 zero. 4 bytes per row, so the pipelined decode
    loop can copy them with cp.async (1-byte loads cannot be)."""
    e, n, g = s.shape
    lo = s[..., : g // 2].reshape(e, n, -1, per_tile)
    hi = s[..., g // 2:].reshape(e, n, -1, per_tile)
    if per_tile == 1:
        lo = torch.nn.functional.pad(lo, (0, 1))
        hi = torch.nn.functional.pad(hi, (0, 1))
    return torch.cat([lo, hi], dim=-1).permute(0, 2, 1, 3).contiguous()
