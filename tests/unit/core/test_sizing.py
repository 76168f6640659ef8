"""Sizing: weights from the safetensors headers + KV cache + workspace against the GPU class's memory,
the smallest layout that fits when the spec leaves it unset, refusals with the numbers."""

import math

import pytest

from moe_core import sizing
from moe_core.checkpoint import classify, inspect_dir
from moe_core.gpu import from_name
from moe_operator.api import MoEDeploymentSpec
from moe_operator.inventory import build, node_info
from moe_operator.placement import place
from moe_operator.render import Owner, render
from moe_operator.sample_checkpoints import SAMPLES, write_full_size, write_sample

GiB = 1024 ** 3


def node(name, product, major, minor, gpus=8, memory_mib=None):
    labels = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.compute.major": str(major),
              "nvidia.com/gpu.compute.minor": str(minor), "nvidia.com/gpu.count": str(gpus), "kubernetes.io/arch": "amd64"}
    if memory_mib:
        labels["nvidia.com/gpu.memory"] = str(memory_mib)
    return {"metadata": {"name": name, "labels": labels},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "capacity": {"nvidia.com/gpu": str(gpus)},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


H200 = ("NVIDIA-H200", 9, 0, 143771)
L40S = ("NVIDIA-L40S", 8, 9, 46068)


def inventory(*pools):
    """pools: (product tuple, nodes, gpus per node)"""
    nodes = [node(f"{p[0].lower()}-{i}", p[0], p[1], p[2], gpus, p[3]) for p, n, gpus in pools for i in range(n)]
    return build([node_info(n) for n in nodes], {})


def spec(**kw):
    base = {"model": {"uri": "file:///models/dsv3"}, "engine": {"name": "sglang"}}
    base.update(kw)
    return MoEDeploymentSpec.model_validate(base)


@pytest.fixture(scope="module")
def dsv3_nvfp4(tmp_path_factory):
    """DeepSeek-V3 NVFP4 with every tensor of the real layout at its real shape (sparse file: no disk used)."""
    d = write_full_size("deepseek-v3-nvfp4", tmp_path_factory.mktemp("ck") / "dsv3")
    return inspect_dir(d)


def test_full_size_layout_reports_the_real_byte_count(dsv3_nvfp4):
    cfg = SAMPLES["deepseek-v3-nvfp4"]["config"]
    h, m, layers = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"] + 1  # + the MTP layer
    moe_layers = layers - cfg["first_k_dense_replace"]
    # routed experts: E2M1 pairs (0.5 B/param) + one F8 scale per 16 + two F32 scalars per projection
    routed = moe_layers * cfg["n_routed_experts"] * 3 * (h * m // 2 + h * m // 16 + 8)
    assert dsv3_nvfp4.format == "nvfp4" and dsv3_nvfp4.numLayers == 61
    assert routed < dsv3_nvfp4.totalBytes < routed * 1.15  # the rest (attention, embeddings, shared) is bf16
    assert 395e9 < dsv3_nvfp4.totalBytes < 420e9
    # the header-only sample of the same layout reports its few hundred bytes, not the real size
    assert inspect_dir(write_sample_tmp()).totalBytes < 10_000


def _runtime_rank_bytes(config, layout, fmt, tp, ep):
    """The bytes the bundled runtime's ShardPlan loads on its fullest rank (the rule of each tensor
    applied to its header size): what the estimate must match."""
    from moe_runtime.dist.layout import Layout
    from moe_runtime.dist.shard import ShardPlan
    from moe_operator.sample_checkpoints import _DT_BYTES

    def share(rule, shape, n):
        if rule is None:
            return n
        if rule == "skip":
            return 0
        if rule[0] == "all":
            for r in rule[1:]:
                n = share(r, shape, n)
            return n
        if len(shape) <= rule[1]:
            return n
        return n * (rule[3] - rule[2]) / shape[rule[1]] if rule[0] == "range" else n / rule[2]

    sizes = {k: (d, s, _DT_BYTES[d] * math.prod(s)) for k, (d, s) in layout.items()}
    return max(sum(share(ShardPlan(config, fmt, Layout(tp, ep, r)).rule(k), s, n) for k, (_, s, n) in sizes.items())
               for r in range(max(tp, ep)))


@pytest.mark.parametrize("name", ["deepseek-v3-nvfp4", "deepseek-v3-fp8"])
def test_weights_per_gpu_count_the_tensors_every_rank_holds_whole(name, tmp_path):
    """Not totalBytes / tp: norms, MLA q_a/kv_a projections and routers are on every rank. DeepSeek-V3
    NVFP4 at tp 8 (ep 8): 49.3 GiB per GPU (1.95 GiB whole + 378.8 / 8), where an even split says 47.6;
    equal, to the byte, to what the bundled runtime's ShardPlan loads on a rank, at tp 4, 8 and 16."""
    from moe_operator.sample_checkpoints import FULL_SIZE, deepseek_v3_layout
    ck = inspect_dir(write_full_size(name, tmp_path / "c"))
    cfg = SAMPLES[name]["config"]
    layers = cfg["num_hidden_layers"] + 1
    h, q, kv = cfg["hidden_size"], cfg.get("q_lora_rank", 1536), cfg["kv_lora_rank"] + cfg.get("qk_rope_head_dim", 64)
    moe_layers = layers - cfg["first_k_dense_replace"]
    norms = layers * (2 * h + q + cfg["kv_lora_rank"]) * 2 + h * 2  # per layer 2 + q_a/kv_a norms; model.norm
    routers = moe_layers * (cfg["n_routed_experts"] * h * 2 + cfg["n_routed_experts"] * 4)
    assert ck.replicatedBytes == layers * (q * h + kv * h) * 2 + norms + routers
    assert ck.kvHeadBytes == 0  # MLA: no k_proj/v_proj
    layout = deepseek_v3_layout(cfg, FULL_SIZE[name])
    for gpus in (4, 8, 16):
        w, whole = sizing.weights_per_gpu(ck, gpus)
        assert whole == ck.replicatedBytes
        assert abs(w - _runtime_rank_bytes(cfg, layout, FULL_SIZE[name], gpus, gpus)) <= gpus
    if name == "deepseek-v3-nvfp4":
        assert f"{ck.totalBytes / GiB:.1f}" == "380.8" and f"{ck.totalBytes / 8 / GiB:.1f}" == "47.6"
        assert f"{ck.replicatedBytes / GiB:.2f}" == "1.95"
        f = sizing.estimate(ck, 143771 * 1024 ** 2, 8)
        assert f"{f.weights / GiB:.1f}" == "49.3" and f.replicated == ck.replicatedBytes
        assert "per GPU 49.3 GiB weights (incl. 2.0 GiB every GPU holds whole)" in f.numbers()
        assert sizing.estimate(ck, 143771 * 1024 ** 2, 1).weights == ck.totalBytes  # one GPU holds it all


def test_tp_placement_by_tensor_name_and_gqa_kv_heads():
    from moe_core.checkpoint import CheckpointInfo, tp_placement
    whole = ["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.3.self_attn.q_a_proj.weight",
             "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.layers.3.self_attn.kv_a_layernorm.weight",
             "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
             "model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.mlp.router.weight",
             "model.layers.0.mlp.router.bias", "model.layers.0.self_attn.q_norm.weight", "model.layers.61.eh_proj.weight",
             "model.layers.61.enorm.weight", "model.layers.0.mlp.shared_expert_gate.weight",
             "model.layers.0.self_attn.o_proj.bias"]
    split = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.3.self_attn.q_b_proj.weight",
             "model.layers.3.self_attn.kv_b_proj.weight", "model.layers.3.self_attn.o_proj.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.layers.3.mlp.shared_experts.down_proj.weight",
             "model.layers.3.mlp.experts.7.up_proj.weight_scale", "model.layers.3.mlp.experts.7.up_proj.weight_scale_2",
             "model.layers.0.mlp.experts.gate_up_proj_blocks", "model.layers.0.self_attn.sinks",
             "model.layers.0.self_attn.q_proj.weight"]
    assert [n for n in whole if tp_placement(n) != "whole"] == []
    assert [n for n in split if tp_placement(n) != "split"] == []
    assert tp_placement("model.layers.0.self_attn.k_proj.weight") == "kv-heads"
    assert tp_placement("model.layers.0.self_attn.v_proj.bias") == "kv-heads"
    # GQA with 4 KV heads: k/v projections split 4 ways at most (each rank of tp 8 reads one head's rows)
    gqa = CheckpointInfo(architecture="Qwen3MoeForCausalLM", format="bf16", formatSource="t", numKeyValueHeads=4,
                         totalBytes=8000 + 800 + 100, kvHeadBytes=800, replicatedBytes=100)
    assert sizing.weights_per_gpu(gqa, 8) == (100 + 200 + 1000, 100)
    assert sizing.weights_per_gpu(gqa, 2) == (100 + 400 + 4000, 100)
    # an inspection from before these fields (0, 0): the even split as before
    old = CheckpointInfo(architecture="X", format="bf16", formatSource="t", totalBytes=801)
    assert sizing.weights_per_gpu(old, 8) == (101, 0)


def write_sample_tmp():
    import tempfile
    return write_sample("deepseek-v3-nvfp4", tempfile.mkdtemp() + "/s")


def test_kv_per_token_mla_is_not_split_by_tp_gqa_is_until_the_kv_heads_run_out():
    mla = classify(SAMPLES["deepseek-v3-nvfp4"]["config"], None, [])
    assert mla.kvLoraRank == 512 and mla.qkRopeHeadDim == 64 and mla.kvCacheFp8
    assert sizing.kv_per_token(mla, 1).per_token_per_gpu == 61 * (512 + 64) * 1
    assert sizing.kv_per_token(mla, 8).per_token_per_gpu == 61 * (512 + 64) * 1
    qwen = classify({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 94,
                     "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128}, None, [])
    assert sizing.kv_per_token(qwen, 1).per_token_per_gpu == 94 * 2 * 4 * 128 * 2
    assert sizing.kv_per_token(qwen, 2).per_token_per_gpu == 94 * 2 * 2 * 128 * 2
    assert sizing.kv_per_token(qwen, 8).per_token_per_gpu == 94 * 2 * 1 * 128 * 2  # 4 KV heads replicated over 8 ranks
    mha = classify({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                    "num_attention_heads": 32, "num_key_value_heads": 8}, None, [])
    assert mha.headDim == 128 and any("head_dim" in n for n in mha.notes)  # hidden / heads, said so


def test_dsv3_nvfp4_unset_layout_is_sized_onto_h200_with_bytes(dsv3_nvfp4):
    s = spec()
    assert not s.layout_given()
    p = place(s, dsv3_nvfp4, inventory((H200, 2, 8)))
    assert p.ok, p.rejected
    d = p.plan.decisions[0]
    assert (d.key, d.value, d.rule) == ("layout.tp", "4", "Z1")
    assert "380.8 GiB of weights" in d.reason and "96.7 GiB weights (incl. 2.0 GiB every GPU holds whole)" in d.reason and "tp=2 would need" in d.reason
    assert p.plan.layout.tp == 4 and p.plan.layout.nodes == 1
    assert p.spec.gpus_per_node() == 4 and p.spec.parallelism.tp == 4
    assert p.plan.args[p.plan.args.index("--tp-size") + 1] == "4"
    objs = render(Owner("dsv3", "ns", "uid"), p.spec, p.plan, p.inventory.gpu_class)
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_too_small_class_is_refused_with_the_numbers_and_listed_beside_the_chosen_one(dsv3_nvfp4):
    p = place(spec(engine={"name": "vllm"}), dsv3_nvfp4, inventory((L40S, 1, 8)))
    assert not p.ok
    why = p.rejected["sm89/NVIDIA-L40S"]
    assert why.startswith("[Z1] does not fit even on 8 GPUs (tp=8)") and "49.3 GiB weights" in why
    assert "> 40.5 GiB usable (90% of 45.0 GiB)" in why and "one node of this class" in why
    # the bundled runtime's replica is what moe_core.runtime says it runs (tensor/expert parallel on one
    # node since issue 19): sized like the other engines, within BUNDLED.max_tp, and --tp/--ep reach the pod
    from moe_core.runtime import BUNDLED
    b = place(spec(engine={"name": "bundled"}), dsv3_nvfp4, inventory((H200, 1, 8)))
    assert b.ok and 1 < b.plan.layout.tp <= BUNDLED.max_tp and b.plan.layout.nodes == 1
    assert b.plan.args[b.plan.args.index("--tp") + 1] == str(b.plan.layout.tp)
    one = place(spec(engine={"name": "bundled"}), dsv3_nvfp4, inventory((H200, 1, 2)))  # 2 GPUs cannot hold it
    assert not one.ok and "the bundled runtime serves at most" in one.rejected["sm90/NVIDIA-H200"]
    both = place(spec(), dsv3_nvfp4, inventory((H200, 1, 8), (L40S, 1, 8)))
    assert both.ok and both.inventory.gpu_class.product == "NVIDIA-H200" and "sm89/NVIDIA-L40S" in both.rejected


def test_multi_node_when_one_node_is_not_enough(dsv3_nvfp4):
    p = place(spec(engine={"name": "vllm"}), dsv3_nvfp4, inventory((L40S, 3, 8)))
    assert p.ok, p.rejected
    assert p.plan.layout.model_dump() == {"tp": 16, "gpusPerNode": 8, "nodes": 2}
    assert p.spec.nodesPerReplica == 2
    kinds = [o["kind"] for o in render(Owner("dsv3", "ns", "uid"), p.spec, p.plan, p.inventory.gpu_class)]
    assert "LeaderWorkerSet" in kinds


def test_explicit_layout_is_checked_never_changed(dsv3_nvfp4):
    bad = place(spec(parallelism={"tp": 2}), dsv3_nvfp4, inventory((H200, 1, 8)))
    assert not bad.ok
    msg = bad.rejected["sm90/NVIDIA-H200"]
    assert msg.startswith("[Z2] tp=2 as given does not fit 380.8 GiB") and "191.4 GiB weights" in msg and "> 126.4 GiB" in msg
    ok = place(spec(gpusPerReplica=8), dsv3_nvfp4, inventory((H200, 1, 8)))
    assert ok.ok and ok.plan.decisions[0].rule == "user" and ok.plan.layout.tp == 8


def test_kv_for_long_context_and_concurrency_counts(dsv3_nvfp4):
    # 128k tokens x 32 sequences of MLA latent (35 KiB/token, the same on every rank): more GPUs cannot help
    p = place(spec(engine={"name": "sglang", "maxModelLen": 131072, "maxConcurrency": 32}), dsv3_nvfp4,
              inventory((H200, 1, 8)))
    assert not p.ok and "KV cache (4194304 tokens" in p.rejected["sm90/NVIDIA-H200"]
    p = place(spec(engine={"name": "sglang", "maxModelLen": 131072, "maxConcurrency": 8}), dsv3_nvfp4,
              inventory((H200, 1, 8)))
    assert p.ok and p.plan.layout.tp == 8  # 34.3 GiB of KV per GPU pushes it from 4 to 8
    assert "34.3 GiB KV cache (1048576 tokens" in p.plan.decisions[0].reason


def test_ep_must_divide_the_sized_tp(dsv3_nvfp4):
    p = place(spec(parallelism={"ep": 8}), dsv3_nvfp4, inventory((H200, 1, 8)))
    assert p.ok and p.plan.layout.tp == 8


def test_unknown_memory_or_size_keeps_the_old_default_with_a_warning(dsv3_nvfp4):
    p = place(spec(), dsv3_nvfp4, inventory((("NVIDIA-H200", 9, 0, None), 1, 8)))
    assert p.ok and p.plan.layout.tp == 1 and any("[Z0]" in w and "memory unknown" in w for w in p.plan.warnings)
    explicit = spec(model={"uri": "file:///models/dsv3", "format": "nvfp4", "architecture": "DeepseekV3ForCausalLM"})
    from moe_operator.inspection import from_explicit_format
    p = place(explicit, from_explicit_format(explicit), inventory((H200, 1, 8)))
    assert p.ok and any("checkpoint size unknown" in w for w in p.plan.warnings)


def test_crd_accepts_unset_tp_and_keeps_explicit_rules():
    import moe_operator.crd as crd
    import json
    schema = json.dumps(crd.crd())
    assert "!has(self.parallelism.tp) || self.parallelism.tp % self.parallelism.ep == 0" in schema
    spec_props = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "default" not in spec_props["parallelism"]["properties"]["tp"]
    assert spec_props["engine"]["properties"]["maxModelLen"]["type"] == "integer"


def test_gpu_memory_table_matches_cli_names():
    assert from_name("H200").memoryMiB == 143771 and sizing.memory_bytes(from_name("H200")) == 143771 * 1024 * 1024


@pytest.mark.parametrize("engine,flag", [("sglang", "--context-length"), ("vllm", "--max-model-len"),
                                         ("bundled", "--max-model-len")])
def test_the_engine_gets_the_max_model_len_sizing_used(dsv3_nvfp4, engine, flag, tmp_path):
    s = spec(engine={"name": engine, "maxModelLen": 65536})
    ck = dsv3_nvfp4 if engine != "bundled" else inspect_dir(write_sample("deepseek-v3-nvfp4", tmp_path / "s"))
    p = place(s, ck, inventory((H200, 1, 8)))
    assert p.ok, p.rejected
    assert "65536 tokens" in p.plan.decisions[0].reason
    dep = next(o for o in render(Owner("d", "ns", "u"), p.spec, p.plan, p.inventory.gpu_class) if o["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index(flag) + 1] == "65536"
    unset = next(o for o in render(Owner("d", "ns", "u"), spec(engine={"name": engine}), p.plan, p.inventory.gpu_class)
                 if o["kind"] == "Deployment")
    assert flag not in unset["spec"]["template"]["spec"]["containers"][0]["args"]


def test_plan_cli_sizes_the_layout_and_refuses_with_the_numbers(tmp_path_factory):
    import json
    import subprocess
    import sys
    from pathlib import Path
    exe = str(Path(sys.executable).parent / "moe-operator")
    d = write_full_size("deepseek-v3-nvfp4", tmp_path_factory.mktemp("cli") / "dsv3")
    r = subprocess.run([exe, "plan", "--checkpoint", str(d), "--gpu", "H200", "--engine", "sglang", "-o", "json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["layout"] == {"tp": 4, "gpusPerNode": 4, "nodes": 1} and "--tp-size" in p["args"]
    assert p["decisions"][0]["key"] == "layout.tp" and "380.8 GiB of weights" in p["decisions"][0]["reason"]
    r = subprocess.run([exe, "plan", "--checkpoint", str(d), "--gpu", "L40S", "--engine", "vllm"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ERROR   [Z1] does not fit even on 8 GPUs (tp=8)" in r.stdout and "> 40.5 GiB" in r.stdout
    r = subprocess.run([exe, "plan", "--checkpoint", str(d), "--gpu", "L40S", "--engine", "vllm", "--nodes", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "tp=16 (2 nodes x 8 GPUs)" in r.stdout
    r = subprocess.run([exe, "plan", "--checkpoint", str(d), "--gpu", "H200", "--engine", "sglang",
                        "--set", "parallelism.tp=2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "[Z2] tp=2 as given does not fit" in r.stdout
