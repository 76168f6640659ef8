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


def dequantize(fmt: str, t, dtype=torch.float32) -> torch.Tensor:
    """Format tensor (or plain tensor for bf16) -> dense tensor."""
    if fmt == "bf16":
        return t.to(dtype)
    if fmt == "nvfp4":
        return dequantize_nvfp4(t, dtype=dtype)
    if fmt == "mxfp4":
        return dequantize_mxfp4(t, dtype=dtype)
    if fmt == "fp8":
        return dequantize_fp8_block(t, dtype=dtype)
    raise ValueError(f"unknown expert weight format {fmt!r}")


# ------------------------------------------------------------------------------------------------
# Routing

try:
    from moe_kernels.routing import grouped_topk, softmax_topk  # type: ignore
except Exception:
    MISSING.append("moe_kernels.routing")

    def softmax_topk(router_logits, top_k, renormalize):
        probs = torch.softmax(router_logits.float(), dim=-1)
        w, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
        return w, ids.to(torch.int32)

    def grouped_topk(router_logits, e_score_correction_bias, top_k, n_group, topk_group,
                     routed_scaling_factor=1.0, renormalize=True):
        t, e = router_logits.shape
        scores = router_logits.float().sigmoid()
        choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
        g = choice.view(t, n_group, e // n_group)
        gs = g.topk(2, dim=-1).values.sum(-1) if e_score_correction_bias is not None else g.amax(-1)
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(topk_group, dim=-1).indices, True)
        ids = g.masked_fill(~keep[..., None], float("-inf")).view(t, e).topk(top_k, dim=-1).indices
        w = scores.gather(1, ids)
        if renormalize and top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * routed_scaling_factor, ids.to(torch.int32)


# ------------------------------------------------------------------------------------------------
# Finalize

try:
    from moe_kernels.finalize import DeferredMoEOutput, moe_finalize_fuse_shared  # type: ignore
except Exception:
    MISSING.append("moe_kernels.finalize")
    from dataclasses import dataclass

    @dataclass
    class DeferredMoEOutput:  # type: ignore[no-redef]
        gemm2_out: torch.Tensor
        expert_weights: torch.Tensor
        expanded_idx_to_permuted_idx: torch.Tensor
        routed_scale: float = 1.0

    def moe_finalize_fuse_shared(gemm2_out, expert_weights, expanded_idx_to_permuted_idx, shared_output=None,
                                 routed_scale=None):
        t, k = expert_weights.shape
        perm = expanded_idx_to_permuted_idx.view(t, k).long()
        rows = gemm2_out[perm.clamp(min=0)].float() * (perm >= 0)[..., None]
        acc = (rows * expert_weights.float()[..., None]).sum(1) * (1.0 if routed_scale is None else routed_scale)
        if shared_output is not None:
            acc = acc + shared_output.float()
        return acc.to(gemm2_out.dtype)


def finalize_any_dtype(gemm2_out, expert_weights, perm, shared_output=None, routed_scale=1.0):
    """The kernels' finalize is bf16-only by contract; fp32 activations (CPU test mode) use this."""
    if gemm2_out.dtype == torch.bfloat16 and (shared_output is None or shared_output.dtype == torch.bfloat16):
        return moe_finalize_fuse_shared(gemm2_out, expert_weights, perm, shared_output, routed_scale)
    t, k = expert_weights.shape
    p = perm.view(t, k).long()
    rows = gemm2_out[p.clamp(min=0)].float() * (p >= 0)[..., None]
    acc = (rows * expert_weights.float()[..., None]).sum(1) * routed_scale
    if shared_output is not None:
        acc = acc + shared_output.float()
    return acc.to(gemm2_out.dtype)


# ------------------------------------------------------------------------------------------------
# Experts: weights container and the torch reference backend

class LocalExpertWeights:
    """Fallback for moe_kernels.experts.ExpertWeights (same from_quantized tensor names)."""

    def __init__(self, format: str, w13, w2):
        self.format, self.w13, self.w2 = format, w13, w2

    @classmethod
    def from_quantized(cls, format: str, **t):
        if format == "bf16":
            return cls(format, t["w13_weight"], t["w2_weight"])
        if format == "fp8":
            return cls(format, Fp8BlockTensor(t["w13_weight"], t["w13_weight_scale_inv"]),
                       Fp8BlockTensor(t["w2_weight"], t["w2_weight_scale_inv"]))
        if format == "nvfp4":
            return cls(format, NvFp4Tensor(t["w13_weight"], t["w13_weight_scale"], t["w13_weight_scale_2"]),
                       NvFp4Tensor(t["w2_weight"], t["w2_weight_scale"], t["w2_weight_scale_2"]))
        if format == "mxfp4":
            return cls(format, MxFp4Tensor(t["w13_weight"], t["w13_weight_scale"]),
                       MxFp4Tensor(t["w2_weight"], t["w2_weight_scale"]))
        raise ValueError(format)

    def to(self, device):
        return LocalExpertWeights(self.format, self.w13.to(device), self.w2.to(device))


try:
    from moe_kernels.experts import ExpertWeights  # type: ignore
