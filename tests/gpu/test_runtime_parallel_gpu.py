"""The parallel runtime (moe_runtime.dist) on NVIDIA GPUs over NCCL.

- world size 1 on one GPU: the process group is NCCL, every parallel layer calls its collective (a
  group of one), and the logits equal the run without any process group;
- tp2 / ep2 / tp2xep2 on two GPUs (skipped unless torch.cuda.device_count() >= 2): the fp32 logits and
  greedy tokens equal the single-GPU run, and `moe-runtime serve --device cuda --tp 2` serves the same
  greedy completions as one process.
The helpers are those of tests/unit/runtime/test_runtime_parallel.py (the CPU/gloo tests), with device="cuda".
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "runtime"))

import test_runtime_parallel as P  # noqa: E402

from moe_runtime.checkpoint_writer import make_checkpoint  # noqa: E402

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
              pytest.mark.timeout(300)]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
ATOL_GPU_FP32 = 1e-3  # fp32 on GPU (no TF32 for matmuls by default); only the sum order differs


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for arch, fmt in (("deepseek_v3", "bf16"), ("qwen3_moe", "bf16"), ("deepseek_v3", "nvfp4")):
        d = tmp_path_factory.mktemp(f"{arch}_{fmt}")
        make_checkpoint(d, arch, fmt, "tiny", seed=1, log=lambda s: None)
        out[(arch, fmt)] = d
    return out


@pytest.mark.parametrize("arch,fmt,dtype", [("deepseek_v3", "bf16", "float32"), ("qwen3_moe", "bf16", "float32"),
                                            ("deepseek_v3", "bf16", "bfloat16"), ("deepseek_v3", "nvfp4", "bfloat16")])
def test_nccl_world_size_1_equals_no_group(ckpts, tmp_path, arch, fmt, dtype):
    path = ckpts[(arch, fmt)]
    ref, ref_toks = P._single(path, dtype, device="cuda")
    (out,) = P._run_group(path, 1, 1, dtype, tmp_path, device="cuda")
    # one rank: the all-reduces and the vocab all-gather are identities (fp32 round trip of bf16 is exact)
    assert (out["logits"] - ref).abs().max().item() <= 1e-5
    assert torch.equal(out["tokens"], ref_toks)


@two_gpus
@pytest.mark.parametrize("arch,tp,ep", [("deepseek_v3", 2, 1), ("deepseek_v3", 1, 2), ("deepseek_v3", 2, 2),
                                        ("qwen3_moe", 2, 1), ("qwen3_moe", 2, 2)])
def test_two_gpus_fp32_logits_equal_single_gpu(ckpts, tmp_path, arch, tp, ep):
    path = ckpts[(arch, "bf16")]
    ref, ref_toks = P._single(path, "float32", device="cuda")
    outs = P._run_group(path, tp, ep, "float32", tmp_path, device="cuda")
    for r, o in enumerate(outs):
        diff = (o["logits"] - ref).abs().max().item()
        assert diff <= ATOL_GPU_FP32, f"rank {r}: {diff}"
        assert torch.equal(o["tokens"], ref_toks)


@two_gpus
def test_serve_tp2_on_two_gpus_same_greedy_completions(ckpts, tmp_path):
    path = ckpts[("deepseek_v3", "bf16")]
    ref_srv = _serve_cuda(path, tmp_path)
    try:
        ref_srv.wait_ready(timeout=240)
        ref = [ref_srv.complete(p) for p in P.PROMPTS]
    finally:
        ref_srv.stop()
    par = _serve_cuda(path, tmp_path, "--tp", "2")
    try:
        par.wait_ready(timeout=240)
        assert [par.complete(p) for p in P.PROMPTS] == ref
    finally:
        par.stop()
    assert par.proc.returncode == 0, par.logs()


def _serve_cuda(path, tmp_path, *extra):
    """P.Serve with --device cuda (the last --device on the command line wins in argparse)."""
    return P.Serve(path, "--dtype", "float32", "--device", "cuda", *extra, tmp=tmp_path)
