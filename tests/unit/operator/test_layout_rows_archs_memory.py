"""K41 for the architectures added from sglang's model files (0.5.23 lines; the same asserts in every release read,
0.5.10-0.5.23), and the memory filter of the K40/WK40/K41/WK41 "works instead" tp lists."""

from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import from_name
from moe_operator.planner import Choices, plan

H200 = from_name("H200")
NO_MEMORY = H200.model_copy(update={"memoryMiB": None})

# meta-llama/Llama-4-Scout-17B-16E: text_config 40 heads, 8 KV heads, head_dim 128; about 218 GB bf16
LLAMA4 = CheckpointInfo(architecture="Llama4ForConditionalGeneration", modelType="llama4", format="bf16",
                        formatSource="test", numExperts=16, expertsPerToken=1, hiddenSize=5120, numLayers=48,
                        numAttentionHeads=40, numKeyValueHeads=8, headDim=128, totalBytes=218_000_000_000)
# Qwen/Qwen3-Next-80B-A3B: 16 heads, 2 KV heads, head_dim 256; about 163 GB bf16
QWEN3_NEXT = CheckpointInfo(architecture="Qwen3NextForCausalLM", modelType="qwen3_next", format="bf16",
                            formatSource="test", numExperts=512, expertsPerToken=10, hiddenSize=2048, numLayers=48,
                            numAttentionHeads=16, numKeyValueHeads=2, headDim=256, totalBytes=163_000_000_000)
# moonshotai/Kimi-K2.5: text_config is DeepSeek-V3's (64 heads, MLA kv_lora_rank 512); about 595 GB
KIMI_K25 = CheckpointInfo(architecture="KimiK25ForConditionalGeneration", modelType="kimi_k25", format="bf16",
                          formatSource="test", numExperts=384, expertsPerToken=8, numSharedExperts=1, hiddenSize=7168,
                          numLayers=61, numAttentionHeads=64, numKeyValueHeads=64, kvLoraRank=512, qkRopeHeadDim=64,
                          totalBytes=595_000_000_000)


def _err(ck, gpu, choices, engine, tag):
    return [e for e in plan(ck, gpu, choices, engine=engine).errors if e.startswith(tag)]


def test_llama4_attention_asserts_heads_split_k41():
    """Llama4Attention.__init__ asserts total_num_heads % attn_tp_size == 0 and the KV split or replication
    (srt/models/llama4.py:224-234, 0.5.23; :221 in 0.5.10); Llama4ForConditionalGeneration builds Llama4ForCausalLM
    (mllama4.py:496; :477 in 0.5.10)."""
    [err] = _err(LLAMA4, H200, Choices(tp=16), "sglang", "[K41]")
    assert "Llama4Attention.__init__" in err and "40 attention heads % 16" in err and "llama4.py:224-234" in err
    assert "Works instead: tp 2, 4, 8 (left out: tp 1, whose weights do not fit sm90 (NVIDIA-H200)" in err
    assert not _err(LLAMA4, H200, Choices(tp=8), "sglang", "[K41]")
    [err] = _err(LLAMA4.model_copy(update={"architecture": "Llama4ForCausalLM"}), H200, Choices(tp=16), "sglang", "[K41]")
    assert "llama4.py:224-234" in err


def test_qwen3_next_full_attention_asserts_heads_split_k41():
    """Qwen3HybridAttentionDecoderLayer.__init__ asserts total_num_heads % attn_tp_size == 0 and the KV split or
    replication (srt/models/qwen3_next.py:624-634, 0.5.23; :538 in 0.5.10): 16 heads do not split over 32."""
    [err] = _err(QWEN3_NEXT, H200, Choices(tp=32), "sglang", "[K41]")
    assert "Qwen3HybridAttentionDecoderLayer.__init__" in err and "16 attention heads % 32" in err
    assert "qwen3_next.py:624-634" in err and "Works instead: tp 2, 4, 8, 16 (left out: tp 1" in err
    assert not _err(QWEN3_NEXT, H200, Choices(tp=8), "sglang", "[K41]")  # 2 KV heads replicate 4 times


def test_kimi_k25_is_deepseek_v3_mla_k41():
    """KimiK25ForConditionalGeneration's language model is sglang's DeepseekV3ForCausalLM (kimi_k25.py:693, 0.5.23),
    whose DeepseekV2AttentionMLA.__init__ asserts num_heads % attn_tp_size == 0 (deepseek_v2.py:2057); with dp
    attention the group is tp / dp."""
    [err] = _err(KIMI_K25, H200, Choices(tp=12), "sglang", "[K41]")
    assert "DeepseekV2AttentionMLA.__init__" in err and "64 attention heads % 12" in err and "kimi_k25.py:693" in err
    assert "Works instead: tp 8, 16, 32, 64 (left out: tp 1, 2, 4, whose weights do not fit" in err
    assert not _err(KIMI_K25, H200, Choices(tp=8), "sglang", "[K41]")
    assert not _err(KIMI_K25, H200, Choices(tp=16, dp=4, ep=16), "sglang", "[K41]")  # attn tp 4


