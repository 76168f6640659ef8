"""Every registered experts backend class and the torch reference implement moe_kernels.interface.Experts,
and declare the same activations / formats / bias capability as their registry entry."""

import inspect

import pytest
import torch
from moe_core import registry
from moe_kernels.backends import load_backend
from moe_kernels.experts import ExpertWeights
from moe_kernels.finalize import DeferredMoEOutput
from moe_kernels.interface import Experts, interface_gaps
from moe_kernels.reference import TorchExperts


@pytest.mark.parametrize("name", registry.names())
def test_registered_backend_implements_the_interface(name):
    cls = load_backend(name)
    assert interface_gaps(cls) == [], f"{name} ({cls.__name__})"
    spec = registry.get(name)
    assert cls.activations == spec.expert_activations and cls.supports_bias == spec.expert_bias
    assert cls.formats <= spec.weight_formats, f"{name} takes formats its registry entry does not list"


def test_torch_reference_implements_it_and_computes_through_it():
    assert interface_gaps(TorchExperts) == []
    torch.manual_seed(0)
    E, H, I = 4, 16, 8
    experts = TorchExperts(ExpertWeights.from_dense(torch.randn(E, 2 * I, H), torch.randn(E, H, I), "bf16"))
    assert isinstance(experts, Experts)
    x = torch.randn(3, H, dtype=torch.bfloat16)
    w, ids = torch.full((3, 2), 0.5), torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    out = experts.forward(x, w, ids, shared_output=None, routed_scale=1.0, defer_finalize=False)
    assert isinstance(out, torch.Tensor) and out.shape == (3, H)
    assert isinstance(experts.forward(x, w, ids, defer_finalize=True), DeferredMoEOutput)


def test_gaps_are_named():
    class Half:
        activations = {"silu"}  # a set, not a frozenset
        formats = frozenset({"bf16"})

        def forward(self, x, topk_weights, topk_ids, shared_output=None):
            return x

    gaps = interface_gaps(Half)
    assert "activations is not a frozenset" in gaps and "supports_bias is not a bool" in gaps
    assert "no __call__" in gaps
    assert any("keyword-only parameters are []" in g for g in gaps)
    assert not isinstance(Half(), Experts)


def test_the_protocol_forward_is_what_the_gaps_check():
    params = inspect.signature(Experts.forward).parameters.values()
    assert tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY) == ("shared_output", "routed_scale",
                                                                         "defer_finalize")
