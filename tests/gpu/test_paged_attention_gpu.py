"""The Triton paged-attention decode kernels (moe_kernels.paged_attention) against their torch
reference on the GPU: GQA (Qwen3-MoE / gpt-oss shapes, with and without attention sinks and a
sliding window) and MLA (DeepSeek-V3's latent cache: kv_lora 512 + rope 64, 128 heads), bf16 and
fp32, block sizes 16 and 64, scattered block tables, ragged sequence lengths (1 token up to
several blocks, a length ending exactly on a block boundary); also under a CUDA graph with the
lengths changed between replays (the kernels read them on the device)."""

import pytest
import torch

from moe_kernels.paged_attention import (paged_attention_gqa_ref, paged_attention_mla_ref, paged_decode_gqa,
                                         paged_decode_mla)

pytest.importorskip("triton")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # of the reference's max |value|


def _tables(B, nb, NB, g):
    return torch.stack([torch.randperm(NB, generator=g)[:nb] for _ in range(B)]).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("heads,kv_heads,d,sinks,window", [(32, 4, 128, False, None), (64, 8, 64, True, None),
                                                           (64, 8, 64, True, 128), (4, 4, 24, False, None)])
def test_gqa_decode_matches_reference(dtype, bs, heads, kv_heads, d, sinks, window):
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([1, bs, bs + 1, 3 * bs - 5, 700, 129])
    B, nb = len(lens), -(-int(lens.max()) // bs)
    NB = B * nb + 3
    k = torch.randn(NB, bs, kv_heads, d, generator=g).to(dtype).cuda()
    v = torch.randn(NB, bs, kv_heads, d, generator=g).to(dtype).cuda()
    q = torch.randn(B, heads, d, generator=g).to(dtype).cuda()
    s = torch.randn(heads, generator=g).float().cuda() if sinks else None
    bt = _tables(B, nb, NB, g)
    lens = lens.cuda()
    ref = paged_attention_gqa_ref(q[:, None], k, v, bt, (lens - 1)[:, None], int(lens.max()), d ** -0.5, s, window)[:, 0]
    got = paged_decode_gqa(q, k, v, bt, lens, d ** -0.5, s, window)
    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("heads,C,R", [(128, 512, 64), (16, 256, 64), (4, 16, 8)])
def test_mla_decode_matches_reference(dtype, bs, heads, C, R):
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([1, bs, bs + 1, 3 * bs - 5, 600])
    B, nb = len(lens), -(-int(lens.max()) // bs)
    NB = B * nb + 2
    ckv = torch.randn(NB, bs, C, generator=g).to(dtype).cuda()
    kr = torch.randn(NB, bs, R, generator=g).to(dtype).cuda()
    qa = (torch.randn(B, heads, C, generator=g) / C ** 0.5).to(dtype).cuda()
    qr = torch.randn(B, heads, R, generator=g).to(dtype).cuda()
    bt = _tables(B, nb, NB, g)
    lens = lens.cuda()
    scale = 192 ** -0.5
    ref = paged_attention_mla_ref(qa[:, None], qr[:, None], ckv, kr, bt, (lens - 1)[:, None], int(lens.max()), scale)[:, 0]
    got = paged_decode_mla(qa, qr, ckv, kr, bt, lens, scale)
    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert err < TOL[dtype], err


def test_decode_kernels_replay_in_a_cuda_graph_with_new_lengths():
    g = torch.Generator().manual_seed(2)
    B, bs, nb, kvh, h, d = 4, 16, 8, 2, 8, 64
    NB = B * nb
    k = torch.randn(NB, bs, kvh, d, generator=g).bfloat16().cuda()
    v = torch.randn(NB, bs, kvh, d, generator=g).bfloat16().cuda()
    q = torch.randn(B, h, d, generator=g).bfloat16().cuda()
    bt = _tables(B, nb, NB, g)
    lens = torch.tensor([5, 16, 17, 100], device="cuda")
    paged_decode_gqa(q, k, v, bt, lens, 0.125)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_gqa(q, k, v, bt, lens, 0.125)
    for new in ([5, 16, 17, 100], [1, 128, 64, 33]):
        lens.copy_(torch.tensor(new))
        graph.replay()
        ref = paged_attention_gqa_ref(q[:, None], k, v, bt, (lens - 1)[:, None], int(lens.max()), 0.125)[:, 0]
        assert float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2


def test_engine_on_cuda_paged_decode_equals_cpu(tmp_path):
    """The whole engine on CUDA (Triton paged decode for MLA and GQA, chunked prefill, prefix reuse)
    gives the CPU engine's greedy tokens on tiny fp32 checkpoints of both architectures."""
    from moe_kernels.reference import TorchExperts
    from moe_runtime.checkpoint_writer import make_checkpoint
    from moe_runtime.engine import Engine, Finished, Request, SamplingParams
    from moe_runtime.loader import build_model, load_checkpoint

    class Loop:
        def call_soon_threadsafe(self, fn, *a):
            fn(*a)

    class Sink(list):
        def put_nowait(self, item):
            self.append(item)

    system = [(i * 37 + 11) % 500 + 3 for i in range(45)]
    prompts = [system + [7, 8, 9], system + [100, 101], [5, 6, 7]]

    def run(arch, device):
        ck = load_checkpoint(tmp_path / arch, device, torch.float32, log=lambda *a, **k: None)
        m = build_model(ck, lambda w: TorchExperts(w, torch.float32), False)
        eng = Engine(m, device, max_batch=4, max_queue=8, max_len=128, stop_ids=set(), block_size=16, kv_blocks=40,
                     max_prefill_tokens=24)
        reqs = []
        for p in prompts:
            reqs.append(Request(list(p), SamplingParams(max_tokens=20, ignore_eos=True), Loop(), Sink()))
            eng.submit(reqs[-1])
            while reqs[0].computed < len(prompts[0]):  # the system prompt's blocks are computed first
                eng.step()
            eng.step()
        while eng.running or eng.waiting:
            eng.step()
        assert eng.kv.hit_tokens == 32  # the second prompt reused the system prompt's 2 full blocks of 16
        assert all(isinstance(r.out[-1], Finished) and r.out[-1].reason == "length" for r in reqs)
        return [list(r.out[:-1]) for r in reqs]

    for arch in ("deepseek_v3", "qwen3_moe"):
        make_checkpoint(tmp_path / arch, arch, "bf16", size="tiny", seed=5)
        assert run(arch, "cuda") == run(arch, "cpu"), arch


@pytest.mark.parametrize("splits", [1, 3, 17])
@pytest.mark.parametrize("kind", ["mla128", "mla16", "gptoss", "gptoss-window", "qwen3"])
def test_split_kv_at_real_shapes(kind, splits):
    """Forced context-slice counts (1: the single-pass kernel; 3, 17: partials + reduce) at the real
    shapes, block size 16, 2k-token ragged contexts."""
    g = torch.Generator().manual_seed(3)
    bs, lens = 16, torch.tensor([2048, 1, 777, 1600])
    B, nb = len(lens), 128
    NB = B * nb + 5
    bt = _tables(B, nb, NB, g)
    pos = (lens - 1)[:, None].cuda()
    if kind.startswith("mla"):
        H = 128 if kind == "mla128" else 16
        ckv = torch.randn(NB, bs, 512, generator=g).bfloat16().cuda()
        kr = torch.randn(NB, bs, 64, generator=g).bfloat16().cuda()
        qa = (torch.randn(B, H, 512, generator=g) / 8).bfloat16().cuda()
        qr = torch.randn(B, H, 64, generator=g).bfloat16().cuda()
        ref = paged_attention_mla_ref(qa[:, None], qr[:, None], ckv, kr, bt, pos, 2048, 0.07)[:, 0]
        got = paged_decode_mla(qa, qr, ckv, kr, bt, lens.cuda(), 0.07, num_splits=splits)
    else:
        H, kvh, d = (64, 8, 64) if kind.startswith("gptoss") else (32, 4, 128)
        k = torch.randn(NB, bs, kvh, d, generator=g).bfloat16().cuda()
        v = torch.randn(NB, bs, kvh, d, generator=g).bfloat16().cuda()
        q = torch.randn(B, H, d, generator=g).bfloat16().cuda()
        s = torch.randn(H, generator=g).cuda() if kind.startswith("gptoss") else None
        win = 128 if kind == "gptoss-window" else None
        ref = paged_attention_gqa_ref(q[:, None], k, v, bt, pos, 2048, d ** -0.5, s, win)[:, 0]
        got = paged_decode_gqa(q, k, v, bt, lens.cuda(), d ** -0.5, s, win, num_splits=splits)
    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert err < 2e-2, err
