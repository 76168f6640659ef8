"""The experts interface every MoE backend implements (TorchExperts, TritonExperts, the flashinfer
wrappers): what the runtime's MoE block may rely on, declared once so backends can be swapped and
checked against it (tests/unit/kernels/test_experts_interface.py).

A backend is built from one layer's `ExpertWeights` (`experts.py`) and computes, for tokens `x`
[T, H] bf16 routed to `topk_ids` [T, K] with `topk_weights` [T, K]:
    out[t] = routed_scale * sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) (+ shared_output[t])
where expert_e(x) = w2_e @ act(w13_e @ x (+ w13_bias_e)) (+ w2_bias_e) and `act` one of its
`activations` ("silu": silu(gate) * up; "swiglu_oai": gpt-oss's clamped SwiGLU, reference.activate).
With `defer_finalize=True` a backend that can stops before the weighted sum and returns a
`DeferredMoEOutput` (gemm2_out, weights, perm, scale) for finalize.py to fuse with the shared expert.
"""

from __future__ import annotations

import inspect
from typing import ClassVar, Protocol, runtime_checkable

import torch

from .finalize import DeferredMoEOutput

# The forward's keyword-only parameters, in order (the test compares every backend's signature).
FORWARD_KEYWORDS = ("shared_output", "routed_scale", "defer_finalize")


@runtime_checkable
class Experts(Protocol):
    activations: ClassVar[frozenset[str]]  # activation functions it computes ("silu", "swiglu_oai")
    formats: ClassVar[frozenset[str]]  # ExpertWeights formats it takes ("bf16", "fp8", "nvfp4", "mxfp4")
    supports_bias: ClassVar[bool]  # whether it adds ExpertWeights.extras["w13_bias"/"w2_bias"]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                shared_output: torch.Tensor | None = None, routed_scale: float = 1.0,
                defer_finalize: bool = False) -> torch.Tensor | DeferredMoEOutput: ...

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 shared_output: torch.Tensor | None = None, routed_scale: float = 1.0,
                 defer_finalize: bool = False) -> torch.Tensor | DeferredMoEOutput: ...


def interface_gaps(cls: type) -> list[str]:
    """What `cls` lacks of the Experts interface (empty: it implements it): a missing or mistyped
    class attribute, a missing forward/__call__, or a forward whose parameters differ."""
    gaps = [f"{name} is not a {kind.__name__}" for name, kind in
            (("activations", frozenset), ("formats", frozenset), ("supports_bias", bool))
            if not isinstance(getattr(cls, name, None), kind)]
    # defined on the class itself (a class object is always callable: type.__call__ does not count)
    gaps += [f"no {m}" for m in ("forward", "__call__")
             if not any(callable(vars(k).get(m)) for k in cls.__mro__[:-1])]
    fwd = getattr(cls, "forward", None)
    if callable(fwd):
        params = list(inspect.signature(fwd).parameters.values())
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keywords = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)
        if positional[1:] != ["x", "topk_weights", "topk_ids"]:
            gaps.append(f"forward's positional parameters are {positional[1:]}, not [x, topk_weights, topk_ids]")
        if keywords != FORWARD_KEYWORDS:
            gaps.append(f"forward's keyword-only parameters are {list(keywords)}, not {list(FORWARD_KEYWORDS)}")
    return gaps
