"""Explicit sglang/vLLM MoE choices against the engines' own start-up checks (issue 16).

The matrix goes through `planner.plan` (what `moe-operator plan` and admission call). Each row's
expected outcome cites the upstream line it comes from (paths inside the released wheel, line
numbers of the version in the row unless stated). `ok` rows are choices the engine accepts.
Add rows with each engine release read (engine_rules.VERSIONS_READ).
"""

import dataclasses

import pytest

try:
    from moe_core.checkpoint import CheckpointInfo
    from moe_core.gpu import from_name
except ImportError:  # before the moe_core move
    from moe_operator.checkpoint import CheckpointInfo
    from moe_operator.gpu import from_name
from moe_operator import engine_rules
from moe_operator.engine_rules import Case, judge
from moe_operator.engines.sglang import startup as sg_rules
from moe_operator.engines.vllm import startup as vl_rules
from moe_operator.planner import Choices, auto_fallbacks, plan

DSV3, DSV4, GPTOSS, QWEN3, GLM4, MIXTRAL = ("DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "GptOssForCausalLM",
                                            "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "MixtralForCausalLM")
QM = {"fp8": "fp8", "ct_int4_g32": "compressed-tensors", "ct_nvfp4": "compressed-tensors", "mxfp4": "mxfp4",
      "nvfp4": "NVFP4", "dsv4_fp4": "fp8", "bf16": None}

# Qwen/Qwen3-235B-A22B-FP8 config.json shape (hidden 4096, moe_intermediate 1536, weight_block_size [128, 128],
# 64 attention heads, 4 KV heads)
_Q235 = dict(moeIntermediateSize=1536, hiddenSize=4096, weightBlockSize=[128, 128], numAttentionHeads=64, numKeyValueHeads=4)

# engine, version, gpu, fmt, arch, runner, a2a, (tp, ep, dp[, flashinfer[, shape]]), expected rule id or "ok", citation
MATRIX = [
    # ---- sglang 0.5.23: quantization methods (layer build) ----
    ("sglang", "0.5.23", "B200", "mxfp4", GPTOSS, "flashinfer_cutlass", "none", (1, 1, 1), "SG-MXFP4-RUNNER",
     "sglang/srt/layers/quantization/mxfp4.py:1474-1478 Mxfp4MoEMethod.create_moe_runner"),
    ("sglang", "0.5.23", "B200", "mxfp4", GPTOSS, "flashinfer_trtllm", "none", (1, 1, 1), "SG-MXFP4-RUNNER",
     "mxfp4.py:1457-1478: flashinfer_trtllm has no Mxfp4MoEMethod runner branch"),
    ("sglang", "0.5.23", "H200", "mxfp4", GPTOSS, "marlin", "none", (1, 1, 1), "ok",
     "mxfp4.py:650-655 MXFP4 Marlin on is_sm90"),
    ("sglang", "0.5.23", "A100", "mxfp4", GPTOSS, "marlin", "none", (1, 1, 1), "SG-MXFP4-MARLIN",
     "mxfp4.py:655 'MXFP4 Marlin requires SM90+.'"),
    ("sglang", "0.5.23", "MI300X", "mxfp4", GPTOSS, "triton", "none", (1, 1, 1), "SG-MXFP4-ROCM",
     "mxfp4.py:326-333 Mxfp4Config.from_config 'not support mxfp4 computation'"),
    ("sglang", "0.5.23", "B200", "mxfp4", GPTOSS, "flashinfer_mxfp4", "deepep", (8, 8, 1), "V2",
     "moe_runner/runner.py:176-180 + flashinfer_cutlass.py:451 only ('none', 'flashinfer_mxfp4') registered"),
    ("sglang", "0.5.23", "B200", "nvfp4", DSV3, "cutlass", "none", (1, 1, 1), "SG-NVFP4-CUTLASS",
     "sglang/srt/layers/quantization/modelopt_quant.py:3144-3148 ModelOptNvFp4FusedMoEMethod.create_moe_runner"),
    ("sglang", "0.5.23", "B200", "nvfp4", DSV3, "triton", "none", (1, 1, 1), "SG-NVFP4-RUNNER",
     "modelopt_quant.py:3366-3369 ModelOptNvFp4FusedMoEMethod.apply"),
    ("sglang", "0.5.23", "H200", "nvfp4", DSV3, "flashinfer_cutlass", "none", (1, 1, 1), "V7",
     "modelopt_quant.py:2382-2387 'Current platform does not support NVFP4 ... use moe_runner_backend=marlin'"),
    ("sglang", "0.5.23", "H200", "nvfp4", DSV3, "marlin", "none", (1, 1, 1), "ok",
     "modelopt_quant.py:2378-2381 use_marlin_fallback = moe_runner_backend.is_marlin()"),
    ("sglang", "0.5.23", "rtx-pro-6000", "nvfp4", QWEN3, "flashinfer_cutlass", "none", (1, 1, 1), "ok",
     "arg_groups/overrides.py:1518-1526 (the SM120 modelopt_fp4 default) and moe_hook.py:78-92 (quantization None)"),
    ("sglang", "0.5.23", "rtx-pro-6000", "nvfp4", QWEN3, "flashinfer_cutlass", "none", (8, 4, 1), "SG-FICUTLASS-EP",
     "sglang/srt/arg_groups/moe_hook.py:89-92 'The expert parallel size must be 1 or the same as the tensor parallel size'"),
    ("sglang", "0.5.23", "B200", "nvfp4", MIXTRAL, "flashinfer_cutedsl", "none", (1, 1, 1), "SG-CUTEDSL-Q",
     "moe_hook.py:94-101: quantization None (no Mixtral override resolves it) is not in the CuteDSL list"),
    ("sglang", "0.5.23", "B200", "nvfp4", DSV3, "flashinfer_cutedsl", "deepep", (8, 8, 1), "ok",
     "flashinfer_cutedsl.py:624 @register_fused_func('deepep', 'flashinfer_cutedsl')"),
    ("sglang", "0.5.23", "B200", "nvfp4", DSV3, "flashinfer_cutedsl", "mooncake", (8, 8, 1), "SG-CUTEDSL-A2A",
     "moe_hook.py:106-113 'flashinfer_cutedsl supports moe_a2a_backend=none, deepep, or flashinfer'"),
    ("sglang", "0.5.23", "B200", "fp8", DSV3, "flashinfer_cutlass", "none", (1, 1, 1), "K23",
     "moe_hook.py:78-88 with quantization='fp8' from overrides.py:788-809 (_deepseek_moe_quant_resolution on SM100)"),
    ("sglang", "0.5.23", "B200", "fp8", DSV3, "flashinfer_trtllm_routed", "none", (1, 1, 1), "ok",
     "moe_hook.py:140-152 'fp8' is in the routed list"),
    ("sglang", "0.5.23", "B200", "ct_int4_g32", DSV3, "flashinfer_trtllm_routed", "none", (1, 1, 1), "SG-ROUTED-Q",
     "moe_hook.py:140-152: 'compressed-tensors' (Kimi-K2 thinking int4) is not in the routed list"),
    ("sglang", "0.5.23", "B200", "ct_int4_g32", DSV3, "flashinfer_trtllm", "none", (1, 1, 1), "ok",
     "moe_hook.py:124-138: 'compressed-tensors' is in the TRT-LLM list"),
    ("sglang", "0.5.23", "A100", "fp8", DSV3, "cutlass", "none", (1, 1, 1), "SG-FP8-CUTLASS",
     "sglang/srt/layers/quantization/fp8.py:1513-1517 'cutlass_fp8 MoE requires SM90, SM100, or SM120 GPUs'"),
    ("sglang", "0.5.23", "B200", "dsv4_fp4", DSV4, "marlin", "none", (1, 1, 1), "SG-FP4EXPERT-MARLIN",
     "sglang/srt/layers/quantization/mxfp4_marlin_moe.py:160-161 'MXFP4 Marlin requires SM90 or SM120.'"),
    ("sglang", "0.5.23", "H200", "dsv4_fp4", DSV4, "marlin", "none", (1, 1, 1), "ok",
     "mxfp4_marlin_moe.py:160 is_sm90"),
    ("sglang", "0.5.23", "B200", "fp8", DSV3, "hpc_ops", "none", (1, 1, 1), "SG-HPCOPS-SM90",
     "sglang/srt/layers/moe/moe_runner/runner.py:150-158 'hpc_ops requires an SM90 (Hopper) GPU'"),
    ("sglang", "0.5.23", "H200", "bf16", QWEN3, "hpc_ops", "none", (1, 1, 1), "SG-HPCOPS-FP8",
     "runner.py:68-82 'hpc_ops only supports FP8 blockwise / per-tensor quantized MoE'"),
    ("sglang", "0.5.23", "H200", "fp8", QWEN3, "hpc_ops", "none", (1, 1, 1), "ok",
     "runner.py:68-82 / 150-158: FP8 on SM90"),
    # ---- sglang 0.5.23: A2A (handle_a2a_moe) ----
    ("sglang", "0.5.23", "H200", "fp8", QWEN3, "triton", "flashinfer", (8, 8, 8), "SG-FIA2A-RUNNER",
     "moe_hook.py:534-545 'FlashInfer MoE A2A is supported with flashinfer_cutlass, ... or deep_gemm'"),
    ("sglang", "0.5.23", "H200", "fp8", DSV3, "deep_gemm", "flashinfer", (8, 8, 8), "ok",
     "moe_hook.py:534-545 deep_gemm listed; deep_gemm.py:1211 pre-permute ('flashinfer', 'deep_gemm')"),
    ("sglang", "0.5.23", "H200", "fp8", DSV3, "triton", "deepep_v2", (8, 8, 1), "SG-DEEPEPV2-RUNNER",
     "moe_hook.py:404-419 'DeepEP v2 MoE currently supports only --moe-runner-backend deep_gemm'"),
    ("sglang", "0.5.23", "H200", "fp8", GLM4, "deep_gemm", "deepep_v2", (8, 8, 1), "SG-DEEPEPV2-ARCH",
     "moe_hook.py:719-731 + configs/moe_model_registry.py:20-28 (Glm4MoeForCausalLM not registered)"),
    ("sglang", "0.5.23", "H200", "fp8", DSV3, "deep_gemm", "deepep_v2", (8, 8, 1), "ok",
     "configs/moe_model_registry.py:21 DeepseekV3ForCausalLM registered"),
    ("sglang", "0.5.23", "B200", "nvfp4", DSV3, "auto", "deepep_v2", (8, 8, 1), "SG-DEEPEPV2-LAYER",
     "moe_hook.py:404-412 auto -> deep_gemm; modelopt_quant.py:3366-3369 NVFP4 has no deep_gemm path"),
    ("sglang", "0.5.23", "B200", "mxfp4", GPTOSS, "auto", "deepep_v2", (8, 8, 1), "SG-DEEPEPV2-ARCH",
     "configs/moe_model_registry.py:20-28 GptOssForCausalLM not registered (mxfp4.py:1466-1471 would build deep_gemm)"),
    ("sglang", "0.5.23", "H200", "fp8", DSV3, "deep_gemm", "pplx", (8, 8, 1), "SG-PPLX-DP",
     "moe_hook.py:588-595 'pplx requires attention DP with at least 2 groups'"),
    ("sglang", "0.5.23", "H200", "fp8", DSV3, "triton", "pplx", (8, 8, 8), "SG-PPLX-RUNNER",
     "moe_hook.py:596-602 'pplx is only supported with --moe-runner-backend deep_gemm (or auto)'"),
    ("sglang", "0.5.23", "H200", "fp8", DSV3, "auto", "flashinfer_megamoe", (8, 8, 8), "SG-MEGAMOE-SM100",
     "moe_hook.py:335-339 'FlashInfer MegaMOE currently requires an SM100-family CUDA device'"),
    ("sglang", "0.5.23", "B200", "fp8", DSV3, "flashinfer_megamoe", "flashinfer_megamoe", (8, 8, 8), "SG-MEGAMOE-Q",
     "moe_hook.py:264-281 'Standard FP8 MoE checkpoints are not supported'"),
    ("sglang", "0.5.23", "B200", "dsv4_fp4", DSV4, "flashinfer_megamoe", "flashinfer_megamoe", (8, 8, 8), "ok",
     "moe_hook.py:264-275 is_fp4_experts; :328-339 runner flashinfer_megamoe on SM100"),
    # ---- sglang 0.5.23: per-model override modules ----
    ("sglang", "0.5.23", "B200", "mixed_w4a16", "NemotronHForCausalLM", "flashinfer_trtllm", "none", (1, 1, 1),
     "SG-NEMOTRONH-W4A16-RUNNER", "arg_groups/model_overrides/nemotron_h.py:77-80 'require --moe-runner-backend=marlin'"),
    ("sglang", "0.5.23", "B200", "mixed_w4a16", "NemotronHForCausalLM", "marlin", "none", (1, 1, 1), "ok",
     "nemotron_h.py:77-80 marlin accepted"),
    ("sglang", "0.5.23", "B200", "mixed_w4a16", "NemotronHForCausalLM", "auto", "deepep", (8, 8, 1),
     "SG-NEMOTRONH-W4A16-A2A", "nemotron_h.py:74-76 'require --moe-a2a-backend=none'"),
    # ---- sglang 0.5.23: LoRA runners, DeepEPMoE ----
    ("sglang", "0.5.23", "H200", "fp8", DSV3, "lora_triton", "none", (1, 1, 1), "SG-LORA",
     "arg_groups/lora_hook.py:196-203 'requires --enable-lora (or --lora-paths)'"),
    ("sglang", "0.5.23", "A100", "fp8", DSV3, "auto", "deepep", (8, 8, 1), "SG-DEEPEP-DEEPGEMM",
     "layers/moe/ep_moe/layer.py:166-177 'DeepEP ... mode requires deep_gemm' (JIT DeepGEMM off below SM90)"),
    ("sglang", "0.5.23", "H200", "fp8", DSV3, "auto", "deepep", (8, 8, 1), "ok",
     "ep_moe/layer.py:166-177 DeepGEMM JIT on SM90; fp8.py:1519-1541 auto -> deep_gemm"),
    ("sglang", "0.5.23", "H200", "ct_int4_g32", DSV3, "deep_gemm", "deepep", (8, 8, 1), "SG-DEEPEP-LEGACY",
     "ep_moe/layer.py:98-149 no fused-runner condition for compressed-tensors; :296/:301 'is deprecated' asserts"),
    ("sglang", "0.5.23", "H200", "bf16", QWEN3, "triton", "deepep", (8, 8, 1), "SG-DEEPEP-LEGACY",
     "ep_moe/layer.py:289-292 'Unquantized DeepEP MoE currently supports low_latency mode only' / :301"),
    ("sglang", "0.5.23", "H200", "bf16", QWEN3, "deep_gemm", "deepep", (8, 8, 1), "ok",
     "ep_moe/layer.py:135-147 BF16 + deep_gemm under deepep takes the fused-runner path"),
    ("sglang", "0.5.23", "A100", "nvfp4", DSV3, "humming", "deepep", (8, 8, 1), "V7",
     "humming is a fused-runner path under DeepEP (ep_moe/layer.py:103-104, no SG-DEEPEP-* row) but NVFP4 needs "
     "Blackwell or marlin (modelopt_quant.py:2382-2387)"),
    ("sglang", "0.5.23", "A100", "bf16", QWEN3, "deep_gemm", "deepep", (8, 8, 1), "SG-DEEPEP-BF16",
     "ep_moe/layer.py:135-146 'Unquantized DeepEP MoE requires DeepGEMM BF16'"),
    # ---- sglang: versions ----
    ("sglang", "0.5.17", "B200", "fp8", DSV3, "deep_gemm", "deepep_v2", (8, 8, 1), "SG-A2A",
     "0.5.17 sglang/srt/server_args.py MOE_A2A_BACKEND_CHOICES has no deepep_v2 (first in 0.5.19)"),
    ("sglang", "0.5.19", "B200", "mxfp4", GPTOSS, "flashinfer_trtllm", "none", (1, 1, 1), "ok",
     "0.5.19 mxfp4.py has no 'Mxfp4MoEMethod has no MoeRunner' check (first in 0.5.21)"),
    ("sglang", "0.5.22", "H200", "fp8", DSV3, "deep_gemm", "pplx", (8, 8, 1), "SG-PPLX-DP",
     "0.5.22 moe_hook.py has the attention-DP assert"),
    ("sglang", "0.5.21", "H200", "fp8", DSV3, "deep_gemm", "pplx", (8, 8, 1), "ok",
     "0.5.21 has no 'requires attention DP with at least 2' (first in 0.5.22)"),
    # ---- vLLM 0.33.0 ----
    ("vllm", "0.33.0", "B200", "fp8", DSV3, "flashinfer_cutlass", "none", (1, 1, 1), "VL-QS-FICUTLASS-FP8",
     "vllm/model_executor/layers/fused_moe/experts/flashinfer_cutlass_moe.py:163-170 block FP8 only is_device_capability(90)"),
    ("vllm", "0.33.0", "H200", "fp8", DSV3, "flashinfer_cutlass", "none", (1, 1, 1), "ok",
     "flashinfer_cutlass_moe.py:163-170 block FP8 on 9.0"),
    ("vllm", "0.33.0", "H200", "nvfp4", DSV3, "flashinfer_cutlass", "none", (1, 1, 1), "VL-QS-FICUTLASS-NVFP4",
     "flashinfer_cutlass_moe.py:171-179 NVFP4 needs has_device_capability(100)"),
    ("vllm", "0.33.0", "rtx-pro-6000", "nvfp4", QWEN3, "flashinfer_cutedsl", "none", (1, 1, 1), "VL-DEV-FLASHINFER_CUTEDSL",
     "experts/flashinfer_cutedsl_moe.py:88-94 is_device_capability_family(100)"),
    ("vllm", "0.33.0", "B200", "nvfp4", QWEN3, "flashinfer_b12x", "none", (1, 1, 1), "VL-DEV-FLASHINFER_B12X",
     "experts/flashinfer_b12x_moe.py:165-171 is_device_capability_family(120)"),
    ("vllm", "0.33.0", "rtx-pro-6000", "nvfp4", QWEN3, "flashinfer_b12x", "none", (1, 1, 1), "ok",
     "flashinfer_b12x_moe.py:165-171 on 12.0"),
    ("vllm", "0.33.0", "H200", "nvfp4", QWEN3, "cutlass", "none", (1, 1, 1), "VL-DEV-CUTLASS",
     "experts/cutlass_moe.py:716-722 CutlassExpertsFp4 families 100/110/120"),
    ("vllm", "0.33.0", "thor", "nvfp4", QWEN3, "cutlass", "none", (1, 1, 1), "ok",
     "cutlass_moe.py:716-722 family 110"),
    ("vllm", "0.33.0", "H200", "mxfp4", GPTOSS, "deep_gemm", "none", (1, 1, 1), "VL-DEV-DEEP_GEMM-MXFP4",
     "experts/deep_gemm_moe.py:474-479 MXFP4 DeepGEMM families 100/120"),
    ("vllm", "0.33.0", "A100", "mxfp4", GPTOSS, "triton", "none", (1, 1, 1), "VL-DEV-TRITON-MXFP4",
     "experts/gpt_oss_triton_kernels_moe.py:41-62 CUDA 9.0 <= capability < 13.0"),
    ("vllm", "0.33.0", "H200", "bf16", QWEN3, "marlin", "none", (1, 1, 1), "VL-MAP-UNQUANTIZED",
     "oracle/unquantized.py:180-194 map_unquantized_backend"),
    ("vllm", "0.33.0", "H200", "fp8", QWEN3, "flashinfer_cutedsl", "none", (1, 1, 1), "VL-MAP-FP8",
     "oracle/fp8.py:271-289 map_fp8_backend"),
    ("vllm", "0.33.0", "B200", "mxfp4", GPTOSS, "flashinfer_trtllm_afp8", "none", (1, 1, 1), "VL-CHOICE",
     "vllm/config/kernel.py:122-147 MoEBackend Literal (the CLI choices) has no flashinfer_trtllm_afp8"),
    ("vllm", "0.33.0", "B200", "fp8", QWEN3, "flashinfer_moe_ep_mega_deep_gemm", "none", (1, 1, 1), "VL-EP-ARCH",
     "vllm/config/kernel.py:231-243 validate_flashinfer_moe_ep_model (DeepSeek-V4 only)"),
    ("vllm", "0.33.0", "B200", "dsv4_fp4", DSV4, "flashinfer_moe_ep_mega_deep_gemm", "deepep_low_latency", (8, 8, 1),
     "VL-EP-A2A", "vllm/config/kernel.py:207-215 bind_passthrough_all2all_backend"),
    ("vllm", "0.33.0", "MI300X", "fp8", DSV3, "marlin", "none", (1, 1, 1), "VL-DEV-MARLIN",
     "experts/marlin_moe.py:592-594 is_cuda() and capability >= 7.5"),
    ("vllm", "0.33.0", "H200", "fp8", DSV3, "aiter", "none", (1, 1, 1), "VL-DEV-AITER",
     "experts/rocm_aiter_moe.py:513-514 rocm_aiter_ops.is_fused_moe_enabled"),
    ("vllm", "0.33.0", "B200", "nvfp4", DSV3, "flashinfer_trtllm", "none", (1, 1, 1), "ok",
     "experts/trtllm_nvfp4_moe.py:204-211 family 100"),
    ("vllm", "0.33.0", "H200", "fp8", DSV3, "cutlass", "none", (1, 1, 1), "VL-FP8-CUTLASS",
     "oracle/fp8.py:467-477 + quantization/fp8.py:523-528 allow_vllm_cutlass=False"),
    ("vllm", "0.33.0", "B200", "fp8", DSV3, "hpc", "none", (1, 1, 1), "VL-DEV-HPC",
     "vllm/model_executor/layers/fused_moe/hpc_moe.py:63-65 is_device_capability(90)"),
    ("vllm", "0.33.0", "H200", "nvfp4", DSV3, "flashinfer_moe_ep_cutedsl", "none", (1, 1, 1),
     "VL-DEV-FLASHINFER_MOE_EP_CUTEDSL", "fused_moe/flashinfer_moe_ep.py:40-47 capabilities (10, 0), (10, 3)"),
    ("vllm", "0.33.0", "B200", "ct_int4_g32", DSV3, "deep_gemm", "none", (1, 1, 1), "VL-MAP-WNA16",
     "oracle/int_wna16.py:238-253 map_wna16_backend"),
    ("vllm", "0.33.0", "H200", "ct_int4_g32", DSV3, "marlin", "none", (1, 1, 1), "ok",
     "oracle/int_wna16.py:241-246 marlin mapped; experts/marlin_moe.py:592-594"),
    ("vllm", "0.33.0", "B200", "mxfp4", GPTOSS, "aiter", "none", (1, 1, 1), "VL-DEV-AITER",
     "experts/aiter_mxfp4_w4a16_moe.py:349-354 rocm_aiter_ops.is_enabled()"),
    ("vllm", "0.33.0", "H200", "fp8", DSV3, "deep_gemm", "deepep", (8, 8, 1), "VL-A2A",
     "vllm/config/parallel.py:45-60 All2AllBackend has deepep_high_throughput / deepep_low_latency, not sglang's deepep"),
    ("vllm", "0.22.1", "H200", "fp8", DSV3, "deep_gemm", "deepep_v2", (8, 8, 1), "VL-A2A",
     "0.22.1 vllm/config/parallel.py:40-51 has no deepep_v2"),
    ("vllm", "0.33.0", "H200", "fp8", DSV3, "deep_gemm", "deepep_v2", (8, 8, 1), "ok",
     "0.33.0 vllm/config/parallel.py:50 deepep_v2"),
    ("vllm", "0.33.0", "B200", "nvfp4", DSV3, "flashinfer_trtllm", "deepep_low_latency", (8, 8, 1), "VL-BATCHED",
     "fused_moe/config.py:1066-1067 batched format; modular_kernel.py:627-628; trtllm_nvfp4_moe.py Standard only"),
    ("vllm", "0.33.0", "B200", "nvfp4", DSV3, "flashinfer_cutedsl", "deepep_low_latency", (8, 8, 1), "ok",
     "oracle/nvfp4.py:282-286 cutedsl -> FLASHINFER_CUTEDSL_BATCHED (flashinfer_cutedsl_batched_moe.py:61-62)"),
    ("vllm", "0.33.0", "H200", "fp8", DSV3, "deep_gemm", "deepep_low_latency", (8, 8, 1), "ok",
     "oracle/fp8.py:459-461 deep_gemm -> BATCHED_DEEPGEMM"),
    # ---- vLLM 0.22.1 (line numbers of 0.22.1) vs 0.33.0 ----
    ("vllm", "0.22.1", "rtx-pro-6000", "fp8", QWEN3, "deep_gemm", "none", (1, 1, 1), "VL-DEV-DEEP_GEMM",
     "0.22.1 vllm/platforms/cuda.py:557-559 support_deep_gemm: 9.0 or family 100 only"),
    ("vllm", "0.33.0", "rtx-pro-6000", "fp8", QWEN3, "deep_gemm", "none", (1, 1, 1), "ok",
     "0.33.0 vllm/platforms/cuda.py:691-697 adds family 120"),
    ("vllm", "0.22.1", "rtx-pro-6000", "mxfp4", GPTOSS, "triton", "none", (1, 1, 1), "VL-DEV-TRITON-MXFP4",
     "0.22.1 experts/gpt_oss_triton_kernels_moe.py:43-49 (9, 0) <= cap < (11, 0)"),
    ("vllm", "0.33.0", "rtx-pro-6000", "mxfp4", GPTOSS, "triton", "none", (1, 1, 1), "ok",
     "0.33.0 experts/gpt_oss_triton_kernels_moe.py:41-62 (9, 0) <= cap < (13, 0)"),
    ("vllm", "0.22.1", "rtx-pro-6000", "nvfp4", QWEN3, "b12x", "none", (1, 1, 1), "VL-CHOICE",
     "0.22.1 vllm/config/kernel.py:122-137 MoEBackend has no b12x"),
    ("vllm", "0.22.1", "H200", "fp8", QWEN3, "humming", "none", (1, 1, 1), "VL-MAP-FP8",
     "0.22.1 oracle/fp8.py:204-219 map_fp8_backend has no humming"),
    ("vllm", "0.33.0", "H200", "fp8", QWEN3, "humming", "none", (1, 1, 1), "ok",
     "0.33.0 oracle/fp8.py:271-289 adds humming"),
    # ---- sglang: ROCm aiter ----
    ("sglang", "0.5.23", "H200", "fp8", DSV3, "aiter", "none", (1, 1, 1), "SG-FP8-AITER",
     "sglang/srt/layers/quantization/fp8.py:3139-3149 aiter branch only under _is_hip; :3356-3359 'Unsupported runner backend'"),
    # on ROCm the plan renders SGLANG_USE_AITER=1 (SQ-AITER) and the row sees it; a user's 0 is refused
    # (tests/unit/operator/test_sglang_aiter_env.py)
    ("sglang", "0.5.23", "MI300X", "fp8", DSV3, "aiter", "none", (1, 1, 1), "ok",
     "fp8.py:3414-3415 maybe_get_hip_aiter_quant_info needs SGLANG_USE_AITER=1 (fp8.py:149): rendered by the plan"),
    ("sglang", "0.5.14", "MI355X", "fp8", QWEN3, "aiter", "none", (1, 1, 1), "ok",
     "0.5.14 fp8.py:2124-2125 'if not (_use_aiter or _use_hip_int4): return None': SGLANG_USE_AITER=1 rendered"),
    # ---- sglang: FP4-packed DeepSeek-V4 experts on the FP8 Triton path ----
    ("sglang", "0.5.23", "H200", "dsv4_fp4", DSV4, "triton", "none", (1, 1, 1), "SG-FP4EXPERT-TRITON",
     "sglang/srt/layers/quantization/fp8.py:3018-3038 get_triton_quant_info use_fp8_w8a8 with FP4-packed experts -> "
     "moe_runner/triton_utils/fused_moe.py:1118-1121 'Hidden size mismatch'"),
    ("sglang", "0.5.14", "rtx-pro-6000", "dsv4_fp4", DSV4, "triton", "none", (1, 1, 1), "SG-FP4EXPERT-TRITON",
     "0.5.14 fp8.py:1817-1835 get_triton_quant_info use_fp8_w8a8=True; triton_utils/fused_moe.py:855-859"),
    ("sglang", "0.5.23", "H200", "dsv4_fp4", DSV4, "marlin", "none", (1, 1, 1), "ok",
     "fp8.py:445-450 Mxfp4MarlinMoEMethod for FP4 experts; mxfp4_marlin_moe.py:160 is_sm90"),
    # ---- vLLM: an image without FlashInfer (par's 4th element: engine.flashinferVersion) ----
    ("vllm", "0.33.0", "B200", "nvfp4", DSV3, "flashinfer_trtllm", "none", (1, 1, 1, "none"), "VL-FI-ABSENT",
     "0.33.0 experts/trtllm_nvfp4_moe.py:204-210 _supports_current_device ... and has_flashinfer_trtllm_fused_moe(); "
     "oracle/nvfp4.py:258 _return_or_raise"),
    ("vllm", "0.33.0", "H200", "fp8", QWEN3, "flashinfer_cutlass", "none", (1, 1, 1, "none"), "VL-FI-ABSENT",
     "0.33.0 experts/flashinfer_cutlass_moe.py:128-139 ... and has_flashinfer_cutlass_fused_moe(); oracle/fp8.py:438-452"),
    ("vllm", "0.33.0", "B200", "mxfp4", GPTOSS, "flashinfer_trtllm", "none", (1, 1, 1, "none"), "VL-FI-ABSENT",
     "0.33.0 experts/trtllm_mxfp4_moe.py:121-123 family 100 and has_flashinfer()"),
    ("vllm", "0.22.1", "B200", "nvfp4", DSV3, "flashinfer_cutedsl", "none", (1, 1, 1, "none"), "VL-FI-ABSENT",
     "0.22.1 experts/flashinfer_cutedsl_moe.py:69-74 ... and has_flashinfer_cutedsl_moe_nvfp4()"),
    ("vllm", "0.33.0", "B200", "nvfp4", DSV3, "cutlass", "none", (1, 1, 1, "none"), "ok",
     "0.33.0 experts/cutlass_moe.py:716-722 CutlassExpertsFp4: capability only, no FlashInfer probe"),
    ("vllm", "0.33.0", "B200", "nvfp4", DSV3, "flashinfer_trtllm", "none", (1, 1, 1, "0.7.2.post1"), "ok",
     "0.33.0 pins flashinfer-python==0.7.2.post1 (wheel METADATA Requires-Dist)"),
    ("vllm", "0.33.0", "B200", "nvfp4", DSV3, "cutlass", "flashinfer_nvlink_two_sided", (8, 8, 1, "none"),
     "VL-FI-ABSENT-A2A", "0.33.0 distributed/device_communicators/all2all.py:658-661 FlashInferNVLinkTwoSidedManager "
     "'flashinfer all2all module not found'"),
    # ---- layout rows (par's 5th element: the config.json shape): K40/WK40 MoE split, K41/WK41 attention heads ----
    ("sglang", "0.5.23", "H200", "fp8", QWEN3, "triton", "none", (8, 1, 1, None, _Q235), "K40",
     "moe_ep_setup.py:166-176 check_quantized_moe_compatibility: (1536 / 8) % 128 != 0"),
    ("sglang", "0.5.23", "H200", "fp8", QWEN3, "triton", "none", (8, 2, 1, None, _Q235), "ok",
     "moe_ep_setup.py:154 moe_tp_size = tp / ep = 4: 384 = 3 x 128"),
    ("vllm", "0.22.1", "H200", "fp8", QWEN3, "triton", "none", (8, 1, 1, None, _Q235), "WK40",
     "0.22.1 quantization/fp8.py:636-640 Fp8MoEMethod.create_weights: 192 % block_n 128"),
    ("vllm", "0.33.0", "H200", "fp8", QWEN3, "triton", "none", (8, 1, 1, None, _Q235), "ok",
     "0.33.0 oracle/fp8.py:292-321 refine_fp8_moe_block_shape: gcd(128, 128, 192, 4096) = 64 >= 32"),
    ("vllm", "0.33.0", "H200", "fp8", QWEN3, "auto", "none", (32, 1, 1, None, _Q235), "WK40",
     "0.33.0 fp8_utils.py:1347-1373 validate_fp8_block_shape_moe: 48 per rank, gcd 16 < 32 under auto"),
    ("sglang", "0.5.23", "H200", "fp8", QWEN3, "triton", "none", (12, 3, 1, None, _Q235), "K41",
     "srt/models/qwen3_moe.py:506 Qwen3MoeAttention.__init__: 64 heads % attn_tp_size 12"),
    ("vllm", "0.33.0", "H200", "fp8", QWEN3, "triton", "none", (12, 12, 1, None, _Q235), "WK41",
     "0.33.0 vllm/config/model.py:1557-1564 verify_with_parallel_config: 64 heads % tp 12"),
]


def test_runner_translated_from_the_users_env_is_checked_too():
    # W7: VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1 -> flashinfer_trtllm_afp8, not a 0.33.0 --moe-backend choice
    p = _plan("vllm", "0.33.0", "B200", "mxfp4", GPTOSS, "auto", "none", (1, 1, 1),
              env={"VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8": "1"})
    assert any(e.startswith("[VL-CHOICE]") and "Works instead:" in e for e in p.errors)
    # E2: SGLANG_CUTLASS_MOE=1 -> cutlass, which NVFP4 MoE refuses (modelopt_quant.py:3144-3148)
    p = _plan("sglang", "0.5.23", "B200", "nvfp4", DSV3, "auto", "none", (1, 1, 1), env={"SGLANG_CUTLASS_MOE": "1"})
    assert any(e.startswith("[SG-NVFP4-CUTLASS]") for e in p.errors)
    # a translation the engine accepts stays accepted
    p = _plan("vllm", "0.33.0", "B200", "nvfp4", DSV3, "auto", "none", (1, 1, 1),
              env={"VLLM_USE_FLASHINFER_MOE_FP4": "1", "VLLM_FLASHINFER_MOE_BACKEND": "throughput"})
    assert not p.errors and p.moe.runnerBackend == "flashinfer_cutlass"


def test_deepgemm_jit_off_by_env():
    """configurer.py:31-37: SGLANG_ENABLE_JIT_DEEPGEMM=0 turns DeepGEMM off on any GPU."""
    p = _plan("sglang", "0.5.23", "H200", "fp8", DSV3, "auto", "deepep", (8, 8, 1),
              env={"SGLANG_ENABLE_JIT_DEEPGEMM": "0"})
    assert any(e.startswith("[SG-DEEPEP-DEEPGEMM]") for e in p.errors)


def _plan(engine, version, gpu, fmt, arch, runner, a2a, par, env=None):
    # par: (tp, ep, dp), (tp, ep, dp, engine.flashinferVersion) or (tp, ep, dp, flashinferVersion, config.json shape)
    tp, ep, dp, *rest = par
    fi, shape = (list(rest) + [None, None])[:2]
    ck = CheckpointInfo(architecture=arch, format=fmt, formatSource="test", quantMethod=QM.get(fmt),
                        numExperts=64, numSharedExperts=1 if arch in (DSV3, DSV4) else 0, **(shape or {}))
    return plan(ck, from_name(gpu), Choices(runner_backend=runner, a2a_backend=a2a, tp=tp, ep=ep, dp=dp, env=env or {},
                                            flashinfer_version=fi),
                engine=engine, engine_version=version)


@pytest.mark.parametrize("engine,version,gpu,fmt,arch,runner,a2a,par,expected,cite", MATRIX,
                         ids=[f"{r[0]}{r[1]}-{r[2]}-{r[3]}-{r[5]}-{r[6]}-{r[8]}" for r in MATRIX])
def test_matrix(engine, version, gpu, fmt, arch, runner, a2a, par, expected, cite):
    p = _plan(engine, version, gpu, fmt, arch, runner, a2a, par)
    if expected == "ok":
        assert not p.errors, f"{cite}: {p.errors}"
        return
    if "no SG-DEEPEP-* row" in cite:
        assert not [e for e in p.errors if e.startswith("[SG-DEEPEP-")], p.errors
    hits = [e for e in p.errors if e.startswith(f"[{expected}]")]
    assert hits, f"expected [{expected}] ({cite}); got {p.errors}"
    # every refusal of an explicit choice says what works instead
    assert all("Works instead:" in e for e in p.errors), p.errors


def _offered(error: str) -> list[str]:
    tail = error.split("Works instead:", 1)[1]
    if ": " not in tail:
        return []
    values = tail.split(": ", 1)[1].split(" (or leave it at auto)")[0].rstrip(".")
    return [v.strip() for v in values.replace(";", ",").split(",") if v.strip() and " " not in v.strip()]


@pytest.mark.parametrize("row", [r for r in MATRIX if r[8] != "ok" and r[6] == "none" and len(r[7]) < 5],
                         ids=lambda r: f"{r[0]}-{r[2]}-{r[3]}-{r[5]}")
def test_alternatives_really_pass(row):
    engine, version, gpu, fmt, arch, runner, a2a, par, expected, _ = row
    p = _plan(engine, version, gpu, fmt, arch, runner, a2a, par)
    offered = _offered(p.errors[0])
    if not offered:  # nothing passes: the message says so and does not suggest auto
        assert "needs another GPU or format" in p.errors[0] and "leave it at auto" not in p.errors[0]
        return
    assert runner not in offered
    for alt in offered:
        q = _plan(engine, version, gpu, fmt, arch, alt, a2a, par)
        assert not q.errors, f"offered {alt} instead of {runner}, but: {q.errors}"


def test_alternatives_for_a_refused_a2a_fall_back_to_none():
    # FlashInfer MegaMOE needs SM100 (moe_hook.py:335-339): on H200 nothing passes with it.
    p = _plan("sglang", "0.5.23", "H200", "fp8", DSV3, "deep_gemm", "flashinfer_megamoe", (8, 8, 8))
    err = next(e for e in p.errors if e.startswith("[SG-MEGAMOE-SM100]"))
    assert "no --moe-runner-backend value passes with a2a flashinfer_megamoe" in err
    assert "without an all-to-all backend: " in err and "deep_gemm" in err.split("without an all-to-all backend: ")[1]


def test_cli_exit_2_with_alternatives(tmp_path, capsys):
    import argparse
    import json

    from moe_operator import plan_cli
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": [GPTOSS], "num_local_experts": 32, "num_experts_per_tok": 4,
        "quantization_config": {"quant_method": "mxfp4"}}))
    import struct
    header = json.dumps({"model.layers.0.mlp.experts.0.gate_proj.weight": {
        "dtype": "U8", "shape": [4, 4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    ap = argparse.ArgumentParser()
    plan_cli.add_arguments(ap)
    args = ap.parse_args(["--checkpoint", str(tmp_path), "--gpu", "B200", "--engine", "sglang",
                          "--set", "moe.runnerBackend=flashinfer_cutlass"])
    assert plan_cli.run(args) == 2
    out = capsys.readouterr().out
    assert "[SG-MXFP4-RUNNER]" in out and "Works instead:" in out and "flashinfer_mxfp4" in out


AUTO_SWEEP = [(e, g, f, a) for e in ("sglang", "vllm") for g in ("A100", "H200", "B200", "rtx-pro-6000", "MI355X")
              for f, a in (("fp8", DSV3), ("nvfp4", DSV3), ("mxfp4", GPTOSS), ("dsv4_fp4", DSV4), ("bf16", QWEN3))]


@pytest.mark.parametrize("engine,gpu,fmt,arch", AUTO_SWEEP)
def test_automatic_choices_are_not_checked_by_engine_rules(engine, gpu, fmt, arch):
    """Rule 0: with nothing explicit the engine rows are not consulted (automatic choices unchanged)."""
    p = _plan(engine, None, gpu, fmt, arch, "auto", "none", (1, 1, 1))
    assert not [e for e in p.errors if e.startswith(("[SG-", "[VL-"))]
    # a select row that refuses auto says what works itself (S2b); no engine-row alternatives are appended
    assert not any("Works instead" in e for e in p.errors if not e.startswith("[S2b]"))


AUTO_PASS = [(e, v, g, f, a, a2a) for e, v in (("sglang", "0.5.14"), ("sglang", "0.5.23"), ("vllm", "0.33.0"))
             for g in ("A100", "L40S", "H200", "B200", "rtx-pro-6000", "thor", "MI355X")
             for f, a in (("fp8", DSV3), ("nvfp4", DSV3), ("mixed", DSV3), ("mxfp4", GPTOSS), ("bf16", GPTOSS),
                          ("dsv4_fp4", DSV4), ("dsv4_nvfp4", DSV4), ("nvfp4", QWEN3), ("mixed_w4a16", QWEN3),
                          ("bf16", GLM4), ("mxfp8", QWEN3))
             for a2a in ("none", "deepep")]


def test_automatic_choices_pass_the_engines_start_up_checks():
    """The planner never plans a runner the engine's own start-up refuses: every automatic choice that is
    not `auto` (the engine decides) passes the engine rows of its version. The S2b marlin choice for
    DeepSeek-V4 FP4 on SM80/SM89/SM110 did not (mxfp4_marlin_moe.py:161, 0.5.23) and is now a refusal."""
    failing = []
    for engine, version, gpu, fmt, arch, a2a in AUTO_PASS:
        par = (8, 8, 1) if a2a != "none" else (1, 1, 1)
        p = _plan(engine, version, gpu, fmt, arch, "auto", a2a, par)
        if p.errors or p.moe.runnerBackend == "auto":
            continue
        mode = p.args[p.args.index("--deepep-mode") + 1] if "--deepep-mode" in p.args else "auto"
        case = Case(engine, version, fmt, arch, from_name(gpu).family, p.moe.runnerBackend, a2a=a2a, tp=par[0],
                    ep=par[1], dp=par[2], quant_method=QM.get(fmt), deepep_mode=mode)
        refused = [r.rule.id for r in judge.check(case)]
        if refused:
            failing.append((engine, version, gpu, fmt, arch, a2a, p.moe.runnerBackend, refused))
    assert not failing


def test_every_rule_cites_file_lines_function_and_version():
    rules = sg_rules.RULES + vl_rules.RULES
    assert len({r.id for r in rules}) == len(rules)
    for r in rules:
        s = r.source
        assert s.file.startswith(("sglang/", "vllm/")) and s.file.endswith(".py"), r.id
        assert s.lines and all(part.replace("-", "").isdigit() for part in s.lines.split(",")), r.id
        assert s.function, r.id
        assert s.version in engine_rules.VERSIONS_READ[r.engine], r.id
        assert s.since in engine_rules.VERSIONS_READ[r.engine], r.id
        assert engine_rules.vt(s.since) <= engine_rules.vt(s.version), r.id


def test_rules_apply_from_their_release_only():
    # SG-MXFP4-RUNNER is first seen in 0.5.21: 0.5.19 (read) does not have it
    assert not [r for r in judge.check(Case("sglang", "0.5.19", "mxfp4", GPTOSS, "sm100", "flashinfer_trtllm"))
                if r.rule.id == "SG-MXFP4-RUNNER"]
    assert engine_rules.coverage_note("sglang", "0.5.23") is None
    assert engine_rules.coverage_note("vllm", "0.22.1") is None


def test_an_unread_release_is_not_judged_and_names_the_nearest_read_ones():
    note = engine_rules.coverage_note("sglang", "0.5.9")
    assert "older" in note and "not judged" in note and "0.5.10" in note
    note = engine_rules.coverage_note("sglang", "0.5.30")
    assert "newer" in note and "not judged" in note and "0.5.23" in note
    assert "older" in engine_rules.coverage_note("vllm", "0.16.0") and "0.22.0" in engine_rules.coverage_note("vllm", "0.16.0")
    assert "0.25.1 (older), 0.26.0 (newer)" in engine_rules.coverage_note("vllm", "0.25.2")
    # a post release is a release of its own, not its base's
    assert "0.5.23" in engine_rules.coverage_note("sglang", "0.5.23.post1")
    assert engine_rules.read_as("sglang", "0.5.23.post1") is None and engine_rules.read_as("sglang", "v0.5.23") == "0.5.23"
    # no start-up row runs for a release not read, not even one both neighbours have
    both = Case("sglang", "0.5.22", "mxfp4", GPTOSS, "sm100", "flashinfer_trtllm")
    assert "SG-MXFP4-RUNNER" in [r.rule.id for r in judge.check(both)]  # 0.5.21 and 0.5.22 (read) refuse it
    for v in ("0.5.21.post1", "0.5.24", "0.5.9"):
        assert not judge.check(dataclasses.replace(both, version=v)), v
        assert judge.alternatives(dataclasses.replace(both, version=v)) == {}
    assert "not judged" in judge.describe_alternatives(dataclasses.replace(both, version="0.5.24"), {},
                                                             "--moe-runner-backend")
    with pytest.raises(ValueError, match="not read"):
        sg_rules.choices("0.5.24")
    with pytest.raises(ValueError, match="not read"):
        vl_rules.release("0.25.2")


def test_unread_version_warns_in_the_plan():
    p = _plan("vllm", "0.25.2", "B200", "nvfp4", DSV3, "flashinfer_trtllm", "none", (1, 1, 1))
    assert any(w.startswith("[ER0]") for w in p.warnings)


def test_vllm_release_between_two_read_ones_is_not_judged():
    # refused by the releases read (0.22.1, 0.33.0): for 0.25.2 (no such release: not read) the start-up rows are not judged,
    # the plan warns, and the planner's own rows still run
    read = _plan("vllm", "0.33.0", "H200", "nvfp4", QWEN3, "flashinfer_cutedsl", "none", (1, 1, 1))
    assert any(e.startswith("[VL-DEV-FLASHINFER_CUTEDSL]") for e in read.errors)
    p = _plan("vllm", "0.25.2", "H200", "nvfp4", QWEN3, "flashinfer_cutedsl", "none", (1, 1, 1))
    assert not [e for e in p.errors if e.startswith("[VL-")]
    er0 = [w for w in p.warnings if w.startswith("[ER0]")]
    assert er0 and "not judged" in er0[0] and "0.25.1 (older), 0.26.0 (newer)" in er0[0]
    # b12x first read in 0.29.0: 0.33.0 accepts it as a choice, 0.22.1 refuses it (read releases only)
    assert not [e for e in _plan("vllm", "0.33.0", "rtx-pro-6000", "nvfp4", QWEN3, "b12x", "none", (1, 1, 1)).errors
                if e.startswith("[VL-CHOICE]")]


def test_a_plan_for_an_unread_release_warns_at_admission_even_with_auto():
    p = _plan("sglang", "0.5.24", "H200", "fp8", DSV3, "auto", "none", (8, 1, 1))
    assert not p.errors
    assert [w for w in auto_fallbacks(p) if w.startswith("[ER0]") and "nearest release read: 0.5.23" in w]
    assert not [w for w in auto_fallbacks(_plan("sglang", "0.5.21", "H200", "fp8", DSV3, "auto", "none", (8, 1, 1)))
                if w.startswith("[ER0]")]


def test_a2a_choices_per_release():
    assert "deepep_v2" not in sg_rules.choices("0.5.17")[1]
    assert "deepep_v2" in sg_rules.choices("0.5.19")[1]
    assert "flashinfer_megamoe" in sg_rules.choices("0.5.21")[1]
    assert "deepep_v2" in sg_rules.choices("0.5.20")[1] and "flashinfer_megamoe" in sg_rules.choices("0.5.20")[0]
    # a release not read (newer than every one read) is not guessed from its neighbour
    with pytest.raises(ValueError, match="not judged"):
        sg_rules.choices("0.5.24")
    assert "lora_marlin" in sg_rules.choices("0.5.23")[0] and "lora_marlin" not in sg_rules.choices("0.5.22")[0]


# ---- facts the rules need: config.json defaults as transformers defines them (item 4) ----

def test_model_defaults_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers import CONFIG_MAPPING

    from moe_core.checkpoint import MODEL_DEFAULTS, TRANSFORMERS_READ
    assert engine_rules.vt(transformers.__version__) >= engine_rules.vt(TRANSFORMERS_READ)
    for model_type, (cls_name, fields) in MODEL_DEFAULTS.items():
        cfg = CONFIG_MAPPING[model_type]()
        assert type(cfg).__name__ == cls_name, model_type
        for field_name, (key, value) in fields.items():
            assert getattr(cfg, key) == value, (model_type, key, getattr(cfg, key), value)


def test_missing_config_key_takes_the_class_default_not_zero():
    from moe_core.checkpoint import classify
    base = {"architectures": [DSV3], "model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8,
            "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
    info = classify(base, None, [])
    assert info.numSharedExperts == 1 and any("n_shared_experts=1" in n for n in info.notes)
    assert classify({**base, "n_shared_experts": 0}, None, []).numSharedExperts == 0  # an explicit value wins
    qwen = classify({"architectures": [QWEN3], "model_type": "qwen3_moe"}, None, [])
    assert qwen.numSharedExperts is None and qwen.numExperts == 128  # Qwen3MoeConfig has no shared experts
    # the default decides deferred finalize (needs an unfused shared expert: sglang models/deepseek_v2.py:1206-1220)
    p = plan(info, from_name("B200"), Choices(), engine="sglang")
    assert p.moe.runnerBackend == "flashinfer_trtllm" and p.moe.deferredFinalize


def test_admission_gets_the_engine_refusal_with_alternatives():
    """placement.impossible_everywhere (what the validating webhook calls) refuses from plan errors."""
    from moe_core.gpu import from_name as gpu
    from moe_operator.api import MoEDeploymentSpec
    from moe_operator.placement import impossible_everywhere
    ck = CheckpointInfo(architecture=GPTOSS, format="mxfp4", formatSource="test", quantMethod="mxfp4", numExperts=32)
    spec = MoEDeploymentSpec.model_validate({
        "model": {"uri": "hf://openai/gpt-oss-120b"}, "engine": {"name": "sglang"},
        "moe": {"runnerBackend": "flashinfer_trtllm"}, "gpu": {"allowedArchitectures": ["sm100", "sm120"]}})
    msg = impossible_everywhere(spec, ck, [gpu("sm100"), gpu("sm120")])
    # sm100: only the engine row refuses it (mxfp4.py:1474-1478); sm120: the planner's V1 (trtllm-gen is SM100-only)
    assert msg and "sm100/NVIDIA-B200: [SG-MXFP4-RUNNER]" in msg and "[V1]" in msg
    assert msg.count("Works instead:") >= 2 and "flashinfer_mxfp4" in msg   # every error of each class
    ok = MoEDeploymentSpec.model_validate({
        "model": {"uri": "hf://openai/gpt-oss-120b"}, "engine": {"name": "sglang"},
        "moe": {"runnerBackend": "flashinfer_mxfp4"}, "gpu": {"allowedArchitectures": ["sm100"]}})
    assert impossible_everywhere(ok, ck, [gpu("sm100")]) is None


def test_a2a_refusal_lists_a2a_values_that_pass_and_the_spec_can_hold():
    from moe_operator.planner import ALL_A2A
    p = _plan("vllm", "0.33.0", "B200", "nvfp4", DSV3, "cutlass", "deepep", (8, 8, 1))
    err = next(e for e in p.errors if e.startswith("[VL-A2A]"))
    offered = err.split("--all2all-backend values that pass with --moe-backend cutlass: ")[1].rstrip(".").split(", ")
    assert "deepep_high_throughput" in offered and "deepep" not in offered
    assert "deepep_low_latency" not in offered  # batched format: CutlassExpertsFp4 is Standard only (VL-BATCHED)
    for a2a in offered:
        assert a2a in ALL_A2A
        assert not _plan("vllm", "0.33.0", "B200", "nvfp4", DSV3, "cutlass", a2a, (8, 8, 1)).errors, a2a


def test_fused_function_registry_per_release():
    # ('flashinfer', 'flashinfer_trtllm') is registered from 0.5.19 (moe_runner/flashinfer_trtllm.py:1876 in 0.5.23)
    case = Case("sglang", "0.5.17", "fp8", DSV3, "sm100", "flashinfer_trtllm", a2a="flashinfer", tp=8, ep=8, dp=8)
    assert [r.rule.id for r in judge.check(case)] == ["SG-FUSED"]
    assert not judge.check(Case("sglang", "0.5.19", "fp8", DSV3, "sm100", "flashinfer_trtllm", a2a="flashinfer",
                                       tp=8, ep=8, dp=8))


# ---- shape-dependent checks (item 3 of the previous note) ----

def _block_fp8(arch=QWEN3, inter=1536):
    return CheckpointInfo(architecture=arch, format="fp8", formatSource="test", quantMethod="fp8", numExperts=128,
                          moeIntermediateSize=inter, hiddenSize=4096, weightBlockSize=[128, 128])


@pytest.mark.parametrize("version", ["0.5.10", "0.5.14", "0.5.17", "0.5.19", "0.5.21", "0.5.22", "0.5.23"])
@pytest.mark.parametrize("runner", ["auto", "triton", "deep_gemm"])
def test_sglang_block_fp8_intermediate_split_per_rank(version, runner):
    """Qwen3-235B-A22B-FP8 (moe_intermediate_size 1536, weight_block_size [128, 128]) at tp 8: 1536 / 8 = 192 is
    not a multiple of 128. check_quantized_moe_compatibility raises 'For quantized MoE models, please make sure
    (moe_intermediate_size=... / moe_tp_size=...) % weight_block_size_n=... == 0' for every runner:
    model_runner.py:882-886 (0.5.10), model_runner.py:1134-1143 (0.5.14), moe_ep_setup.py:166-176 (0.5.23)."""
    p = plan(_block_fp8(), from_name("H200"), Choices(runner_backend=runner, tp=8), engine="sglang", engine_version=version)
    [err] = [e for e in p.errors if e.startswith("[K40]")]
    assert "moe_tp_size=8" in err and "weight_block_size_n=128" in err
    assert "parallelism.ep 2, 4, 8 with tp 8" in err and "tp 1, 2, 4 with ep 1" in err
    # ep 2: moe_tp_size 4, 1536 / 4 = 384 = 3 x 128 (moe_ep_setup.py:154 moe_tp_size = tp_size // moe_ep_size // moe_dp_size)
    ok = plan(_block_fp8(), from_name("H200"), Choices(runner_backend=runner, tp=8, ep=2), engine="sglang",
              engine_version=version)
    assert not [e for e in ok.errors if e.startswith("[K40]")]


def test_sglang_block_fp8_split_exemptions_and_other_engines():
    ck = _block_fp8()
    # SGLANG_SHARED_EXPERT_TP1 skips the block check from 0.5.14 (moe_ep_setup.py:166, 0.5.23; model_runner.py:1135,
    # 0.5.14); 0.5.10 has no such condition (model_runner.py:882)
    env = {"SGLANG_SHARED_EXPERT_TP1": "1"}
    assert not plan(ck, from_name("H200"), Choices(tp=8, env=env), engine="sglang").errors
    assert plan(ck, from_name("H200"), Choices(tp=8, env=env), engine="sglang", engine_version="0.5.10").errors
    # an indivisible split is refused before the block check (moe_ep_setup.py:162-165, 0.5.23)
    [err] = plan(_block_fp8(inter=1000), from_name("H200"), Choices(tp=16, ep=1), engine="sglang").errors
    assert "must be divisible by moe_tp_size (16)" in err
    # no weight_block_size (per-tensor FP8, NVFP4): the check does not run (moe_ep_setup.py:141-147, the walrus at :146)
    assert not plan(ck.model_copy(update={"weightBlockSize": None}), from_name("H200"), Choices(tp=8), engine="sglang").errors
    # an a2a backend makes ep = tp (moe_hook.py handle_a2a_moe): moe_tp_size 1
    assert not [e for e in plan(ck, from_name("H200"), Choices(tp=8, ep=8, a2a_backend="deepep"), engine="sglang").errors
                if e.startswith("[K40]")]
    # vLLM is not modelled by this row
    assert not plan(ck, from_name("H200"), Choices(tp=8), engine="vllm").errors


def test_checkpoint_reads_weight_block_size():
    from moe_core.checkpoint import classify
    cfg = {"architectures": [QWEN3], "model_type": "qwen3_moe", "num_experts": 128, "moe_intermediate_size": 1536,
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert classify(cfg, None, []).weightBlockSize == [128, 128]
    cfg["quantization_config"] = {"quant_method": "fp8"}
    assert classify(cfg, None, []).weightBlockSize is None



@pytest.mark.parametrize("version,gpu,tp,expected", [
    # 2048 / 8 = 256 = 2 x 128: aligned (mxfp4_flashinfer_cutlass_moe.py:67-74, 0.5.23)
    ("0.5.23", "H200", 8, None),
    # 2048 / 32 = 64: "requires hidden_size and intermediate_size_per_partition to be multiples of 128"
    ("0.5.23", "H200", 32, "SG-FP4EXPERT-FI-ALIGN"),
    ("0.5.23", "rtx-pro-6000", 32, "SG-FP4EXPERT-FI-ALIGN"),   # SM120 builds the CUTLASS method too (fp8.py:459-466)
    ("0.5.14", "H200", 32, "SG-FP4EXPERT-FI-ALIGN"),          # 0.5.14 mxfp4_flashinfer_cutlass_moe.py:97-103
    # 0.5.14 builds the CUTLASS method only for is_sm90 and not is_sm100 (fp8.py:291-300); SM120 took TRT-LLM
    ("0.5.14", "rtx-pro-6000", 32, None),
    # SM100 builds Mxfp4FlashinferTrtllmMoEMethod (fp8.py:468-472, 0.5.23): no such check
    ("0.5.23", "B200", 32, None),
])
def test_dsv4_fp4_flashinfer_mxfp4_alignment(version, gpu, tp, expected):
    ck = CheckpointInfo(architecture=DSV4, format="dsv4_fp4", formatSource="test", quantMethod="fp8", numExperts=256,
                        numSharedExperts=1, hiddenSize=4096, moeIntermediateSize=2048, expertsFp4=True)
    p = plan(ck, from_name(gpu), Choices(runner_backend="flashinfer_mxfp4", tp=tp), engine="sglang", engine_version=version)
    hits = [e for e in p.errors if e.startswith("[SG-FP4EXPERT-FI-ALIGN]")]
    if expected is None:
        assert not hits, p.errors
        return
    [err] = hits
    assert "intermediate=64 (moe_intermediate_size 2048 / moe_tp_size 32)" in err and "marlin" in err.split("Works instead")[1]
    # auto never takes the misaligned flashinfer_mxfp4 (sglang's own override would, deepseek_v4.py:75-89): S2e marlin,
    # an admission warning (auto falls back)
    from moe_operator.planner import auto_fallbacks
    a = plan(ck, from_name(gpu), Choices(tp=tp), engine="sglang", engine_version=version)
    assert a.moe.runnerBackend == "marlin" and not a.errors and auto_fallbacks(a)[0].startswith("[S2e]")


# ---- --deepep-mode (sglang) ----

@pytest.mark.parametrize("version", ["0.5.14", "0.5.17", "0.5.23"])
def test_explicit_cutedsl_under_deepep_gets_low_latency(version):
    """S15b: the ('deepep', 'flashinfer_cutedsl') fused function takes DeepEPLLDispatchOutput only
    (moe_runner/flashinfer_cutedsl.py:460-476, 0.5.14); --deepep-mode auto sends prefill through normal dispatch
    (exec_.py:898-901 help, 0.5.23). sglang >= 0.5.17 forces low_latency itself (moe_hook.py:363-375, 0.5.23)."""
    p = _plan("sglang", version, "B200", "nvfp4", DSV3, "flashinfer_cutedsl", "deepep", (8, 8, 1))
    assert p.args[p.args.index("--deepep-mode") + 1] == "low_latency" and "S15b" in {d.rule for d in p.decisions}
    assert not [e for e in p.errors if "DEEPEP-AUTO" in e or "DEEPEP-NORMAL" in e]
    auto = _plan("sglang", version, "B200", "nvfp4", DSV3, "auto", "deepep", (8, 8, 1))  # S15 adds it once
    assert auto.args.count("--deepep-mode") == 1


@pytest.mark.parametrize("version,a2a,runner,mode,expected", [
    ("0.5.14", "deepep", "flashinfer_cutedsl", "auto", "SG-CUTEDSL-DEEPEP-AUTO"),  # flashinfer_cutedsl.py:460-476
    ("0.5.17", "deepep", "flashinfer_cutedsl", "auto", None),  # forced to low_latency (server_args.py:6691, 0.5.17)
    ("0.5.23", "deepep", "flashinfer_cutedsl", "normal", "SG-CUTEDSL-DEEPEP-NORMAL"),  # moe_hook.py:376-382
    ("0.5.23", "deepep", "flashinfer_cutedsl", "low_latency", None),
    ("0.5.23", "pplx", "deep_gemm", "normal", "SG-PPLX-NORMAL"),  # moe_hook.py:576-580
    ("0.5.23", "pplx", "deep_gemm", "auto", None),  # resolved to low_latency (moe_hook.py:581-587)
])
def test_deepep_mode_rows(version, a2a, runner, mode, expected):
    case = Case("sglang", version, "nvfp4", DSV3, "sm100", runner, a2a=a2a, tp=8, ep=8, dp=8, deepep_mode=mode)
    ids = {r.rule.id for r in judge.check(case)} & {"SG-CUTEDSL-DEEPEP-AUTO", "SG-CUTEDSL-DEEPEP-NORMAL", "SG-PPLX-NORMAL"}
    assert ids == ({expected} if expected else set())


def test_sglang_deepep_mode_env_is_not_an_sglang_setting():
    """No released sglang read (0.5.10-0.5.23) has SGLANG_DEEPEP_MODE (srt/environ.py has no such key); the
    mode is --deepep-mode (exec_.py:898-901, 0.5.23). Setting it neither disables a refusal nor goes unmentioned."""
    env = {"SGLANG_DEEPEP_MODE": "normal", "SGLANG_ENABLE_JIT_DEEPGEMM": "0"}
    p = _plan("sglang", "0.5.23", "H200", "fp8", DSV3, "auto", "deepep", (8, 8, 1), env=env)
    assert any(e.startswith("[SG-DEEPEP-DEEPGEMM]") for e in p.errors)
    assert any(w.startswith("[K28]") and "not read by sglang" in w for w in p.warnings)



def test_aiter_with_sglang_use_aiter_on_rocm_passes():
    """fp8.py:149 _use_aiter = SGLANG_USE_AITER and _is_hip; with it the aiter branch runs (fp8.py:3139-3149, 0.5.23)."""
    p = _plan("sglang", "0.5.23", "MI300X", "fp8", DSV3, "aiter", "none", (1, 1, 1), env={"SGLANG_USE_AITER": "1"})
    assert not p.errors
    p = _plan("sglang", "0.5.23", "H200", "fp8", DSV3, "aiter", "none", (1, 1, 1), env={"SGLANG_USE_AITER": "1"})
    assert any(e.startswith("[SG-FP8-AITER]") for e in p.errors)  # the env does nothing off ROCm (_is_hip)


@pytest.mark.parametrize("runner,a2a,par", [("flashinfer_trtllm", "none", (1, 1, 1)), ("flashinfer_cutlass", "none", (1, 1, 1)),
                                            ("flashinfer_cutedsl", "none", (1, 1, 1)),
                                            ("flashinfer_cutlass", "flashinfer", (8, 8, 8))])
def test_flashinfer_runners_need_flashinfer_in_the_image(runner, a2a, par):
    """flashinfer_cutlass.py:157-162 'flashinfer_cutlass MoE runner backend requires flashinfer to be installed',
    flashinfer_cutedsl.py:316-322, flashinfer_trtllm_moe.py:73-79 (sglang 0.5.23): an image without FlashInfer
    (engine.flashinferVersion none) cannot run them; what works instead has no flashinfer runner."""
    ck = CheckpointInfo(architecture=DSV3, format="nvfp4", formatSource="test", quantMethod="NVFP4", numExperts=64,
                        numSharedExperts=1)
    p = plan(ck, from_name("B200"), Choices(runner_backend=runner, a2a_backend=a2a, tp=par[0], ep=par[1], dp=par[2],
                                            flashinfer_version="none"), engine="sglang")
    [err] = [e for e in p.errors if e.startswith("[SG-FI-ABSENT]")]
    assert "flashinfer_" not in err.split("Works instead:")[1].split("--moe-a2a-backend values")[0].replace(
        "--moe-runner-backend values that pass its start-up checks for nvfp4 on sm100 with sglang 0.5.23", "")
    ok = plan(ck, from_name("B200"), Choices(runner_backend=runner, a2a_backend=a2a, tp=par[0], ep=par[1], dp=par[2]),
              engine="sglang")
    assert not [e for e in ok.errors if e.startswith("[SG-FI-ABSENT]")]


@pytest.mark.parametrize("gpu", ["H200", "B200", "rtx-pro-6000"])
def test_auto_never_picks_a_flashinfer_runner_for_an_image_without_flashinfer(gpu):
    """FI0: select rows that would pick a FlashInfer runner are passed over when engine.flashinferVersion is none
    (SG-FI-ABSENT: flashinfer_cutlass.py:157-162, sglang 0.5.23), and say so (an admission fallback)."""
    from moe_operator.planner import auto_fallbacks
    for fmt, arch in (("fp8", DSV3), ("nvfp4", DSV3), ("mxfp4", GPTOSS), ("dsv4_fp4", DSV4), ("bf16", QWEN3)):
        ck = CheckpointInfo(architecture=arch, format=fmt, formatSource="test", quantMethod=QM.get(fmt), numExperts=64,
                            numSharedExperts=1 if arch in (DSV3, DSV4) else 0)
        p = plan(ck, from_name(gpu), Choices(flashinfer_version="none"), engine="sglang")
        assert not p.moe.runnerBackend.startswith("flashinfer"), (fmt, p.moe.runnerBackend)
        with_fi = plan(ck, from_name(gpu), Choices(), engine="sglang")
        if with_fi.moe.runnerBackend.startswith("flashinfer") and not p.errors:
            assert auto_fallbacks(p), (fmt, p.decisions)
        if not p.errors and p.moe.runnerBackend != "auto":
            case = Case("sglang", "0.5.23", fmt, arch, from_name(gpu).family, p.moe.runnerBackend, flashinfer="none",
                        quant_method=QM.get(fmt))
            assert not judge.check(case), (fmt, p.moe.runnerBackend)
    # DeepSeek-V4 FP4 on SM100 has nothing without FlashInfer (marlin is SM90/SM120 only): refused with alternatives
    ck = CheckpointInfo(architecture=DSV4, format="dsv4_fp4", formatSource="test", numExperts=64, numSharedExperts=1)
    p = plan(ck, from_name("B200"), Choices(flashinfer_version="none"), engine="sglang")
    assert any(e.startswith("[S2f]") and "Works instead" in e for e in p.errors)


def test_sglang_moe_split_assert_without_block_quantization():
    """FusedMoE.__init__ asserts intermediate_size % self.moe_tp_size == 0 for every MoE layer
    (srt/layers/moe/fused_moe_triton/layer.py:427 in 0.5.23, :207 in 0.5.10), block-quantized or not."""
    ck = CheckpointInfo(architecture=QWEN3, format="bf16", formatSource="test", numExperts=128, moeIntermediateSize=1000)
    [err] = plan(ck, from_name("H200"), Choices(tp=16), engine="sglang").errors
    assert err.startswith("[K40]") and "layer.py:427" in err and "moe_tp_size 16" in err and "tp 1, 2, 4, 8 with ep 1" in err
    assert not plan(ck, from_name("H200"), Choices(tp=8), engine="sglang").errors  # 1000 / 8 = 125
    assert not plan(ck, from_name("H200"), Choices(tp=16, ep=16), engine="sglang").errors


def test_vllm_block_fp8_split_refined_padded_or_refused():
    """vLLM 0.33.0 (model_executor/layers/fused_moe/oracle/fp8.py): a TP shard of the MoE intermediate size that is
    not a whole number of checkpoint blocks is refined to gcd(block_n, block_k, shard, hidden) >= 32 (:292-321);
    under --moe-backend auto nothing else is tried and Fp8MoEMethod.create_weights' validate_fp8_block_shape_moe
    raises (quantization/utils/fp8_utils.py:1361-1366); an explicit backend pads the shard to whole blocks instead
    (pad_tp_shard_to_weight_blocks, :324-352)."""
    ck = _block_fp8()  # Qwen3-235B-FP8: 1536, hidden 4096, [128, 128]
    assert not plan(ck, from_name("H200"), Choices(tp=8), engine="vllm").errors    # 192: refined to 64 x 64
    [err] = plan(ck, from_name("H200"), Choices(tp=32), engine="vllm").errors       # 48: gcd 16 < 32
    assert err.startswith("[WK40]") and "= 48 is not divisible by weight quantization block_n = 128" in err
    assert "parallelism.ep 32" in err and "--moe-backend triton" in err
    assert not plan(ck, from_name("H200"), Choices(tp=32, runner_backend="triton"), engine="vllm").errors  # padded
    assert not plan(ck, from_name("H200"), Choices(tp=32, ep=32), engine="vllm").errors  # EP: MoE tp 1 (config.py:1198-1225)
    # FusedMoEConfig.__post_init__ asserts intermediate_size % tp_size == 0 (fused_moe/config.py:1352)
    [err] = plan(_block_fp8(inter=1000), from_name("H200"), Choices(tp=16), engine="vllm").errors
    assert "intermediate_size 1000 % tp_size 16" in err
    # releases before the oldest read (0.22.1) are not judged
    assert not plan(ck, from_name("H200"), Choices(tp=32), engine="vllm", engine_version="0.20.0").errors


@pytest.mark.parametrize("runner", ["auto", "triton", "deep_gemm"])
def test_vllm_0221_block_fp8_split_has_no_refinement_or_padding(runner):
    """vLLM 0.22.1: Fp8MoEMethod.create_weights raises for a block-FP8 shard that is not whole blocks
    (quantization/fp8.py:636-647, 'The output_size of gate's and up's weight = 192 is not divisible by weight
    quantization block_n = 128.'), whatever the backend: that release has no refine_fp8_moe_block_shape and no
    pad_tp_shard_to_weight_blocks (its oracle/fp8.py). Qwen3-235B-A22B-FP8 at tp 8 starts on 0.33.0, not on 0.22.1."""
    ck = _block_fp8()  # 1536, hidden 4096, [128, 128]
    [err] = [e for e in plan(ck, from_name("H200"), Choices(tp=8, runner_backend=runner), engine="vllm",
                             engine_version="0.22.1").errors if e.startswith("[WK40]")]
    assert "weight = 192 is not divisible by weight quantization block_n = 128" in err and "quantization/fp8.py:624-647" in err
    assert "vLLM 0.22.1" in err and "Works instead: parallelism.ep 8 (--enable-expert-parallel); tp 1, 2, 4." in err
    assert "--moe-backend triton" not in err  # no backend pads in 0.22.1
    assert not [e for e in plan(ck, from_name("H200"), Choices(tp=8, runner_backend=runner), engine="vllm").errors
                if e.startswith("[WK40]")]  # 0.33.0 refines (auto) or pads (explicit)
    for ok in (Choices(tp=4, runner_backend=runner), Choices(tp=8, ep=8, runner_backend=runner)):
        assert not [e for e in plan(ck, from_name("H200"), ok, engine="vllm", engine_version="0.22.1").errors
                    if e.startswith("[WK40]")]
    # FusedMoE.__init__ asserts intermediate_size % self.tp_size == 0 (fused_moe/layer.py:266, 0.22.1); the MoE
    # layer is tensor-parallel over tp x dp without EP (FusedMoEParallelConfig.make, config.py:1097-1220)
    bf16 = CheckpointInfo(architecture=QWEN3, format="bf16", formatSource="test", numExperts=128, moeIntermediateSize=1000)
    [err] = plan(bf16, from_name("H200"), Choices(tp=8, dp=2), engine="vllm", engine_version="0.22.1").errors
    assert "intermediate_size 1000 % self.tp_size 16 == 0" in err and "layer.py:266" in err


def test_vllm_between_the_releases_read_refuses_only_what_both_refuse():
    ck = _block_fp8()
    # tp 8: 0.22.1 refuses, 0.33.0 refines: a release between them is not refused (no refusal guessed)
    assert not plan(ck, from_name("H200"), Choices(tp=8), engine="vllm", engine_version="0.28.0").errors
    # tp 32: both refuse (48 per rank, gcd 16 < 32 under auto)
    [err] = plan(ck, from_name("H200"), Choices(tp=32), engine="vllm", engine_version="0.28.0").errors
    assert err.startswith("[WK40]") and "0.28.0 was not read: refused because 0.22.1 and 0.33.0 both refuse it" in err


def test_attention_heads_split_k41_wk41():
    """The attention layers' own asserts: sglang Glm4MoeAttention.__init__ (srt/models/glm4_moe.py:237-247, 0.5.23)
    asserts heads % attn_tp_size and that the KV heads split or replicate evenly; vLLM ModelConfig.
    verify_with_parallel_config (config/model.py:1557-1564, 0.33.0) and QKVParallelLinear (linear.py:1064-1071)."""
    glm = CheckpointInfo(architecture=GLM4, format="bf16", formatSource="test", numExperts=160, moeIntermediateSize=1536,
                         numAttentionHeads=96, numKeyValueHeads=8)  # GLM-4.5: 96 heads, 8 KV heads
    [err] = plan(glm, from_name("H200"), Choices(tp=12), engine="sglang").errors
    assert err.startswith("[K41]") and "8 KV heads neither split over nor replicate evenly on 12" in err
    assert "glm4_moe.py:237-247" in err and "Works instead: tp 1, 2, 4, 8, 16, 32." in err
    [err] = plan(glm, from_name("H200"), Choices(tp=12), engine="vllm").errors
    assert err.startswith("[WK41]") and "linear.py:1064-1071" in err
    assert not plan(glm, from_name("H200"), Choices(tp=16), engine="sglang").errors  # 16 = 2 x 8 KV heads
    # sglang with --enable-dp-attention: the attention group is tp / dp (runtime_context.py:73-76)
    qwen = CheckpointInfo(architecture=QWEN3, format="bf16", formatSource="test", numExperts=128, moeIntermediateSize=1536,
                          numAttentionHeads=64, numKeyValueHeads=4)
    [k41] = [e for e in plan(qwen, from_name("H200"), Choices(tp=24, dp=2), engine="sglang").errors if e.startswith("[K41]")]
    assert "64 attention heads % 12 (attention tensor-parallel size)" in k41 and "with dp 2" in k41
    for ok in (Choices(tp=16, dp=2), Choices(tp=8, dp=8)):  # attention tp 8, 1
        assert not [e for e in plan(qwen, from_name("H200"), ok, engine="sglang").errors if e.startswith("[K41]")]
    # a model sglang's table does not list is not judged; MLA (kv_lora_rank) has no KV-head split
    assert not plan(qwen.model_copy(update={"architecture": "SomeNewMoeForCausalLM"}), from_name("H200"), Choices(tp=12),
                    engine="sglang").errors
    mla = CheckpointInfo(architecture=DSV3, format="bf16", formatSource="test", numExperts=256, moeIntermediateSize=2048,
                         numAttentionHeads=128, numKeyValueHeads=128, kvLoraRank=512)
    assert not plan(mla, from_name("H200"), Choices(tp=32), engine="sglang").errors
    assert any(e.startswith("[K41]") and "deepseek_v2.py:2057" in e  # 128 heads % 24
               for e in plan(mla, from_name("H200"), Choices(tp=24), engine="sglang").errors)


def test_vllm_auto_without_flashinfer_is_an_admission_fallback():
    """vLLM's auto loops over the oracle's priority list and skips a backend whose is_supported_config fails
    (oracle/nvfp4.py:304-320, 0.33.0): without FlashInfer NVFP4 on SM100 runs vLLM's CUTLASS FP4 instead of
    FlashInfer TRT-LLM (nvfp4.py:203-212). The plan has no error, and auto_fallbacks reports it (FI0)."""
    from moe_operator.planner import auto_fallbacks
    p = _plan("vllm", "0.33.0", "B200", "nvfp4", DSV3, "auto", "none", (1, 1, 1, "none"))
    assert not p.errors
    [fb] = [w for w in auto_fallbacks(p) if w.startswith("[FI0]")]
    assert "oracle/nvfp4.py:203-212" in fb and "CutlassExpertsFp4" in fb
    assert not [w for w in auto_fallbacks(_plan("vllm", "0.33.0", "B200", "nvfp4", DSV3, "auto", "none", (1, 1, 1)))
                if w.startswith("[FI0]")]
    assert not [w for w in _plan("vllm", "0.33.0", "H200", "fp8", DSV3, "auto", "none", (1, 1, 1, "none")).warnings
                if w.startswith("[FI0]")]  # Hopper FP8 auto: Triton for TP (W6), no FlashInfer first
    p = _plan("vllm", "0.33.0", "B200", "mxfp4", GPTOSS, "auto", "none", (1, 1, 1, "none"))
    assert any(w.startswith("[FI0]") and "mxfp4.py:405-425" in w for w in p.warnings) and not p.errors
