"""The experts contract for gpt-oss: activation="swiglu_oai" (clamped SwiGLU, alpha/limit) and the
expert biases of ExpertWeights.extras, in the torch reference (against the runtime's gpt-oss experts)
and in the Triton kernels' epilogues (tile kernel under TRITON_INTERPRET=1; the fragment kernel
is covered on the GPU, tests/gpu/test_kernels_gpu.py). Tiny shapes: seconds."""

import os
import subprocess
import sys

import pytest
import torch

from moe_core import registry
from moe_kernels.experts import ExpertWeights
from moe_kernels.reference import TorchExperts, activate
from moe_kernels.routing import softmax_topk

E, H, I = 8, 64, 32


def _weights(fmt="bf16", bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    ew = ExpertWeights.from_dense(torch.randn(E, 2 * I, H, generator=g) / 3, torch.randn(E, H, I, generator=g) / 6, fmt)
    if bias:
        ew.extras.update(w13_bias=torch.randn(E, 2 * I, generator=g) * 2, w2_bias=torch.randn(E, H, generator=g))
    return ew


def test_activate_is_gpt_oss_clamped_swiglu():
    h = torch.tensor([[9.0, -1.0, 8.0, -9.0], [0.5, -20.0, 0.25, 3.0]])   # gate | up, I = 2
    got = activate(h, "swiglu_oai", alpha=1.702, limit=7.0)
    gate = torch.tensor([[7.0, -1.0], [0.5, -20.0]])
    up = torch.tensor([[7.0, -7.0], [0.25, 3.0]])
    assert torch.allclose(got, (up + 1) * gate * torch.sigmoid(1.702 * gate))
    assert torch.allclose(activate(h, "silu"), torch.nn.functional.silu(h[:, :2]) * h[:, 2:])


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_torch_reference_matches_the_runtime_gpt_oss_experts(fmt):
    gpt_oss = pytest.importorskip("moe_runtime.models.gpt_oss")
    ew = _weights(fmt)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(1)) * 2
    w, ids = softmax_topk(torch.randn(6, E, generator=torch.Generator().manual_seed(2)), 2, True)
    ids[0, 1] = -1                                   # an expert on another rank: skipped by both
    ref = gpt_oss.Experts(ew, 1.702, 7.0).forward(x, w, ids)
    ours = TorchExperts(ew, torch.float32, activation="swiglu_oai").forward(x, w, ids)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)
    # the data reaches the clamp, and dropping the biases changes the result
    h = x @ ew.dequantize()[0][0].float().t() + ew.extras["w13_bias"][0]
    assert (h.abs() > 7).any()
    nobias = ExpertWeights(ew.format, ew.w13, ew.w2)
    assert not torch.allclose(TorchExperts(nobias, torch.float32, activation="swiglu_oai").forward(x, w, ids), ref,
                              atol=1e-2)


def test_bf16_reference_close_to_runtime_gpt_oss_experts():
    gpt_oss = pytest.importorskip("moe_runtime.models.gpt_oss")
    ew = _weights("bf16")
    ew.extras = {k: v.bfloat16() for k, v in ew.extras.items()}
    x = torch.randn(5, H).bfloat16()
    w, ids = softmax_topk(torch.randn(5, E), 3, True)
    ref = gpt_oss.Experts(ew, 1.702, 7.0).forward(x, w.bfloat16(), ids).float()
    ours = TorchExperts(ew, activation="swiglu_oai").forward(x, w, ids).float()
    assert ((ours - ref).norm() / ref.norm()).item() < 2e-2


def test_bad_activation_and_bias_shapes_are_refused():
    with pytest.raises(ValueError, match="unknown expert activation 'gelu'"):
        TorchExperts(_weights(), activation="gelu")
    ew = _weights()
    ew.extras["w2_bias"] = torch.zeros(E, H + 1)
    with pytest.raises(ValueError, match=r"w2_bias must be \[8, 64\]"):
        TorchExperts(ew)