def test_deepseek_v4_is_not_judged_by_k41():
    """MqaAttentionBase.__init__ floor-divides n_heads by attn_tp_size with no assert (deepseek_v4.py:1035-1037,
    0.5.23): no start-up refusal is proven, so K41 says nothing (vLLM's WK41 is the generic config check)."""
    ck = CheckpointInfo(architecture="DeepseekV4ForCausalLM", modelType="deepseek_v4", format="bf16",
                        formatSource="test", numExperts=64, numSharedExperts=1, hiddenSize=4096, numLayers=43,
                        numAttentionHeads=64, numKeyValueHeads=1, headDim=512)
    assert not _err(ck, H200, Choices(tp=12), "sglang", "[K41]")
    assert _err(ck, H200, Choices(tp=12), "vllm", "[WK41]")


def test_wk41_works_instead_leaves_out_what_does_not_fit_and_keeps_all_without_memory():
    [err] = _err(KIMI_K25, H200, Choices(tp=12), "vllm", "[WK41]")
    assert "Works instead: tp 8, 16, 32, 64 (left out: tp 1, 2, 4, whose weights do not fit sm90 (NVIDIA-H200): " \
           "tp 4 needs" in err
    [err] = _err(KIMI_K25, NO_MEMORY, Choices(tp=12), "vllm", "[WK41]")
    assert err.endswith("Works instead: tp 1, 2, 4, 8, 16, 32, 64.")
    [err] = _err(KIMI_K25.model_copy(update={"totalBytes": 0}), H200, Choices(tp=12), "vllm", "[WK41]")
    assert err.endswith("Works instead: tp 1, 2, 4, 8, 16, 32, 64.")


def test_k40_works_instead_leaves_out_tps_whose_weights_do_not_fit():
    """FusedMoE.__init__ asserts intermediate_size % moe_tp_size (layer.py:427, 0.5.23): 1000 does not split over 16;
    tp 1 and 2 split it but 470 GB of weights need more than 2 H200s."""
    ck = CheckpointInfo(architecture="Qwen3MoeForCausalLM", format="bf16", formatSource="test", numExperts=128,
                        moeIntermediateSize=1000, hiddenSize=4096, totalBytes=470_000_000_000)
    [err] = _err(ck, H200, Choices(tp=16), "sglang", "[K40]")
    assert "tp 4, 8 with ep 1 (left out: tp 1, 2, whose weights do not fit sm90 (NVIDIA-H200): tp 2 needs" in err
    assert "parallelism.ep" in err  # the ep alternatives keep tp 16: memory per GPU unchanged
    [err] = _err(ck, NO_MEMORY, Choices(tp=16), "sglang", "[K40]")
    assert "tp 1, 2, 4, 8 with ep 1." in err and "left out" not in err


def test_wk40_works_instead_leaves_out_tps_whose_weights_do_not_fit():
    """vLLM 0.33.0 refuses a 48-wide block-FP8 shard (fused_moe/oracle/fp8.py:292-395); of the tps that split,
    tp 1 cannot hold 236 GB of weights on one H200."""
    ck = CheckpointInfo(architecture="Qwen3MoeForCausalLM", modelType="qwen3_moe", format="fp8",
                        formatSource="config.json", quantMethod="fp8", numExperts=128, expertsPerToken=8,
                        hiddenSize=4096, moeIntermediateSize=1536, weightBlockSize=[128, 128], numLayers=94,
                        numAttentionHeads=64, numKeyValueHeads=4, headDim=128, totalBytes=236_000_000_000)
    [err] = _err(ck, H200, Choices(tp=32), "vllm", "[WK40]")
    assert "left out: tp 1, whose weights do not fit sm90 (NVIDIA-H200)" in err
    assert "tp 1," not in err.split("Works instead:")[1].split("(left out")[0]
    [err] = _err(ck, NO_MEMORY, Choices(tp=32), "vllm", "[WK40]")
    assert "left out" not in err


def test_wk41_cites_the_model_files_assert_in_vllm_0330():
    """vLLM 0.33.0's attention classes assert the head split too: Llama4Attention.__init__ (llama4.py:189-199),
    Qwen3NextAttention.__init__ (qwen3_next.py:296-306), DeepseekV2MLAAttention.__init__ (deepseek_v2.py:1041; Kimi-K2.5's
    language model, kimi_k25.py:376-380), DeepseekV4Attention.__init__ (vllm/models/deepseek_v4/attention.py:218)."""
    dsv4 = CheckpointInfo(architecture="DeepseekV4ForCausalLM", modelType="deepseek_v4", format="bf16",
                          formatSource="test", numExperts=64, numSharedExperts=1, numAttentionHeads=64,
                          numKeyValueHeads=1)
    for ck, tp, where in ((LLAMA4, 16, "llama4.py:189-199 Llama4Attention.__init__"),
                          (QWEN3_NEXT, 32, "qwen3_next.py:296-306 Qwen3NextAttention.__init__"),
                          (KIMI_K25, 12, "deepseek_v2.py:1041 DeepseekV2MLAAttention.__init__ (kimi_k25.py:376-380"),
                          (dsv4, 12, "models/deepseek_v4/attention.py:218 DeepseekV4Attention.__init__")):
        [err] = _err(ck, H200, Choices(tp=tp), "vllm", "[WK41]")
        assert "the model asserts it too: vllm/" in err and where in err, err
        [old] = [e for e in plan(ck, H200, Choices(tp=tp), engine="vllm", engine_version="0.22.1").errors
                 if e.startswith("[WK41]")]
        assert "the model asserts it too" not in old  # 0.22.1's model files were not read
