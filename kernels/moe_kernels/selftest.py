"""Run one backend on a small random MoE problem and compare it with the torch reference.

The runtime calls this before reporting ready and falls back to the next registry candidate when
`ok` is False (wrong results, an import error, an unsupported GPU: anything raised is a failure).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moe_core import registry

from .backends import load_backend
from .experts import ExpertWeights
from .reference import TorchExperts
from .routing import softmax_topk

# bf16 operands, fp32 accumulation: the backends and the reference differ by a few bf16 roundings
# (~0.5%). W4A4 backends (flashinfer NVFP4) also quantise activations, hence the looser bound.
TOLERANCE = 2e-2
TOLERANCE_W4A4 = 0.15


@dataclass
class SelfTestResult:
    ok: bool
    max_rel_err: float
    message: str


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _problem(weight_format: str, device: str, e=8, h=256, i=128, t=16, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    weights = ExpertWeights.from_dense(w13, w2, weight_format).to(device)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    topk_w, topk_ids = softmax_topk(torch.randn(t, e, generator=g).to(device), k, renormalize=True)
    shared = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    return weights, x, topk_w, topk_ids, shared


def _calibrate_input_scales(weights: ExpertWeights, x, topk_w, topk_ids):
    """Static activation scales (amax / (6*448)) for W4A4 backends, measured with the reference."""
    w13, _ = weights.dequantize()
    h = x.float() @ w13.float().reshape(-1, w13.shape[-1]).t()
    inter = weights.intermediate_size
    h = h.view(x.shape[0], weights.num_experts, 2, inter)
    act = torch.nn.functional.silu(h[:, :, 0]) * h[:, :, 1]
    weights.extras.setdefault("w13_input_scale", (x.float().abs().amax() / 2688.0).reshape(1))
    weights.extras.setdefault("w2_input_scale", (act.abs().amax() / 2688.0).reshape(1))


def selftest(backend_name: str, weight_format: str, device: str, activation: str = "silu",
             bias: bool = False) -> SelfTestResult:
    """activation / bias: the model's expert activation and whether its experts have biases (gpt-oss:
    "swiglu_oai", True): the problem then has random biases and gate/up values past the clamp."""
    try:
        spec = registry.get(backend_name)
        if weight_format not in spec.weight_formats:
            return SelfTestResult(False, float("inf"), f"{backend_name} does not load {weight_format} experts")
        if not spec.runs_experts(activation, bias):
            return SelfTestResult(False, float("inf"), f"{backend_name} does not run {activation} experts"
                                  + (" with biases" if bias else ""))
        weights, x, topk_w, topk_ids, shared = _problem(weight_format, device)
        if bias:
            g = torch.Generator().manual_seed(1)
            e, h, i = weights.num_experts, weights.hidden_size, weights.intermediate_size
            weights.extras.update(w13_bias=(torch.randn(e, 2 * i, generator=g) * 8).to(torch.bfloat16).to(device),
                                  w2_bias=torch.randn(e, h, generator=g).to(torch.bfloat16).to(device))
        kw = {} if activation == "silu" else {"activation": activation}
        w4a4 = spec.activation not in ("bf16",)
        if w4a4:
            _calibrate_input_scales(weights, x, topk_w, topk_ids)
        ref = TorchExperts(weights, **kw).forward(x, topk_w, topk_ids, shared_output=shared, routed_scale=1.5)
        experts = load_backend(backend_name)(weights, **kw)
        out = experts.forward(x, topk_w, topk_ids, shared_output=shared, routed_scale=1.5)
        err = _rel(out, ref)
        msgs = [f"forward rel err {err:.2e}"]
        if spec.deferred_finalize:
            deferred = experts.forward(x, topk_w, topk_ids, routed_scale=1.5, defer_finalize=True)
            err_d = _rel(deferred.finalize(shared), ref)
            msgs.append(f"deferred rel err {err_d:.2e}")
            err = max(err, err_d)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        tol = TOLERANCE_W4A4 if w4a4 else TOLERANCE
        ok = err <= tol
        return SelfTestResult(ok, err, f"{backend_name}/{weight_format}/{activation} on {device}: " + ", ".join(msgs)
                              + ("" if ok else f" > tolerance {tol}"))
    except Exception as exc:  # any failure means: do not use this backend
        return SelfTestResult(False, float("inf"), f"{backend_name}/{weight_format} on {device} failed: "
                              f"{type(exc).__name__}: {exc}")
