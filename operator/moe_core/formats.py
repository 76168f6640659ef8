"""Checkpoint formats: the one table (tuning-rules.md section 6 vocabulary).

Every checkpoint format the operator can detect, the *expert* weight format its routed experts
are stored in (what a MoE kernel backend loads: bf16, fp8 block, nvfp4, mxfp4) and whether those
experts are FP4. Which bundled-runtime backends load a format follows from the expert format and
the backend registry (`moe_core.registry`); whether the bundled runtime's loader reads the
checkpoint at all is in the runtime capability table (`moe_core.runtime`). sglang and vLLM have
their own rules in the planner.
"""

from __future__ import annotations

from typing import NamedTuple

# Expert weight formats a kernel backend can load (moe_kernels.experts.ExpertWeights storage).
EXPERT_FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
# the packed 4-bit ones (E2M1 codes two per byte, block scales beside them)
FP4_EXPERT = frozenset({"nvfp4", "mxfp4"})


class Format(NamedTuple):
    expert: str | None  # expert weight format, None: no bundled kernel runs these experts
    what: str

    @property
    def fp4(self) -> bool:
        """Routed experts are 4-bit floats (NVFP4 or MXFP4 blocks)."""
        return self.expert in FP4_EXPERT


# checkpoint format -> facts. Order is the API enum's order.
TABLE: dict[str, Format] = {
    "bf16": Format("bf16", "unquantized BF16"),
    "fp8": Format("fp8", "FP8 with 128x128 block scales (DeepSeek-V3 style)"),
    "modelopt_fp8": Format("fp8", "ModelOpt FP8 (per-tensor scales)"),
    "mxfp8": Format(None, "MXFP8 (OCP MX, 32-element E8M0 blocks)"),
    "nvfp4": Format("nvfp4", "ModelOpt NVFP4 (W4A4, 16-element E4M3 blocks)"),
    "ct_nvfp4": Format("nvfp4", "compressed-tensors NVFP4"),
    "mixed": Format("nvfp4", "ModelOpt mixed precision FP8 + NVFP4 experts"),
    "mixed_w4a16": Format("nvfp4", "ModelOpt mixed precision, W4A16 NVFP4 experts"),
    "w4afp8": Format(None, "INT4 weights x FP8 activations"),
    "mxfp4": Format("mxfp4", "MXFP4 (OCP MX, 32-element E8M0 blocks; gpt-oss)"),
    "ct_int4_g32": Format(None, "compressed-tensors INT4, group 32"),
    # integer weight-only (WNA16) methods: bits, group size, symmetry and activation order are in
    # CheckpointInfo.quantScheme (the engines' MoE methods choose their kernels from them)
    "gptq": Format(None, "GPTQ integer weight-only (W4A16 / W8A16)"),
    "awq": Format(None, "AWQ integer weight-only (W4A16, zero points)"),
    "ct_wna16": Format(None, "compressed-tensors integer weight-only (pack-quantized WNA16, not INT4 group 32)"),
    "ct_mxfp4_pack": Format("mxfp4", "compressed-tensors MXFP4 pack-quantized"),
    "dsv4_fp4": Format("mxfp4", "DeepSeek-V4 FP4 (MXFP4) routed experts"),
    "dsv4_fp8": Format("fp8", "DeepSeek-V4 experts converted to FP8"),
    "dsv4_nvfp4": Format("nvfp4", "DeepSeek-V4 hybrid FP8 + NVFP4 experts"),
    "other": Format(None, "a quantization without tuning rules"),
}

FORMATS = tuple(TABLE)
FP4_EXPERT_FORMATS = frozenset(f for f, t in TABLE.items() if t.fp4)


def expert_format(checkpoint_format: str) -> str | None:
    """Expert weight format of a checkpoint format, or None when no bundled kernel runs it."""
    t = TABLE.get(checkpoint_format)
    return t.expert if t else None


def is_fp4(checkpoint_format: str) -> bool:
    t = TABLE.get(checkpoint_format)
    return bool(t and t.fp4)


def with_expert_format(expert: str) -> tuple[str, ...]:
    """Checkpoint formats whose experts are stored as `expert`."""
    return tuple(f for f, t in TABLE.items() if t.expert == expert)
