"""The architecture registry (moe_runtime.models, issue 33 item 1): each served architecture is one
folder whose `ARCH` answers every question of the `Arch` protocol, the table names the folder, and
every architecture's MoE layers are the one shared MoE block, their experts a backend of the
kernels' interface (gpt-oss's too: activation and biases are its backend's)."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from moe_core.runtime import BUNDLED
from moe_kernels.interface import interface_gaps
from moe_kernels.reference import TorchExperts

from moe_runtime import models
from moe_runtime.checkpoint_writer import make_checkpoint
from moe_runtime.errors import RuntimeFailure
from moe_runtime.loader import build_model, load_checkpoint
from moe_runtime.models.arch import Arch
from moe_runtime.models.common.moe import MoEBlock
from moe_runtime.models.gpt_oss import Experts as GptOssExperts

PROTOCOL = [n for n, v in vars(Arch).items() if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("hf_class,module", sorted(BUNDLED.architectures.items()))
def test_each_table_row_is_a_folder_whose_arch_answers_the_protocol(hf_class, module):
    a = models.get(module)
    assert (a.name, a.hf_class) == (module, hf_class)
    assert models.arch_for({"architectures": [hf_class]}) is a
    assert type(a).__module__ == f"moe_runtime.models.{module}.arch"
    missing = [n for n in PROTOCOL if not callable(getattr(a, n, None))]
    assert missing == [] and len(PROTOCOL) >= 14
    for n in PROTOCOL:  # the same parameters as the protocol declares
        want = list(inspect.signature(getattr(Arch, n)).parameters)[1:]
        assert list(inspect.signature(getattr(a, n)).parameters)[: len(want)] == want, n
    assert a.required and a.experts_key and isinstance(a.aliases, dict)


def test_unknown_architectures_are_refused_naming_what_is_served():
    with pytest.raises(RuntimeFailure, match="unsupported architecture 'LlamaForCausalLM'.*GptOssForCausalLM"):
        models.arch_for({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(RuntimeFailure, match="unknown architecture module 'llama'"):
        models.get("llama")


@pytest.mark.parametrize("module,fmt", [(m, f) for m in BUNDLED.architectures.values() for f in ("bf16",)]
                         + [("gpt_oss", "mxfp4")])
def test_every_architecture_runs_the_shared_moe_block(tmp_path, module, fmt):
    path = make_checkpoint(tmp_path / module, module, fmt, "tiny", seed=3)
    ck = load_checkpoint(path, "cpu", torch.float32, log=lambda *a, **k: None)
    m = build_model(ck, functools.partial(TorchExperts, dtype=torch.float32), deferred=False)
    blocks = [layer.mlp for layer in m.layers if isinstance(layer.mlp, MoEBlock)]
    assert blocks and len(blocks) == sum(models.get(module).is_moe_layer(ck.config, i)
                                         for i in range(ck.config["num_hidden_layers"]))
    for b in blocks:
        assert interface_gaps(type(b.experts)) == []
        if module == "gpt_oss":  # its activation and biases are its backend's
            assert isinstance(b.experts, GptOssExperts) and b.routing.kind == "topk_softmax"
            assert b.router_bias is not None and "swiglu_oai" in b.experts.activations


def test_gpt_oss_experts_backend_applies_scale_and_shared_output_and_refuses_deferral():
    from moe_kernels.experts import ExpertWeights

    g = torch.Generator().manual_seed(0)
    E, H, inter = 4, 16, 8
    ew = ExpertWeights.from_dense(torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g),
                                  "bf16")
    ew.extras.update(w13_bias=torch.randn(E, 2 * inter, generator=g), w2_bias=torch.randn(E, H, generator=g))
    ex = GptOssExperts(ew, 1.702, 7.0)
    x = torch.randn(3, H, generator=g)
    w, ids = torch.rand(3, 2, generator=g), torch.tensor([[0, 1], [2, 3], [1, -1]])
    y = ex(x, w, ids)
    shared = torch.randn(3, H, generator=g)
    assert torch.allclose(ex(x, w, ids, routed_scale=2.0, shared_output=shared), 2 * y + shared)
    with pytest.raises(ValueError, match="finalize themselves"):
        ex(x, w, ids, defer_finalize=True)
