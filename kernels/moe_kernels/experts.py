"""`ExpertWeights`: the stacked routed-expert weights of one MoE layer, tagged with their format.

Logical shapes: w13 [E, 2I, H] (rows [0, I) gate, [I, 2I) up), w2 [E, H, I]. Storage per format:
- bf16:  w13, w2 bf16 tensors
- fp8:   Fp8BlockTensor (float8_e4m3fn weight + fp32 scale_inv per 128x128 block)
- nvfp4: NvFp4Tensor (packed e2m1 + e4m3 block scales per 16 + fp32 global scale per expert;
         w13 may carry separate gate/up global scales, shape [E, 2])
- mxfp4: MxFp4Tensor (packed e2m1 + E8M0 uint8 scales per 32)
Every experts backend takes one of these; backends that want another layout re-lay it out in
their own constructor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from moe_core.formats import EXPERT_FORMATS

from . import formats as F
from .finalize import DeferredMoEOutput  # noqa: F401  (re-exported: part of the experts contract)

_QUANTIZE = {
    "bf16": lambda w: w.to(torch.bfloat16).contiguous(),
    "fp8": F.quantize_fp8_block,
    "nvfp4": F.quantize_nvfp4,
    "mxfp4": F.quantize_mxfp4,
}


_KEYS = {
    "bf16": ("w13_weight", "w2_weight"),
    "fp8": ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv"),
    "nvfp4": ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
              "w2_weight_scale_2"),
    "mxfp4": ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"),
}


def dequantize(t: Any, dtype=torch.bfloat16) -> torch.Tensor:
    """A plain tensor or a format tensor (NvFp4Tensor, MxFp4Tensor, Fp8BlockTensor) -> dense `dtype`."""
    if isinstance(t, torch.Tensor):
        return t.to(dtype)
    if isinstance(t, F.NvFp4Tensor):
        return F.dequantize_nvfp4(t, dtype)
    if isinstance(t, F.MxFp4Tensor):
        return F.dequantize_mxfp4(t, dtype)
    if isinstance(t, F.Fp8BlockTensor):
        return F.dequantize_fp8_block(t, dtype)
    raise TypeError(f"not an expert weight: {type(t).__name__}")


@dataclass
class ExpertWeights:
    format: str
    w13: Any
    w2: Any
    # Other per-layer tensors a loader passed to from_quantized (e.g. NVFP4 `w13_input_scale`,
    # `w2_input_scale` static activation scales that W4A4 backends need); not used by weight-only kernels.
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.format not in EXPERT_FORMATS:
            raise ValueError(f"unknown expert weight format {self.format!r}; known: {EXPERT_FORMATS}")
        e, n13, h = self.w13.shape
        e2, h2, i = self.w2.shape
        if e != e2 or h != h2 or n13 != 2 * i:
            raise ValueError(f"inconsistent expert shapes: w13 {tuple(self.w13.shape)}, w2 {tuple(self.w2.shape)}")

    # ----------------------------------------------------------------------------- geometry
    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def device(self) -> torch.device:
        t = self.w13 if isinstance(self.w13, torch.Tensor) else next(iter(vars(self.w13).values()))
        return t.device

    # -------------------------------------------------------------------------- constructors
    @classmethod
    def from_dense(cls, w13: torch.Tensor, w2: torch.Tensor, format: str) -> "ExpertWeights":
        """Quantize dense weights (any float dtype) into `format`."""
        if format not in _QUANTIZE:
            raise ValueError(f"unknown expert weight format {format!r}")
        return cls(format, _QUANTIZE[format](w13), _QUANTIZE[format](w2))

    @classmethod
    def from_quantized(cls, format: str, **t: torch.Tensor) -> "ExpertWeights":
        """Build from what a checkpoint loader stacks per expert (sglang parameter names):

        bf16:  w13_weight, w2_weight
        fp8:   w13_weight (e4m3), w13_weight_scale_inv, w2_weight, w2_weight_scale_inv
        nvfp4: w13_weight (uint8 [E,2I,H/2]), w13_weight_scale (e4m3 [E,2I,H/16]),
               w13_weight_scale_2 ([E] or [E,2] gate/up), w2_weight, w2_weight_scale, w2_weight_scale_2 [E]
        mxfp4: w13_weight (uint8 [E,2I,H/2] or gpt-oss blocks [E,2I,H/32,16]), w13_weight_scale (uint8),
               w2_weight, w2_weight_scale
        Gate/up must already be in [gate; up] row order (gpt-oss interleaves them: de-interleave first).
        """
        used = _KEYS[format] if format in _KEYS else ()
        extras = {k: v for k, v in t.items() if k not in used}

        def need(name):
            if name not in t:
                raise KeyError(f"{format} expert weights need {name!r}; got {sorted(t)}")
            return t[name]

        if format == "bf16":
            return cls(format, need("w13_weight").to(torch.bfloat16), need("w2_weight").to(torch.bfloat16), extras)
        if format == "fp8":
            return cls(format,
                       F.Fp8BlockTensor(need("w13_weight").view(torch.float8_e4m3fn), need("w13_weight_scale_inv").float()),
                       F.Fp8BlockTensor(need("w2_weight").view(torch.float8_e4m3fn), need("w2_weight_scale_inv").float()), extras)
        if format == "nvfp4":
            def gs(name):
                g = need(name).float()
                return g.squeeze(-1) if g.dim() == 2 and g.shape[-1] == 1 else g
            return cls(format,
                       F.NvFp4Tensor(need("w13_weight").view(torch.uint8), need("w13_weight_scale").view(torch.float8_e4m3fn),
                                     gs("w13_weight_scale_2")),
                       F.NvFp4Tensor(need("w2_weight").view(torch.uint8), need("w2_weight_scale").view(torch.float8_e4m3fn),
                                     gs("w2_weight_scale_2")), extras)
        if format == "mxfp4":
            def packed(name):
                p = need(name).view(torch.uint8)
                return p.flatten(-2) if p.dim() == 4 else p  # gpt-oss [E, N, K/32, 16] blocks
            return cls(format,
                       F.MxFp4Tensor(packed("w13_weight"), need("w13_weight_scale").view(torch.uint8)),
                       F.MxFp4Tensor(packed("w2_weight"), need("w2_weight_scale").view(torch.uint8)), extras)
        raise ValueError(f"unknown expert weight format {format!r}")

    # ------------------------------------------------------------------------------- access
    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 bf16 [E, 2I, H], w2 bf16 [E, H, I])."""
        return dequantize(self.w13), dequantize(self.w2)

    def dequantize_expert(self, e: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (w13 [2I, H], w2 [H, I]) in `dtype`, without dequantizing the whole stack."""
        return dequantize(self.w13[e], dtype), dequantize(self.w2[e], dtype)

    def to(self, device) -> "ExpertWeights":
        return ExpertWeights(self.format, self.w13.to(device), self.w2.to(device),
                             {k: v.to(device) for k, v in self.extras.items()})

    def nbytes_per_expert(self) -> int:
        """Bytes one expert's weights occupy in this format (weights + scales)."""
        def nb(t):
            if isinstance(t, torch.Tensor):
                return t[0].numel() * t.element_size()
            return sum(v[0].numel() * v.element_size() for v in vars(t).values()
                       if isinstance(v, torch.Tensor) and v.dim() > 1)
        return nb(self.w13) + nb(self.w2)
