"""gpt-oss on CUDA equals gpt-oss on CPU (fp32), on the writer's tiny bf16 and MXFP4 checkpoints:
- teacher-forced: a prefill chunk (torch paged attention on the GPU) then one-token decode steps
  (the Triton GQA decode kernel with attention sinks and the sliding window of 8, crossed by the
  48-token prompts), logits within 1e-3 of the CPU model's; the experts run the model's torch path
  with MXFP4 weights dequantized per routed expert on the GPU;
- the engine (chunked prefill, prefix reuse, batched decode): the same greedy tokens as on CPU.
Seed 6: the CPU model's smallest top-2 logit margin along these completions is 7.7e-3 (bf16) and
1.1e-2 (MXFP4), far above the fp32 CUDA/CPU differences, so equal tokens are expected.
"""

import pytest
import torch

SYSTEM = [(i * 37 + 11) % 500 + 3 for i in range(45)]
PROMPTS = [SYSTEM + [7, 8, 9], SYSTEM + [100, 101], [5, 6, 7]]


class _Loop:
    def call_soon_threadsafe(self, fn, *a):
        fn(*a)


class _Sink(list):
    def put_nowait(self, item):
        self.append(item)


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def ckpt(request, tmp_path_factory):
    from moe_runtime.checkpoint_writer import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp(f"gpt_oss-{request.param}"), "gpt_oss", request.param, "tiny", seed=6)


def _model(ckpt, device):
    from moe_runtime.loader import build_model, load_checkpoint

    ck = load_checkpoint(ckpt, device, torch.float32, log=lambda *a, **k: None)
    return build_model(ck, None, False)


def test_teacher_forced_logits_cuda_equal_cpu(ckpt):
    seq = PROMPTS[0] + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    n_prefill = len(PROMPTS[0])
    out = {}
    for device in ("cpu", "cuda"):
        m = _model(ckpt, device)
        m.allocate_kv(8, 16)
        table = torch.tensor([[5, 2, 7, 0, 3, 1, 6, 4]], device=device)
        logits = [m(torch.tensor([seq[:n_prefill]], device=device), torch.arange(n_prefill, device=device)[None],
                    table)[0]]
        for i in range(n_prefill, len(seq)):
            logits.append(m(torch.tensor([[seq[i]]], device=device), torch.tensor([[i]], device=device), table)[0])
        out[device] = torch.cat(logits).cpu()
    assert float((out["cuda"] - out["cpu"]).abs().max()) < 1e-3


def test_engine_on_cuda_equals_cpu(ckpt):
    from moe_runtime.engine import Engine, Finished, Request, SamplingParams

    def run(device):
        eng = Engine(_model(ckpt, device), device, max_batch=4, max_queue=8, max_len=128, stop_ids=set(),
                     block_size=16, kv_blocks=40, max_prefill_tokens=24)
        reqs = []
        for p in PROMPTS:
            reqs.append(Request(list(p), SamplingParams(max_tokens=20, ignore_eos=True), _Loop(), _Sink()))
            eng.submit(reqs[-1])
            while reqs[0].computed < len(PROMPTS[0]):  # the system prompt's blocks are computed first
                eng.step()
            eng.step()
        while eng.running or eng.waiting:
            eng.step()
        assert eng.kv.hit_tokens == 32  # the second prompt reused the system prompt's 2 full blocks of 16
        assert all(isinstance(r.out[-1], Finished) and r.out[-1].reason == "length" for r in reqs)
        return [list(r.out[:-1]) for r in reqs]

    assert run("cuda") == run("cpu")


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def ckpt64(request, tmp_path_factory):
    """The tiny checkpoint with intermediate 64: whole Triton MXFP4 scale groups (I/2 a multiple of 32)."""
    from moe_runtime.checkpoint_writer import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp(f"gpt_oss64-{request.param}"), "gpt_oss", request.param, "tiny",
                           seed=6, overrides={"intermediate_size": 64})


def _bf16_model(ckpt, factory):
    from moe_runtime.loader import build_model, load_checkpoint

    ck = load_checkpoint(ckpt, "cuda", torch.bfloat16, log=lambda *a, **k: None)
    return build_model(ck, factory, False)


def _teacher_forced(m, device):
    seq = PROMPTS[0] + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    n = len(PROMPTS[0])
    m.allocate_kv(8, 16)
    table = torch.tensor([[5, 2, 7, 0, 3, 1, 6, 4]], device=device)
    out = [m(torch.tensor([seq[:n]], device=device), torch.arange(n, device=device)[None], table)[0]]
    for i in range(n, len(seq)):
        out.append(m(torch.tensor([[seq[i]]], device=device), torch.tensor([[i]], device=device), table)[0])
    return torch.cat(out).float().cpu()


def test_triton_experts_no_farther_from_the_fp32_model_than_transformers_bf16_math(ckpt64):
    """The plan puts gpt-oss on Triton (moe_core.runtime: swiglu_oai with biases): its fp32 epilogues
    are not transformers' bf16 roundings, so the check is against the fp32 model. In bf16 the Triton
    experts must be at least as close to it as the transformers-exact torch path (within 1.5x)."""
    from moe_kernels.triton_moe import TritonExperts

    truth = _teacher_forced(_model(ckpt64, "cpu"), "cpu")
    tri = _bf16_model(ckpt64, TritonExperts)
    assert isinstance(tri.layers[0].mlp.experts, TritonExperts)
    ours = _teacher_forced(tri, "cuda")
    ref = _teacher_forced(_bf16_model(ckpt64, None), "cuda")
    scale = float(truth.abs().max())
    err_tri, err_ref = float((ours - truth).abs().max()) / scale, float((ref - truth).abs().max()) / scale
    print(f"gpt-oss {ckpt64.name}: rel err vs fp32, triton {err_tri:.2e}, transformers bf16 math {err_ref:.2e}")
    assert err_tri <= 1.5 * err_ref + 1e-3, (err_tri, err_ref)


def test_engine_captures_cuda_graphs_on_triton_experts(ckpt64):
    """gpt-oss decode under CUDA graphs (its capture failed on the torch path's host syncs): the
    graphs are captured and kept, and give the eager engine's greedy tokens."""
    from moe_kernels.triton_moe import TritonExperts
    from moe_runtime.engine import Engine, Finished, Request, SamplingParams

    def run(graphs):
        eng = Engine(_bf16_model(ckpt64, TritonExperts), "cuda", max_batch=4, max_queue=8, max_len=128,
                     stop_ids=set(), block_size=16, kv_blocks=40, max_prefill_tokens=64, cuda_graphs=graphs)
        reqs = [Request(list(p), SamplingParams(max_tokens=20, ignore_eos=True), _Loop(), _Sink()) for p in PROMPTS]
        for r in reqs:
            eng.submit(r)
        while eng.running or eng.waiting:
            eng.step()
        assert all(isinstance(r.out[-1], Finished) for r in reqs)
        if graphs:
            assert eng.decoder is not None, "CUDA graph capture fell back to eager"
        return [list(r.out[:-1]) for r in reqs]

    assert run(True) == run(False)
