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


# ------------------------------------------------------------------------------------------------
# prefill / extend (moe_kernels.attention_prefill) and the FP8 cache

def _extend_batch(bs, g, starts=(0, 37, 48, 500), chunks=(300, 1, 64, 200)):
    """A right-padded batch: row i has `starts[i]` cached tokens and `chunks[i]` new ones (a cached
    prefix ending mid-block, one ending on a block boundary, plain prefill, a one-token chunk)."""
    starts, chunks = torch.tensor(starts), torch.tensor(chunks)
    B, S = len(starts), int(chunks.max())
    kv_len = int((starts + chunks).max())
    nb = -(-(kv_len + S) // bs)
    NB = B * nb + 3
    pos = (starts[:, None] + torch.arange(S)[None, :]).cuda()
    real = (torch.arange(S)[None, :] < chunks[:, None]).cuda()
    return B, S, kv_len, NB, _tables(B, nb, NB, g), pos, real


def _rel(got, ref, rows):
    got, ref = got.float()[rows], ref.float()[rows]
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("heads,kv_heads,d,sinks,window", [(32, 4, 128, False, None), (64, 8, 64, True, None),
                                                           (64, 8, 64, True, 128), (4, 4, 24, False, None)])
def test_gqa_prefill_matches_reference(dtype, bs, heads, kv_heads, d, sinks, window):
    from moe_kernels.paged_attention import paged_attention_gqa

    g = torch.Generator().manual_seed(4)
    B, S, kv_len, NB, bt, pos, real = _extend_batch(bs, g)
    k = torch.randn(NB, bs, kv_heads, d, generator=g).to(dtype).cuda()
    v = torch.randn(NB, bs, kv_heads, d, generator=g).to(dtype).cuda()
    q = torch.randn(B, S, heads, d, generator=g).to(dtype).cuda()
    s = torch.randn(heads, generator=g).float().cuda() if sinks else None
    ref = paged_attention_gqa_ref(q, k, v, bt, pos, kv_len, d ** -0.5, s, window)
    got = paged_attention_gqa(q, k, v, bt, pos, kv_len, d ** -0.5, s, window)
    assert torch.isfinite(got).all()
    assert _rel(got, ref, real) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,C,R", [(128, 512, 64), (16, 512, 64), (4, 16, 8)])
def test_mla_prefill_matches_reference(dtype, heads, C, R):
    from moe_kernels.paged_attention import paged_attention_mla

    g = torch.Generator().manual_seed(5)
    B, S, kv_len, NB, bt, pos, real = _extend_batch(16, g)
    ckv = torch.randn(NB, 16, C, generator=g).to(dtype).cuda()
    kr = torch.randn(NB, 16, R, generator=g).to(dtype).cuda()
    qa = (torch.randn(B, S, heads, C, generator=g) / C ** 0.5).to(dtype).cuda()
    qr = torch.randn(B, S, heads, R, generator=g).to(dtype).cuda()
    ref = paged_attention_mla_ref(qa, qr, ckv, kr, bt, pos, kv_len, 192 ** -0.5)
    got = paged_attention_mla(qa, qr, ckv, kr, bt, pos, kv_len, 192 ** -0.5)
    assert torch.isfinite(got).all()
    assert _rel(got, ref, real) < TOL[dtype]


@pytest.mark.parametrize("heads", [128, 16])
def test_mla_prefill_non_absorbed_matches_reference(heads):
    """DeepSeek-V3 dimensions (latent 512, nope 128, rope 64, v 128): the decompress-then-attend form
    against the absorbed reference followed by W_uv; a 300-token chunk picks it on its own."""
    from moe_kernels.attention_prefill import prefill_mla_mha
    from moe_kernels.paged_attention import paged_attention_mla_heads

    g = torch.Generator().manual_seed(6)
    B, S, kv_len, NB, bt, pos, real = _extend_batch(16, g)
    ckv = torch.randn(NB, 16, 512, generator=g).bfloat16().cuda()
    kr = torch.randn(NB, 16, 64, generator=g).bfloat16().cuda()
    w_uk = (torch.randn(heads, 128, 512, generator=g) / 512 ** 0.5).bfloat16().cuda()
    w_uv = (torch.randn(heads, 128, 512, generator=g) / 512 ** 0.5).bfloat16().cuda()
    qn = torch.randn(B, S, heads, 128, generator=g).bfloat16().cuda()
    qr = torch.randn(B, S, heads, 64, generator=g).bfloat16().cuda()
    lat = paged_attention_mla_ref(torch.einsum("bshd,hdc->bshc", qn, w_uk), qr, ckv, kr, bt, pos, kv_len, 192 ** -0.5)
    ref = torch.einsum("bshc,hvc->bshv", lat, w_uv)
    got = prefill_mla_mha(qn, qr, ckv, kr, w_uk, w_uv, bt, pos, kv_len, 192 ** -0.5)
    assert _rel(got, ref, real) < 2e-2
    assert _rel(paged_attention_mla_heads(qn, qr, ckv, kr, w_uk, w_uv, bt, pos, kv_len, 192 ** -0.5), ref, real) < 2e-2


@pytest.mark.parametrize("kind", ["gptoss", "qwen3", "mla128", "mla16"])
def test_fp8_cache_matches_fp8_reference_and_stays_near_bf16(kind):
    """An e4m3 cache with per-tensor scales: decode (1 and 5 context slices) and prefill against the
    reference on the same fp8 cache (tight), and against the bf16 cache (the quantization error)."""
    from moe_kernels import paged_attention as pa

    g = torch.Generator().manual_seed(7)
    B, S, kv_len, NB, bt, pos, real = _extend_batch(16, g)
    lens = (pos[:, 0] + real.sum(1)).int()
    dpos = (lens - 1)[:, None].long()
    errs = {}
    if kind.startswith("mla"):
        H = 128 if kind == "mla128" else 16
        ckv = torch.randn(NB, 16, 512, generator=g).bfloat16().cuda()
        kr = torch.randn(NB, 16, 64, generator=g).bfloat16().cuda()
        sc = 2.0 / 448 * 4  # |x| up to ~4 sigma uses e4m3's range
        c8, r8 = pa.quantize_fp8(ckv, sc), pa.quantize_fp8(kr, sc)
        qa = (torch.randn(B, S, H, 512, generator=g) / 512 ** 0.5).bfloat16().cuda()
        qr = torch.randn(B, S, H, 64, generator=g).bfloat16().cuda()
        args = (bt, pos, kv_len, 192 ** -0.5)
        ref8 = pa.paged_attention_mla_ref(qa, qr, c8, r8, *args, kv_scale=sc)
        ref16 = pa.paged_attention_mla_ref(qa, qr, ckv, kr, *args)
        errs["prefill"] = _rel(pa.paged_attention_mla(qa, qr, c8, r8, *args, kv_scale=sc), ref8, real)
        d8 = pa.paged_attention_mla_ref(qa[:, :1], qr[:, :1], c8, r8, bt, dpos, int(lens.max()), 192 ** -0.5, sc)[:, 0]
        for sp in (1, 5):
            got = pa.paged_decode_mla(qa[:, 0].contiguous(), qr[:, 0].contiguous(), c8, r8, bt, lens, 192 ** -0.5, sp,
                                      kv_scale=sc)
            errs[f"decode{sp}"] = float((got.float() - d8.float()).abs().max() / d8.float().abs().max())
    else:
        H, kvh, d = (64, 8, 64) if kind == "gptoss" else (32, 4, 128)
        k = torch.randn(NB, 16, kvh, d, generator=g).bfloat16().cuda()
        v = torch.randn(NB, 16, kvh, d, generator=g).bfloat16().cuda()
        ks, vs = 4.0 / 448, 4.0 / 448
        k8, v8 = pa.quantize_fp8(k, ks), pa.quantize_fp8(v, vs)
        q = torch.randn(B, S, H, d, generator=g).bfloat16().cuda()
        s = torch.randn(H, generator=g).cuda() if kind == "gptoss" else None
        ref8 = pa.paged_attention_gqa_ref(q, k8, v8, bt, pos, kv_len, d ** -0.5, s, None, ks, vs)
        ref16 = pa.paged_attention_gqa_ref(q, k, v, bt, pos, kv_len, d ** -0.5, s)
        errs["prefill"] = _rel(pa.paged_attention_gqa(q, k8, v8, bt, pos, kv_len, d ** -0.5, s, None, ks, vs), ref8, real)
        d8 = pa.paged_attention_gqa_ref(q[:, :1], k8, v8, bt, dpos, int(lens.max()), d ** -0.5, s, None, ks, vs)[:, 0]
        for sp in (1, 5):
            got = pa.paged_decode_gqa(q[:, 0].contiguous(), k8, v8, bt, lens, d ** -0.5, s, None, sp, ks, vs)
            errs[f"decode{sp}"] = float((got.float() - d8.float()).abs().max() / d8.float().abs().max())
    vs16 = _rel(ref8, ref16, real)
    print(kind, "fp8 vs bf16 (reference)", f"{vs16:.3e}", {k_: f"{e:.1e}" for k_, e in errs.items()})
    assert all(e < 2e-2 for e in errs.values()), errs
    assert 1e-3 < vs16 < 0.1, vs16


def test_fp8_write_kv_then_decode_in_a_cuda_graph():
    """write_kv's quantization and the fp8 decode kernel both replay in a CUDA graph (the runtime's decode)."""
    from moe_kernels import paged_attention as pa

    g = torch.Generator().manual_seed(8)
    B, bs, nb, kvh, h, d = 3, 16, 4, 2, 8, 64
    k = torch.zeros(B * nb, bs, kvh, d, dtype=pa.FP8, device="cuda")
    v = torch.zeros_like(k)
    bt = _tables(B, nb, B * nb, g)
    kf = torch.randn(B, nb * bs, kvh, d, generator=g).bfloat16().cuda()
    vf = torch.randn(B, nb * bs, kvh, d, generator=g).bfloat16().cuda()
    allpos = torch.arange(nb * bs, device="cuda")[None].expand(B, -1)
    pa.write_kv(k, pa.slot_mapping(bt, allpos, bs), kf, 0.02)
    pa.write_kv(v, pa.slot_mapping(bt, allpos, bs), vf, 0.02)
    q = torch.randn(B, h, d, generator=g).bfloat16().cuda()
    lens = torch.tensor([5, 40, 64], device="cuda")
    newk = torch.randn(B, 1, kvh, d, generator=g).bfloat16().cuda()
    slots = pa.slot_mapping(bt, (lens - 1)[:, None], bs)

    def step():
        pa.write_kv(k, slots, newk, 0.02)
        pa.write_kv(v, slots, newk, 0.02)
        return pa.paged_decode_gqa(q, k, v, bt, lens, 0.125, k_scale=0.02, v_scale=0.02)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    ref = pa.paged_attention_gqa_ref(q[:, None], k, v, bt, (lens - 1)[:, None], 64, 0.125, None, None, 0.02, 0.02)[:, 0]
    assert float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2
    got_new = k.view(-1, kvh, d)[slots.view(-1)].float() * 0.02
    assert float((got_new - newk[:, 0].float()).abs().max()) < 0.1 * float(newk.abs().max())
