"""Placement sizes tp with the engines' own MoE split checks (planner.split_refusal, the predicate of the
planner's K40 and WK40 rows): a layout that fits memory but whose split the chosen engine version refuses
is passed over for the next one that fits, and the reason says so; when every layout that fits is refused
the class is rejected with the refusal and what works instead."""

from moe_core import sizing
from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import from_name
from moe_operator.api import MoEDeploymentSpec
from moe_operator.inventory import build, node_info
from moe_operator.placement import place
from moe_operator.planner import Choices, moe_split_refusal, plan, split_refusal

H200 = ("NVIDIA-H200", 9, 0, 143771)
L40S = ("NVIDIA-L40S", 8, 9, 46068)


def node(name, product, major, minor, gpus, memory_mib):
    labels = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.compute.major": str(major),
              "nvidia.com/gpu.compute.minor": str(minor), "nvidia.com/gpu.count": str(gpus),
              "kubernetes.io/arch": "amd64", "nvidia.com/gpu.memory": str(memory_mib)}
    return {"metadata": {"name": name, "labels": labels},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "capacity": {"nvidia.com/gpu": str(gpus)},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def inventory(*pools):
    nodes = [node(f"{p[0].lower()}-{i}", p[0], p[1], p[2], gpus, p[3]) for p, n, gpus in pools for i in range(n)]
    return build([node_info(n) for n in nodes], {})


def spec(engine="sglang", version=None, **kw):
    eng = {"name": engine, **({"version": version} if version else {})}
    return MoEDeploymentSpec.model_validate({"model": {"uri": "file:///models/qwen3-235b-fp8"}, "engine": eng, **kw})


# Qwen/Qwen3-235B-A22B-FP8 config.json: hidden_size 4096, moe_intermediate_size 1536, 128 experts (8 per token),
# 94 layers, 64 attention heads, 4 KV heads, head_dim 128, max_position_embeddings 40960,
# quantization_config {"quant_method": "fp8", "weight_block_size": [128, 128]}; about 236 GB of safetensors.
QWEN3_235B_FP8 = CheckpointInfo(
    architecture="Qwen3MoeForCausalLM", modelType="qwen3_moe", format="fp8", formatSource="config.json",
    quantMethod="fp8", numExperts=128, expertsPerToken=8, numSharedExperts=0, hiddenSize=4096,
    moeIntermediateSize=1536, weightBlockSize=[128, 128], numLayers=94, numAttentionHeads=64, numKeyValueHeads=4,
    headDim=128, maxPositionEmbeddings=40960, totalBytes=236_000_000_000)


def test_sglang_tp8_fits_l40s_but_k40_refuses_it_so_the_class_is_rejected_with_what_works():
    """On 48 GB L40S nodes tp=4 does not fit (55 GiB of weights per GPU) and tp=8 does, but 1536 / 8 = 192 is not a
    multiple of the 128 weight block: check_quantized_moe_compatibility raises (moe_ep_setup.py:166-176, sglang
    0.5.23). tp=16 (two nodes, 96 per rank) is refused too. Before: the class was rejected with the planner's
    error for tp=8 only; now the reason says tp=8 is the smallest that fits, that sglang refuses every layout that
    fits, and what works (expert parallelism with tp 8)."""
    p = place(spec(), QWEN3_235B_FP8, inventory((L40S, 2, 8)))
    assert not p.ok
    why = p.rejected["sm89/NVIDIA-L40S"]
    assert why.startswith("[Z1] tp=8 (8 GPUs) is the smallest layout that fits") and "as are the larger layouts that fit, tp=16" in why
    assert "[K40] sglang 0.5.23 refuses this layout at start-up" in why and "moe_tp_size=8" in why
    assert "weight_block_size_n=128" in why and "Works instead: parallelism.ep 2, 4, 8 with tp 8" in why
    # what it says works does: ep 2 makes moe_tp_size 4 (384 = 3 x 128); the sized tp stays 8
    ok = place(spec(parallelism={"ep": 2}), QWEN3_235B_FP8, inventory((L40S, 2, 8)))
    assert ok.ok, ok.rejected
    assert ok.plan.layout.tp == 8 and "passed over" not in ok.plan.decisions[0].reason


def test_the_class_whose_smallest_fit_the_engine_accepts_is_chosen_and_the_other_says_why_not():
    p = place(spec(), QWEN3_235B_FP8, inventory((L40S, 1, 8), (H200, 1, 8)))
    assert p.ok, p.rejected
    # H200: tp=2 fits (110 GiB per GPU) and 1536 / 2 = 768 = 6 x 128
    assert p.inventory.gpu_class.product == "NVIDIA-H200" and p.plan.layout.tp == 2
    assert "[K40]" in p.rejected["sm89/NVIDIA-L40S"]


def test_vllm_refines_the_same_split_so_tp8_is_placed():
    """vLLM 0.33.0 refines the 192-wide shard to gcd(128, 128, 192, 4096) = 64 >= 32 blocks (oracle/fp8.py:292-321):
    WK40 does not refuse it, so placement keeps tp=8 on L40S."""
    p = place(spec("vllm"), QWEN3_235B_FP8, inventory((L40S, 1, 8)))
    assert p.ok, p.rejected
    assert p.plan.layout.tp == 8 and not [e for e in p.plan.errors if "WK40" in e]


def test_split_refusal_is_the_planners_row():
    """One source of truth: placement's predicate gives exactly the K40 / WK40 text plan() reports."""
    g = from_name("L40S")
    for engine, tp, ep in (("sglang", 8, 1), ("sglang", 8, 2), ("sglang", 16, 1), ("vllm", 8, 1), ("vllm", 32, 1),
                           ("bundled", 8, 1)):
        c = Choices(tp=tp, ep=ep)
        rows = [e for e in plan(QWEN3_235B_FP8, g, c, engine=engine).errors if e.startswith(("[K40]", "[WK40]"))]
        assert split_refusal(QWEN3_235B_FP8, g, c, engine) == (rows[0] if rows else None), (engine, tp, ep)
    assert split_refusal(QWEN3_235B_FP8, g, Choices(tp=32), "vllm").startswith("[WK40]")  # 48 per rank: gcd 16
    # an explicit vLLM backend pads the shard instead (pad_tp_shard_to_weight_blocks, oracle/fp8.py:324-352)
    assert split_refusal(QWEN3_235B_FP8, g, Choices(tp=32, runner_backend="triton"), "vllm") is None
    assert moe_split_refusal.__doc__ and "K40" in moe_split_refusal.__doc__


def test_smallest_fit_passes_over_a_refused_layout_for_the_next_that_fits():
    """The mechanism in moe_core.sizing: a refused layout that fits is passed over and named in the reason."""
    g = from_name("L40S").model_copy(update={"memoryMiB": 46068})
    plain = sizing.smallest_fit(QWEN3_235B_FP8, g, 4, 3)
    assert plain.fit.gpus == 8 and plain.fit.nodes == 2
    c = sizing.smallest_fit(QWEN3_235B_FP8, g, 4, 3, refuses=lambda f: "refused (test)" if f.gpus == 8 else None)
    assert (c.fit.gpus, c.fit.nodes) == (12, 3)
    assert "tp=12 (3 nodes x 4 GPUs) is the smallest layout that fits" in c.reason and "that the engine accepts" in c.reason
    assert "passed over: tp=8 (2 nodes x 4 GPUs) fits but refused (test)" in c.reason
    none = sizing.smallest_fit(QWEN3_235B_FP8, g, 4, 3, refuses=lambda f: "refused (test)")
    assert none.fit is None and "tp=8 (2 nodes x 4 GPUs) is the smallest layout that fits" in none.reason
    assert "as are the larger layouts that fit, tp=12" in none.reason


def test_vllm_0221_refuses_what_0330_refines_so_the_l40s_class_is_rejected_there():
    """vLLM 0.22.1 has no block refinement: the 192-wide shard raises in Fp8MoEMethod.create_weights
    (quantization/fp8.py:636-640), so tp=8 on L40S is refused (WK40) and nothing larger that fits passes; with
    expert parallelism (MoE tp 1) it starts."""
    old = spec("vllm", "0.22.1")
    p = place(old, QWEN3_235B_FP8, inventory((L40S, 2, 8)))
    assert not p.ok
    why = p.rejected["sm89/NVIDIA-L40S"]
    assert why.startswith("[Z1] tp=8 (8 GPUs) is the smallest layout that fits") and "[WK40] vLLM 0.22.1" in why
    assert "Works instead: parallelism.ep 8 (--enable-expert-parallel)" in why
    ep = place(spec("vllm", "0.22.1", parallelism={"ep": 8}), QWEN3_235B_FP8,
               inventory((L40S, 2, 8)))
    assert ep.ok and ep.plan.layout.tp == 8, ep.rejected


def test_a_layout_past_the_refused_one_is_checked_too_attention_heads_k41():
    """Four-GPU L40S nodes: tp=8 (2 nodes) fits and is refused (K40, 192 per rank); the next layout that fits,
    tp=12 (3 nodes x 4), passes K40 (1536 / 12 = 128) but Qwen3MoeAttention.__init__ asserts 64 heads % 12
    (srt/models/qwen3_moe.py:506, sglang 0.5.23): K41 refuses it too, so placement does not land on it."""
    p = place(spec(), QWEN3_235B_FP8, inventory((L40S, 3, 4)))
    assert not p.ok
    why = p.rejected["sm89/NVIDIA-L40S"]
    assert why.startswith("[Z1] tp=8 (2 nodes x 4 GPUs) is the smallest layout that fits") and "tp=12" in why
    g = from_name("L40S")
    k41 = split_refusal(QWEN3_235B_FP8, g, Choices(tp=12, nodes=3), "sglang")
    assert k41.startswith("[K41]") and "64 attention heads % 12" in k41 and "qwen3_moe.py:506-516" in k41
    wk41 = split_refusal(QWEN3_235B_FP8, g, Choices(tp=12, nodes=3), "vllm")
    assert wk41.startswith("[WK41]") and "Total number of attention heads (64) must be divisible by tensor parallel " \
                                         "size (12)." in wk41 and "Works instead: tp 8, 16, 32, 64 (left out: tp 1, 2, 4, whose weights do " \
                                         "not fit sm89 (NVIDIA-L40S)" in wk41  # the weights need tp >= 8 on 48 GiB


def test_plan_cli_sizes_with_the_engine_version_and_backend_it_plans_with(monkeypatch, capsys, tmp_path):
    """`moe-operator plan` sizes with the same predicate as the operator, for the --engine-version and --set values
    of its plan: vLLM 0.22.1 refuses Qwen3-235B-A22B-FP8 at tp 8 on L40S (exit 2, WK40 with what works), 0.33.0
    places it at tp 8."""
    import argparse

    import moe_core.checkpoint
    from moe_operator import plan_cli
    monkeypatch.setattr(moe_core.checkpoint, "inspect_dir", lambda path: QWEN3_235B_FP8)

    def run(*extra):
        ap = argparse.ArgumentParser()
        plan_cli.add_arguments(ap)
        rc = plan_cli.run(ap.parse_args(["--checkpoint", str(tmp_path), "--gpu", "L40S", "--engine", "vllm", *extra]))
        return rc, capsys.readouterr().out

    rc, out = run("--engine-version", "0.22.1")
    assert rc == 2 and "[Z1] tp=8 (8 GPUs) is the smallest layout that fits" in out and "[WK40] vLLM 0.22.1" in out
    rc, out = run("--engine-version", "0.33.0")
    assert rc == 0 and "tp=8 (8 GPUs) is the smallest layout that fits" in out
    rc, out = run("--engine-version", "0.22.1", "--set", "parallelism.ep=8")
    assert rc == 0, out