def test_flashinfer_wrappers_refuse_what_they_do_not_compute():
    from moe_kernels.flashinfer_backends import FlashinferMxfp4Experts
    with pytest.raises(ValueError, match="does not run activation 'swiglu_oai'"):
        FlashinferMxfp4Experts(_weights("mxfp4", bias=False), activation="swiglu_oai")
    with pytest.raises(ValueError, match="does not add expert biases"):
        FlashinferMxfp4Experts(_weights("mxfp4"))


def test_registry_capabilities_agree_with_the_classes():
    from moe_kernels.backends import load_backend
    for spec in registry.BACKENDS:
        cls = load_backend(spec.name)
        assert set(cls.activations) == set(spec.expert_activations), spec.name
        assert cls.supports_bias == spec.expert_bias, spec.name
        assert set(spec.weight_formats) <= set(cls.formats), spec.name
    names = [b.name for b in registry.candidates("sm90", "mxfp4", activation="swiglu_oai", bias=True)]
    assert names == ["triton", "torch"]
    assert "flashinfer_mxfp4" in [b.name for b in registry.candidates("sm90", "mxfp4")]


SCRIPT = r"""
import sys, torch
from moe_kernels.experts import ExpertWeights
from moe_kernels.reference import TorchExperts
from moe_kernels.triton_config import GemmConfig, MoEConfig
from moe_kernels.triton_moe import TritonExperts
from moe_kernels.routing import softmax_topk
torch.manual_seed(0)
E, H, I = 8, 256, 128
fmt, mode, act, bias = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
w13 = torch.randn(E, 2 * I, H) / 4   # gate/up ~ N(0, 4^2) for unit x: the clamp at 7 is reached
w2 = torch.randn(E, H, I) / 11
ew = ExpertWeights.from_dense(w13, w2, fmt)
if bias:
    ew.extras.update(w13_bias=torch.randn(E, 2 * I).bfloat16() * 2, w2_bias=torch.randn(E, H).bfloat16())
x = torch.randn(5, H).bfloat16()
w, ids = softmax_topk(torch.randn(5, E), 3, True)
ids[0, -1] = -1
ref = TorchExperts(ew, activation=act).forward(x, w, ids, routed_scale=1.5)
cfg = MoEConfig(16, GemmConfig(32, 128, 4, 1, swap=mode == "swap"), GemmConfig(64, 64, 4, 1, swap=mode == "swap"))
if mode == "row":
    cfg = MoEConfig(1, GemmConfig(32, 64, 4, 1, one_row=True, pipe=3), GemmConfig(64, 64, 4, 1, one_row=True, pipe=3))
out = TritonExperts(ew, cfg, activation=act).forward(x, w, ids, routed_scale=1.5)
err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
other = TorchExperts(ew, activation="silu" if act == "swiglu_oai" else "swiglu_oai").forward(x, w, ids, routed_scale=1.5)
gap = ((other.float() - ref.float()).norm() / ref.float().norm()).item()
print("RESULT", err, gap)
"""


@pytest.mark.parametrize("fmt,mode,act,bias", [("bf16", "mma", "swiglu_oai", "1"), ("mxfp4", "swap", "swiglu_oai", "1"),
                                               ("mxfp4", "row", "swiglu_oai", "1"), ("nvfp4", "mma", "silu", "1")])
def test_triton_bias_and_activation_in_interpreter(fmt, mode, act, bias):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", SCRIPT, fmt, mode, act, bias], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    _, err, gap = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")][-1].split()
    # the interpreter rounds fp32 -> bf16 by truncation (looser than on the GPU); the other activation
    # must be far off on this data, else the test could not tell them apart
    assert float(err) < 3e-2 and float(gap) > 0.2


def test_selftest_runs_the_model_activation_and_refuses_backends_without_it():
    from moe_kernels.selftest import selftest
    for fmt in ("bf16", "mxfp4"):
        res = selftest("torch", fmt, "cpu", activation="swiglu_oai", bias=True)
        assert res.ok and "swiglu_oai" in res.message, res.message
    res = selftest("flashinfer_mxfp4", "mxfp4", "cpu", activation="swiglu_oai", bias=True)
    assert not res.ok and "does not run swiglu_oai experts with biases" in res.message