except Exception:
    MISSING.append("moe_kernels.experts")
    ExpertWeights = LocalExpertWeights  # type: ignore


def make_expert_weights(fmt: str, tensors: dict[str, torch.Tensor]):
    """Stacked checkpoint tensors (w13_weight, w13_weight_scale, ... sglang names) -> ExpertWeights."""
    return ExpertWeights.from_quantized(fmt, **tensors)


class Fp32ReferenceExperts:
    """The runtime's exact-mode experts: weights dequantised once to fp32, fp32 math per expert.

    The kernels' backends compute in bf16 by contract; this exists for `--dtype float32` (CPU
    correctness checks against transformers, dequantised-vs-quantised comparisons), where bf16
    rounding inside the experts would hide the differences being measured."""

    name = "fp32-reference"

    def __init__(self, weights):
        self.w13 = dequantize(weights.format, weights.w13, torch.float32)
        self.w2 = dequantize(weights.format, weights.w2, torch.float32)
        self.num_experts, self.inter = self.w13.shape[0], self.w2.shape[-1]

    def forward(self, x, topk_weights, topk_ids, *, shared_output=None, routed_scale=1.0, defer_finalize=False):
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tok = order // k
        out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            rows = slice(start, start + c)
            h = torch.nn.functional.linear(x[tok[rows]], self.w13[e].to(x.dtype))
            h = torch.nn.functional.silu(h[:, : self.inter]) * h[:, self.inter:]
            out[rows] = torch.nn.functional.linear(h, self.w2[e].to(x.dtype))
            start += c
        perm = torch.empty_like(flat)
        perm[order] = torch.arange(t * k, device=x.device)
        perm = perm.to(torch.int32)
        if defer_finalize:
            return DeferredMoEOutput(out, topk_weights, perm, routed_scale)
        return finalize_any_dtype(out, topk_weights, perm, shared_output, routed_scale)


LocalTorchExperts = Fp32ReferenceExperts


def load_backend(name: str):
    """Experts class of a registry backend: moe_kernels.backends.load_backend, else the registry's
    `implementation` ("module:attr") imported directly."""
    try:
        from moe_kernels.backends import load_backend as _load  # type: ignore
    except Exception:
        import importlib

        from moe_kernels import registry

        mod, _, attr = registry.get(name).implementation.partition(":")
        try:
            return getattr(importlib.import_module(mod), attr)
        except Exception as e:
            if name == "torch":
                return Fp32ReferenceExperts
            raise ImportError(f"cannot import backend {name!r} ({mod}:{attr}): {e}") from None
    return _load(name)


def installed_packages() -> dict[str, str | None]:
    try:
        from moe_kernels.backends import installed_packages as _ip  # type: ignore
        return _ip()
    except Exception:
        from importlib import metadata

        out: dict[str, str | None] = {}
        for pkg in ("triton", "flashinfer-python", "torch"):
            try:
                out[pkg] = metadata.version(pkg)
            except metadata.PackageNotFoundError:
                out[pkg] = None
        return out


def selftest(backend_name: str, weight_format: str, device: str):
    """-> object with ok, max_rel_err, message (moe_kernels.selftest, or a local equivalent)."""
    try:
        from moe_kernels.selftest import selftest as _st  # type: ignore
    except Exception:
        return _local_selftest(backend_name, weight_format, device)
    return _st(backend_name, weight_format, device)


class SelfTestResult:
    def __init__(self, ok: bool, max_rel_err: float, message: str):
        self.ok, self.max_rel_err, self.message = ok, max_rel_err, message


def _local_selftest(backend_name: str, weight_format: str, device: str, tol: float = 2e-2):
    """Backend vs the local reference on a small random problem (bf16 activations)."""
    try:
        g = torch.Generator().manual_seed(1234)
        E, H, I, T, K = 8, 256, 128, 16, 2
        w13 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
        w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
        q13, q2 = _quantize_for(weight_format, w13), _quantize_for(weight_format, w2)
        ref = Fp32ReferenceExperts(LocalExpertWeights(weight_format, q13, q2))
        cls = load_backend(backend_name)
        impl = cls(LocalExpertWeights(weight_format, q13, q2).to(device) if ExpertWeights is LocalExpertWeights
                   else ExpertWeights(weight_format, q13, q2).to(device))
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        logits = torch.randn(T, E, generator=g)
        w, ids = softmax_topk(logits, K, True)
        want = ref.forward(x, w, ids).float()
        got = impl.forward(x.to(device), w.to(device), ids.to(device)).float().cpu()
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
        ok = bool(torch.isfinite(got).all()) and err <= tol
        return SelfTestResult(ok, err, f"max rel err {err:.2e} (tolerance {tol:.0e})")
    except Exception as e:  # a backend that cannot even run fails its self-test
        return SelfTestResult(False, float("inf"), f"{type(e).__name__}: {e}")


def _quantize_for(fmt: str, w: torch.Tensor):
    if fmt == "bf16":
        return w.to(torch.bfloat16)
    if fmt == "nvfp4":
        return quantize_nvfp4(w)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    if fmt == "fp8":
        return quantize_fp8_block(w)
    raise ValueError(fmt)

