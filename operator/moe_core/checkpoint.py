"""Checkpoint inspection: config.json (+ hf_quant_config.json) and safetensors *headers* -> CheckpointInfo.

Torch-free and reads no weight data. The classification (`classify`) is a pure function of the
parsed JSON and the tensor headers, so the operator can feed it from a local directory, from the
Hugging Face hub (headers over HTTP range requests) or from an inspection Job's output alike.

Format vocabulary and lookup order follow tuning-rules.md section 2 (sglang `_parse_quant_hf_config`):
  1. config.json `quantization_config` (no `quant_method`, or `modelopt` -> ModelOpt parsing)
  2. else config.json `compression_config` (old compressed-tensors)
  3. else standalone `hf_quant_config.json` (ModelOpt nested `{"quantization": {...}}`)
DeepSeek-V4 expert formats (`dsv4_fp4` / `dsv4_fp8` / `dsv4_nvfp4`) follow section 2.1 and
formats-and-kernels.md section 4.6: `routed_experts_quant_method`, `moe_quant_algo`, `expert_dtype`,
then the safetensors dtype probe of one routed-expert weight.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from .formats import is_fp4

DEEPSEEK_V4_ARCHS = frozenset({"DeepseekV4ForCausalLM", "DeepseekV4ForCausalLMNextN", "DeepseekV4DSparkForCausalLM"})

# sglang's probe regex for a routed-expert weight (configs/deepseek_v4.py)
_ROUTED_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(w[123]|down_proj|up_proj|gate_proj)\.weight$")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_MAX_FACT = 2**31  # a config count or dimension beyond int32 is a typo or an overflow, not a model

# safetensors dtype -> bytes per element (F4 is packed two per byte)
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
    "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "F4": 0.5,
    "F6_E2M3": 0.75, "F6_E3M2": 0.75, "C64": 8,
}


# config.json keys per CheckpointInfo field, first found wins (config.json, then its text_config).
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "numExperts": ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"),
    "expertsPerToken": ("num_experts_per_tok", "moe_topk", "num_experts_per_token"),
    "numSharedExperts": ("n_shared_experts", "num_shared_experts"),
    "hiddenSize": ("hidden_size",),
    "intermediateSize": ("intermediate_size",),
    "moeIntermediateSize": ("moe_intermediate_size",),
    "numLayers": ("num_hidden_layers",),
    # attention facts for the KV-cache size (moe_core.sizing)
    "numAttentionHeads": ("num_attention_heads",),
    "numKeyValueHeads": ("num_key_value_heads",),
    "headDim": ("head_dim",),
    "kvLoraRank": ("kv_lora_rank",),
    "qkRopeHeadDim": ("qk_rope_head_dim",),
    "maxPositionEmbeddings": ("max_position_embeddings",),
}

# A key missing from config.json takes the model class's default as transformers defines it
# (the engines load config.json through these classes: a DeepSeek-V3 config without
# n_shared_experts has one shared expert, not zero). model_type -> (config class, {field: (key, value)}).
# Read from transformers 5.24.0, models/<model_type>/configuration_<model_type>.py; only keys the class
# defines (Qwen3-MoE has no shared-expert count, so none is invented). tests/unit/operator/test_engine_rules.py
# checks every entry against the installed transformers.
TRANSFORMERS_READ = "5.24.0"
MODEL_DEFAULTS: dict[str, tuple[str, dict[str, tuple[str, int]]]] = {
    "deepseek_v2": ("DeepseekV2Config", {"numExperts": ("n_routed_experts", 64), "numSharedExperts": ("n_shared_experts", 2),
                                         "hiddenSize": ("hidden_size", 4096), "intermediateSize": ("intermediate_size", 11008),
                                         "moeIntermediateSize": ("moe_intermediate_size", 1407),
                                         "numLayers": ("num_hidden_layers", 32)}),
    "deepseek_v3": ("DeepseekV3Config", {"numExperts": ("n_routed_experts", 256), "expertsPerToken": ("num_experts_per_tok", 8),
                                         "numSharedExperts": ("n_shared_experts", 1), "hiddenSize": ("hidden_size", 7168),
                                         "intermediateSize": ("intermediate_size", 18432),
                                         "moeIntermediateSize": ("moe_intermediate_size", 2048),
                                         "numLayers": ("num_hidden_layers", 61)}),
    "deepseek_v32": ("DeepseekV32Config", {"numExperts": ("n_routed_experts", 256), "expertsPerToken": ("num_experts_per_tok", 8),
                                           "numSharedExperts": ("n_shared_experts", 1), "hiddenSize": ("hidden_size", 7168),
                                           "intermediateSize": ("intermediate_size", 18432),
                                           "moeIntermediateSize": ("moe_intermediate_size", 2048),
                                           "numLayers": ("num_hidden_layers", 61)}),
    "deepseek_v4": ("DeepseekV4Config", {"numExperts": ("n_routed_experts", 256), "expertsPerToken": ("num_experts_per_tok", 6),
                                         "numSharedExperts": ("n_shared_experts", 1), "hiddenSize": ("hidden_size", 4096),
                                         "moeIntermediateSize": ("moe_intermediate_size", 2048),
                                         "numLayers": ("num_hidden_layers", 43)}),
    "glm4_moe": ("Glm4MoeConfig", {"numExperts": ("n_routed_experts", 128), "expertsPerToken": ("num_experts_per_tok", 8),
                                   "numSharedExperts": ("n_shared_experts", 1), "hiddenSize": ("hidden_size", 4096),
                                   "intermediateSize": ("intermediate_size", 10944),
                                   "moeIntermediateSize": ("moe_intermediate_size", 1408), "numLayers": ("num_hidden_layers", 46)}),
    "glm_moe_dsa": ("GlmMoeDsaConfig", {"numExperts": ("n_routed_experts", 256), "expertsPerToken": ("num_experts_per_tok", 8),
                                        "numSharedExperts": ("n_shared_experts", 1), "hiddenSize": ("hidden_size", 6144),
                                        "intermediateSize": ("intermediate_size", 12288),
                                        "moeIntermediateSize": ("moe_intermediate_size", 2048),
                                        "numLayers": ("num_hidden_layers", 78)}),
    "kimi_linear": ("KimiLinearConfig", {"numExperts": ("num_experts", 256), "expertsPerToken": ("num_experts_per_tok", 8),
                                         "numSharedExperts": ("n_shared_experts", 1), "hiddenSize": ("hidden_size", 2304),
                                         "intermediateSize": ("intermediate_size", 9216),
                                         "moeIntermediateSize": ("moe_intermediate_size", 1024),
                                         "numLayers": ("num_hidden_layers", 27)}),
    "gpt_oss": ("GptOssConfig", {"numExperts": ("num_local_experts", 128), "expertsPerToken": ("num_experts_per_tok", 4),
                                 "hiddenSize": ("hidden_size", 2880), "intermediateSize": ("intermediate_size", 2880),
                                 "numLayers": ("num_hidden_layers", 36)}),
    "qwen2_moe": ("Qwen2MoeConfig", {"numExperts": ("num_experts", 60), "expertsPerToken": ("num_experts_per_tok", 4),
                                     "hiddenSize": ("hidden_size", 2048), "intermediateSize": ("intermediate_size", 5632),
                                     "moeIntermediateSize": ("moe_intermediate_size", 1408), "numLayers": ("num_hidden_layers", 24)}),
    "qwen3_moe": ("Qwen3MoeConfig", {"numExperts": ("num_experts", 128), "expertsPerToken": ("num_experts_per_tok", 8),
                                     "hiddenSize": ("hidden_size", 2048), "intermediateSize": ("intermediate_size", 6144),
                                     "moeIntermediateSize": ("moe_intermediate_size", 768), "numLayers": ("num_hidden_layers", 24)}),
    "qwen3_next": ("Qwen3NextConfig", {"numExperts": ("num_experts", 512), "expertsPerToken": ("num_experts_per_tok", 10),
                                       "hiddenSize": ("hidden_size", 2048), "intermediateSize": ("intermediate_size", 5632),
                                       "moeIntermediateSize": ("moe_intermediate_size", 512), "numLayers": ("num_hidden_layers", 48)}),
    "mixtral": ("MixtralConfig", {"numExperts": ("num_local_experts", 8), "expertsPerToken": ("num_experts_per_tok", 2),
                                  "hiddenSize": ("hidden_size", 4096), "intermediateSize": ("intermediate_size", 14336),
                                  "numLayers": ("num_hidden_layers", 32)}),
    "minimax_m2": ("MiniMaxM2Config", {"numExperts": ("num_local_experts", 256), "expertsPerToken": ("num_experts_per_tok", 8),
                                       "hiddenSize": ("hidden_size", 3072), "intermediateSize": ("intermediate_size", 1536),
                                       "numLayers": ("num_hidden_layers", 62)}),
    "llama4_text": ("Llama4TextConfig", {"numExperts": ("num_local_experts", 16), "expertsPerToken": ("num_experts_per_tok", 1),
                                         "hiddenSize": ("hidden_size", 5120), "intermediateSize": ("intermediate_size", 8192),
                                         "numLayers": ("num_hidden_layers", 48)}),
}

# The attention keys the KV-cache size needs, with the class defaults of the same transformers
# release (only keys the class defines; a class without head_dim derives it from hidden_size /
# num_attention_heads, as transformers does). Merged into MODEL_DEFAULTS, so the same test checks them.
ATTENTION_DEFAULTS: dict[str, dict[str, tuple[str, int]]] = {
    "deepseek_v2": {"numAttentionHeads": ("num_attention_heads", 32), "numKeyValueHeads": ("num_key_value_heads", 32),
                    "kvLoraRank": ("kv_lora_rank", 512), "qkRopeHeadDim": ("qk_rope_head_dim", 64),
                    "maxPositionEmbeddings": ("max_position_embeddings", 2048)},
    "deepseek_v3": {"numAttentionHeads": ("num_attention_heads", 128), "numKeyValueHeads": ("num_key_value_heads", 128),
                    "kvLoraRank": ("kv_lora_rank", 512), "qkRopeHeadDim": ("qk_rope_head_dim", 64),
                    "maxPositionEmbeddings": ("max_position_embeddings", 4096)},
    "deepseek_v32": {"numAttentionHeads": ("num_attention_heads", 128), "numKeyValueHeads": ("num_key_value_heads", 128),
                     "kvLoraRank": ("kv_lora_rank", 512), "qkRopeHeadDim": ("qk_rope_head_dim", 64),
                     "maxPositionEmbeddings": ("max_position_embeddings", 163840)},
    "deepseek_v4": {"numAttentionHeads": ("num_attention_heads", 64), "numKeyValueHeads": ("num_key_value_heads", 1),
                    "headDim": ("head_dim", 512), "maxPositionEmbeddings": ("max_position_embeddings", 1048576)},
    "glm4_moe": {"numAttentionHeads": ("num_attention_heads", 96), "numKeyValueHeads": ("num_key_value_heads", 8),
                 "maxPositionEmbeddings": ("max_position_embeddings", 131072)},
    "glm_moe_dsa": {"numAttentionHeads": ("num_attention_heads", 64), "numKeyValueHeads": ("num_key_value_heads", 64),
                    "kvLoraRank": ("kv_lora_rank", 512), "qkRopeHeadDim": ("qk_rope_head_dim", 64),
                    "maxPositionEmbeddings": ("max_position_embeddings", 202752)},
    "kimi_linear": {"numAttentionHeads": ("num_attention_heads", 32), "numKeyValueHeads": ("num_key_value_heads", 32),
                    "kvLoraRank": ("kv_lora_rank", 512), "qkRopeHeadDim": ("qk_rope_head_dim", 64),
                    "maxPositionEmbeddings": ("max_position_embeddings", 1048576)},
    "gpt_oss": {"numAttentionHeads": ("num_attention_heads", 64), "numKeyValueHeads": ("num_key_value_heads", 8),
                "headDim": ("head_dim", 64), "maxPositionEmbeddings": ("max_position_embeddings", 131072)},
    "qwen2_moe": {"numAttentionHeads": ("num_attention_heads", 16), "numKeyValueHeads": ("num_key_value_heads", 16),
                  "maxPositionEmbeddings": ("max_position_embeddings", 32768)},
    "qwen3_moe": {"numAttentionHeads": ("num_attention_heads", 32), "numKeyValueHeads": ("num_key_value_heads", 4),
                  "maxPositionEmbeddings": ("max_position_embeddings", 32768)},
    "qwen3_next": {"numAttentionHeads": ("num_attention_heads", 16), "numKeyValueHeads": ("num_key_value_heads", 2),
                   "headDim": ("head_dim", 256), "maxPositionEmbeddings": ("max_position_embeddings", 32768)},
    "mixtral": {"numAttentionHeads": ("num_attention_heads", 32), "numKeyValueHeads": ("num_key_value_heads", 8),
                "maxPositionEmbeddings": ("max_position_embeddings", 131072)},
    "minimax_m2": {"numAttentionHeads": ("num_attention_heads", 48), "numKeyValueHeads": ("num_key_value_heads", 8),
                   "headDim": ("head_dim", 128), "maxPositionEmbeddings": ("max_position_embeddings", 196608)},
    "llama4_text": {"numAttentionHeads": ("num_attention_heads", 40), "numKeyValueHeads": ("num_key_value_heads", 8),
                    "headDim": ("head_dim", 128), "maxPositionEmbeddings": ("max_position_embeddings", 131072)},
}
for _mt, _extra in ATTENTION_DEFAULTS.items():
    MODEL_DEFAULTS[_mt][1].update(_extra)


class InspectionError(Exception):
    """A checkpoint that cannot be inspected; the message names the file and the problem."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class QuantScheme(BaseModel):
    """An integer weight-only (WNA16) checkpoint's quantization parameters as config.json writes them: what the
    engines' GPTQ / AWQ / compressed-tensors MoE methods choose their kernels from (bits, group size, symmetry,
    activation order). None where the config does not say."""

    method: str = Field(description="quantization_config.quant_method: gptq | awq | compressed-tensors")
    bits: int | None = Field(None, description="weight bits (gptq/awq bits, compressed-tensors weights.num_bits)")
    groupSize: int | None = Field(None, description="weights per scale group; -1: one group per output channel")
    sym: bool | None = Field(None, description="symmetric weights (no zero points)")
    descAct: bool | None = Field(None, description="GPTQ desc_act (activation-order groups)")
    actorder: str | None = Field(None, description="compressed-tensors weights.actorder (group | weight)")
    zeroPoint: bool | None = Field(None, description="weights carry zero points (AWQ zero_point; GPTQ / "
                                                     "compressed-tensors: not symmetric)")
    checkpointFormat: str | None = Field(None, description="compressed-tensors format (pack-quantized, ...) or GPTQ "
                                                           "checkpoint_format")
    strategy: str | None = Field(None, description="compressed-tensors weights.strategy (group | channel)")


class CheckpointInfo(BaseModel):
    """What the planner and the runtime need to know about a checkpoint."""

    architecture: str = Field(description="config.json architectures[0]")
    modelType: str | None = Field(None, description=(
        "config.json model_type (e.g. deepseek_v3, qwen3_moe); picks the transformers class defaults for keys"
        " the config leaves out. Written by inspection, like every field here"))
    format: str = Field(description="checkpoint format, tuning-rules.md section 6 vocabulary")
    formatSource: str = Field(description="which file/key decided the format")
    quantMethod: str | None = Field(None, description="raw quant_method / quant_algo as written in the checkpoint")
    quantScheme: QuantScheme | None = Field(None, description=(
        "integer weight-only (GPTQ / AWQ / compressed-tensors WNA16) parameters from config.json quantization_config"))
    expertsFp4: bool = Field(False, description=(
        "true when the routed experts are stored in a 4-bit float format (NVFP4, MXFP4, DeepSeek-V4 FP4): the"
        " planner then needs an FP4-capable MoE runner and GPU"))
    numExperts: int | None = Field(None, description=(
        "routed experts per MoE layer (config.json n_routed_experts / num_experts / num_local_experts / "
        "moe_num_experts); unset or 0: a dense model"))
    expertsPerToken: int | None = Field(None, description=(
        "experts each token is routed to, top-k (config.json num_experts_per_tok / moe_topk / "
        "num_experts_per_token)"))
    numSharedExperts: int | None = Field(None, description=(
        "shared (always-active) experts per MoE layer (config.json n_shared_experts / num_shared_experts); "
        "unset where the model class has none"))
    hiddenSize: int | None = Field(None, description=(
        "model (residual stream) width in elements (config.json hidden_size)"))
    intermediateSize: int | None = Field(None, description=(
        "dense MLP intermediate width in elements (config.json intermediate_size; for some families also the "
        "expert width)"))
    moeIntermediateSize: int | None = Field(None, description=(
        "one routed expert's intermediate width in elements (config.json moe_intermediate_size); the size "
        "split over tensor-parallel ranks, so divisibility is checked on it"))
    weightBlockSize: list[int] | None = Field(None, description=(
        "config.json quantization_config.weight_block_size [n, k] (block-quantized checkpoints; sglang checks "
        "the MoE intermediate size per tensor-parallel rank against n at start-up)"))
    numLayers: int | None = Field(None, description=(
        "transformer layers (config.json num_hidden_layers); sizes the KV cache"))
    numAttentionHeads: int | None = Field(None, description=(
        "query heads per layer (config.json num_attention_heads); tensor parallelism splits attention by "
        "heads"))
    numKeyValueHeads: int | None = Field(None, description=(
        "key/value heads per layer (config.json num_key_value_heads, default num_attention_heads); k/v "
        "projections split over at most this many ranks"))
    headDim: int | None = Field(None, description=(
        "attention head size (config head_dim, else hidden_size / num_attention_heads)"))
    kvLoraRank: int | None = Field(None, description="MLA latent KV size (DeepSeek-family kv_lora_rank)")
    qkRopeHeadDim: int | None = Field(None, description=(
        "MLA rotary part of each query/key head in elements (DeepSeek-family qk_rope_head_dim); cached next "
        "to the latent KV"))
    maxPositionEmbeddings: int | None = Field(None, description=(
        "longest context the model supports, in tokens (config.json max_position_embeddings); the KV cache is"
        " sized for it unless the spec sets a context length"))
    kvCacheFp8: bool = Field(False, description=(
        "true when the checkpoint asks for an FP8 KV cache (kv_cache_quant_algo FP8 or an 8-bit float "
        "kv_cache_scheme; always for DeepSeek-V4): one byte per cached element instead of two"))
    totalBytes: int = Field(0, description=(
        "bytes of all weight tensors, summed from the safetensors headers (no weight data is read); what the "
        "GPU count is sized from. 0: no headers were read"))
    replicatedBytes: int = Field(0, description=(
        "bytes of the tensors every tensor-parallel rank holds whole (norms, MLA q_a/kv_a projections, MoE "
        "routers, MTP eh_proj; tp_placement()); 0 when unknown (then all bytes count as split evenly)"))
    kvHeadBytes: int = Field(0, description=(
        "bytes of the attention k_proj/v_proj tensors: split by KV heads, so over at most num_key_value_heads ranks"))
    numTensors: int = Field(0, description="tensors listed in the safetensors headers")
    numFiles: int = Field(0, description="safetensors files read (shards of the checkpoint)")
    notes: list[str] = Field(default_factory=list, description=(
        "what inspection assumed, in words: a transformers default taken for a key config.json lacks, a "
        "derived head size, an unexpected block size"))

    @property
    def is_moe(self) -> bool:
        return bool(self.numExperts)


# ---------------------------------------------------------------------------------------------
# I/O edge: local files


def read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InspectionError(path, f"cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise InspectionError(path, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InspectionError(path, f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except ValueError as e:  # an integer of more than 4300 digits (Python's int/str limit)
        raise InspectionError(path, f"invalid JSON: {e}") from None
    except RecursionError:
        raise InspectionError(path, "invalid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise InspectionError(path, f"expected a JSON object at the top level, found {type(data).__name__}")
    return data


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"number {text} overflows a float")
    return v


def _is_count(v: Any) -> bool:
    """A JSON integer >= 0 (not a bool, not 2.0): what safetensors' Rust parser reads as usize."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64


def _tensor_meta(name: str, meta: Any, data_len: int, where: str | Path) -> TensorMeta:
    """One header entry, typed as safetensors' own parser types it (dtype a string, shape and
    data_offsets unsigned integers), and its byte range consistent with its dtype and shape."""
    def bad(what: str) -> InspectionError:
        return InspectionError(where, f"corrupt safetensors header entry for tensor {name!r}: {what}")

    if not isinstance(meta, dict):
        raise bad(f"expected an object, found {type(meta).__name__}")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str) or not dtype:
        raise bad(f"dtype {dtype!r} is not a dtype name")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(x) for x in offsets):
        raise bad(f"data_offsets {offsets!r} is not a pair of non-negative integers")
    start, end = offsets
    if start > end:
        raise bad(f"data_offsets {offsets!r} end before they start")
    if end > data_len:
        raise InspectionError(where, f"truncated safetensors data: tensor {name!r} ends at byte {end} of the data section, which has {data_len}")
    numel = 1
    for d in shape:
        numel *= d
    size = _DTYPE_BYTES.get(dtype)
    # an unknown dtype name is left to the consumers (the runtime refuses it by its tensor specs)
    if size is not None and numel * size != end - start:
        raise bad(f"{dtype} {shape} is {numel * size:g} bytes but data_offsets {offsets!r} span {end - start}")
    return TensorMeta(name, dtype, tuple(shape), end - start)


def parse_safetensors_header(raw: bytes, file_size: int, where: str | Path) -> list[TensorMeta]:
    """Parse a safetensors header given the first bytes of the file (at least 8 + header length).

    As strict as safetensors' own parser, so every file accepted here is one the loader can read:
    no NaN/Infinity or overflowing numbers, typed entries, byte ranges that fit the dtype and shape
    and do not overlap."""
    if len(raw) < 8:
        raise InspectionError(where, f"truncated safetensors file: {file_size} bytes, the 8-byte header length is missing")
    (n,) = struct.unpack("<Q", raw[:8])
    if n == 0 or n > _MAX_HEADER_BYTES:
        raise InspectionError(where, f"invalid safetensors header length {n} (not a safetensors file?)")
    if len(raw) < 8 + n or file_size < 8 + n:
        raise InspectionError(where, f"truncated safetensors header: needs {n} bytes after the length, file has {max(file_size - 8, 0)}")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise InspectionError(where, "corrupt safetensors header (not JSON: nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, NaN/Infinity, 1e999, > 4300 digits
        raise InspectionError(where, f"corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise InspectionError(where, "corrupt safetensors header (not a JSON object)")
    if not isinstance(header.get("__metadata__", {}), dict):
        raise InspectionError(where, "corrupt safetensors header: __metadata__ is not an object")
    data_len = file_size - 8 - n
    tensors = [_tensor_meta(name, meta, data_len, where) for name, meta in header.items() if name != "__metadata__"]
    spans = sorted((tuple(header[t.name]["data_offsets"]), t.name) for t in tensors if t.nbytes)
    for ((_, prev_end), prev), ((start, _), name) in zip(spans, spans[1:]):
        if start < prev_end:
            raise InspectionError(where, f"corrupt safetensors header: tensors {prev!r} and {name!r} overlap in the data section")
    return tensors


def read_safetensors_header(path: Path) -> list[TensorMeta]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                head += f.read(min(n, _MAX_HEADER_BYTES))
    except OSError as e:
        raise InspectionError(path, f"cannot read: {e.strerror or e}") from None
    return parse_safetensors_header(head, size, path)


def inspect_dir(path: str | Path) -> CheckpointInfo:
    """Inspect a local Hugging Face-format checkpoint directory (headers only)."""
    root = Path(path)
    if not root.exists():
        raise InspectionError(root, "does not exist")
    if not root.is_dir():
        raise InspectionError(root, "is not a directory (expected a checkpoint directory with config.json)")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise InspectionError(root, "not a checkpoint directory: no config.json")
    config = read_json(cfg_path)
    hf_quant = read_json(root / "hf_quant_config.json") if (root / "hf_quant_config.json").is_file() else None
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise InspectionError(root, "no *.safetensors files (only safetensors checkpoints are supported)")
    tensors: list[TensorMeta] = []
    for f in files:
        tensors.extend(read_safetensors_header(f))
    info = classify(config, hf_quant, tensors, where=root)
    info.numFiles = len(files)
    return info


# ---------------------------------------------------------------------------------------------
# Pure classification


def _first_architecture(config: dict[str, Any], where: str | Path) -> str:
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise InspectionError(Path(where) / "config.json" if where else "config.json",
                              "missing or empty 'architectures' list (cannot tell the model family)")
    return archs[0]


def _modelopt_format(q: dict[str, Any]) -> tuple[str, str | None]:
    """ModelOpt flat or nested (`{"quantization": {...}}`) config -> (fmt, quant_algo)."""
    inner = q.get("quantization") if isinstance(q.get("quantization"), dict) else q
    algo = str(inner.get("quant_algo") or q.get("quant_algo") or "").upper()
    if algo == "MIXED_PRECISION":
        layers = inner.get("quantized_layers") or q.get("quantized_layers") or {}
        algos = {str(v.get("quant_algo", "")).upper(): k for k, v in layers.items() if isinstance(v, dict)}
        expert_algos = {str(v.get("quant_algo", "")).upper() for k, v in layers.items()
                        if isinstance(v, dict) and "expert" in k}
        if "W4A16_NVFP4" in (expert_algos or set(algos)):
            return "mixed_w4a16", algo
        if "NVFP4" in algos or "W4A16_NVFP4" in algos:
            return "mixed", algo
        return "w4afp8", algo
    if algo == "MXFP8":
        return "mxfp8", algo
    if "FP4" in algo:  # NVFP4, NVFP4_AWQ, W4A16_NVFP4
        return "nvfp4", algo
    if algo.startswith("FP8"):
        return "modelopt_fp8", algo
    return "other", algo or None


def _compressed_tensors_format(q: dict[str, Any]) -> str:
    fmt = str(q.get("format") or "")
    if fmt == "nvfp4-pack-quantized":
        return "ct_nvfp4"
    if fmt == "mxfp4-pack-quantized":
        return "ct_mxfp4_pack"
    for group in (q.get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        if (w.get("num_bits") == 4 and w.get("type") == "int" and w.get("strategy") == "group"
                and w.get("group_size") == 32):
            return "ct_int4_g32"
        if w.get("num_bits") == 4 and w.get("type") == "float":
            return "ct_nvfp4" if w.get("group_size") == 16 else "ct_mxfp4_pack"
    if _ct_weight_only_group(q) is not None:
        return "ct_wna16"
    return "other"


def _ct_weight_only_group(q: dict[str, Any]) -> dict[str, Any] | None:
    """The first compressed-tensors config group with integer weights and no input quantization (WNA16: the
    groups sglang's _is_wNa16_group_channel / vLLM's CompressedTensorsWNA16MoEMethod take), its `weights`."""
    for group in (q.get("config_groups") or {}).values():
        group = group or {}
        w = group.get("weights") or {}
        if w.get("type") == "int" and not group.get("input_activations") and w.get("strategy") in ("group", "channel"):
            return w
    return None


def _int(v: Any) -> int | None:
    return v if type(v) is int and -1 <= v < _MAX_FACT else None


def _bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _quant_scheme(fmt: str, q: dict[str, Any]) -> QuantScheme | None:
    """QuantScheme of a GPTQ / AWQ / compressed-tensors WNA16 quantization_config (None for other formats).
    Keys as AutoGPTQ/GPTQModel (bits, group_size, sym, desc_act, checkpoint_format), AutoAWQ (bits, group_size,
    zero_point) and compressed-tensors (config_groups.*.weights: num_bits, group_size, symmetric, actorder,
    strategy; format) write them."""
    if fmt == "gptq":
        sym = _bool(q.get("sym"))
        return QuantScheme(method="gptq", bits=_int(q.get("bits")), groupSize=_int(q.get("group_size")), sym=sym,
                           descAct=_bool(q.get("desc_act")), zeroPoint=None if sym is None else not sym,
                           checkpointFormat=q.get("checkpoint_format") if isinstance(q.get("checkpoint_format"), str)
                           else None)
    if fmt == "awq":
        zp = _bool(q.get("zero_point"))
        return QuantScheme(method="awq", bits=_int(q.get("bits") if "bits" in q else q.get("w_bit")),
                           groupSize=_int(q.get("group_size") if "group_size" in q else q.get("q_group_size")),
                           zeroPoint=zp, sym=None if zp is None else not zp)
    if fmt in ("ct_wna16", "ct_int4_g32"):
        w = _ct_weight_only_group(q) or {}
        sym = _bool(w.get("symmetric"))
        order = w.get("actorder")
        return QuantScheme(method="compressed-tensors", bits=_int(w.get("num_bits")),
                           groupSize=_int(w.get("group_size")) if w.get("group_size") is not None else -1,
                           sym=sym, zeroPoint=None if sym is None else not sym,
                           actorder=order if isinstance(order, str) else None,
                           descAct=order == "group" if order is None or isinstance(order, str) else None,
                           checkpointFormat=q.get("format") if isinstance(q.get("format"), str) else None,
                           strategy=w.get("strategy") if isinstance(w.get("strategy"), str) else None)
    return None


def _probe_routed_expert_dtype(tensors: list[TensorMeta]) -> str | None:
    for t in tensors:
        if _ROUTED_EXPERT_WEIGHT.search(t.name):
            return t.dtype
    return None


def _dsv4_format(config: dict[str, Any], q: dict[str, Any], hf_quant: dict[str, Any] | None,
                 tensors: list[TensorMeta], notes: list[str]) -> tuple[str, str]:
    moe_algo = str(q.get("moe_quant_algo") or "").upper()
    if moe_algo == "NVFP4":
        return "dsv4_nvfp4", "config.json quantization_config.moe_quant_algo=NVFP4 (hybrid FP8+NVFP4, nvfp4_moe_meta)"
    if q.get("routed_experts_quant_method") == "mxfp4":
        return "dsv4_fp4", "config.json quantization_config.routed_experts_quant_method=mxfp4"
    probed = _probe_routed_expert_dtype(tensors)
    if probed in ("U8", "I8", "F4"):
        return "dsv4_fp4", f"safetensors routed-expert weight dtype {probed} (packed E2M1, MXFP4 scales)"
    if probed == "F8_E4M3":
        return "dsv4_fp8", "safetensors routed-expert weight dtype F8_E4M3 (FP4 experts converted to FP8)"
    expert_dtype = config.get("expert_dtype")
    if expert_dtype in ("fp4", "fp8"):
        return f"dsv4_{expert_dtype}", f"config.json expert_dtype={expert_dtype}"
    notes.append("no routed-expert tensor found to probe; DeepSeek-V4 experts assumed FP4 (sglang SGLANG_DSV4_FP4_EXPERTS default)")
    return "dsv4_fp4", "DeepSeek-V4 default (SGLANG_DSV4_FP4_EXPERTS=True)"


# What every tensor-parallel rank holds whole, by the tensor's module name (the last part before the
# leaf): sglang, vLLM and the bundled runtime (moe_runtime.dist.shard.ShardPlan.rule) alike keep norms,
# the MLA down-projections (q_a_proj, kv_a_proj_with_mqa: ReplicatedLinear), MoE routers and the MTP
# eh_proj unsplit. The rest is split: attention by heads, dense MLPs and shared experts by their
# intermediate size, embeddings and the LM head by vocab, routed experts over ep x (tp / ep).
_WHOLE_MODULES = {"q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj_with_mqa", "eh_proj", "router",
                  "shared_expert_gate"}
_KV_HEAD_MODULES = {"k_proj", "v_proj"}


def tp_placement(name: str) -> str:
    """How tensor parallelism places one tensor, from its name: "whole" (every rank holds all of it),
    "kv-heads" (split by KV heads: over at most num_key_value_heads ranks) or "split" (over all ranks)."""
    parts = name.split(".")
    if ".experts." in name:  # routed experts (their per-expert scalars go with their expert)
        return "split"
    module = parts[-2] if len(parts) > 1 else ""
    if module.endswith("norm") or module in _WHOLE_MODULES or parts[-1] == "e_score_correction_bias":
        return "whole"
    if module == "gate" and (".mlp." in name or ".block_sparse_moe." in name):  # the MoE router
        return "whole"
    if module == "o_proj" and parts[-1] == "bias":  # added once after the all-reduce
        return "whole"
    if module in _KV_HEAD_MODULES and ".self_attn." in name:
        return "kv-heads"
    return "split"


def classify(config: dict[str, Any], hf_quant: dict[str, Any] | None, tensors: list[TensorMeta],
             where: str | Path = "") -> CheckpointInfo:
    arch = _first_architecture(config, where)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    cfg_file = Path(where) / "config.json" if where else Path("config.json")
    found = lambda *keys: next(((k, c[k]) for k in keys for c in (config, text) if c.get(k) is not None), (None, None))  # noqa: E731
    get = lambda *keys: found(*keys)[1]  # noqa: E731
    notes: list[str] = []
    qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else {}
    for key, v in (("model_type", config.get("model_type")), ("text_config.model_type", text.get("model_type")),
                   ("quantization_config.quant_method", qc.get("quant_method"))):
        if v is not None and not isinstance(v, str):
            raise InspectionError(cfg_file, f"{key} = {v!r}: expected a string")
    try:
        fmt, source, raw_method, kv_fp8 = _format_of(arch, config, hf_quant, tensors, notes)
    except (AttributeError, TypeError) as e:  # e.g. a list where the quantization config has an object
        raise InspectionError(cfg_file, "malformed quantization config (quantization_config, compression_config or "
                              f"hf_quant_config.json): {type(e).__name__}: {e}") from None
    if raw_method is not None and not isinstance(raw_method, str):
        raise InspectionError(cfg_file, f"quant_algo = {raw_method!r}: expected a string")

    model_type = text.get("model_type") if text.get("model_type") in MODEL_DEFAULTS else config.get("model_type")
    defaults = MODEL_DEFAULTS.get(model_type or "", ("", {}))

    def fact(field: str, *keys: str):
        key, v = found(*keys)
        if v is None and field in defaults[1]:
            key, v = defaults[1][field]
            notes.append(f"config.json has no {key}: {defaults[0]} default {key}={v} (transformers {TRANSFORMERS_READ})")
        if v is not None and not _is_count(v) or isinstance(v, int) and v >= _MAX_FACT:
            # typed here, not by pydantic: the message names the file, the key and the value
            raise InspectionError(cfg_file, f"{key} = {v!r}: expected an integer in 0..{_MAX_FACT - 1}")
        return v

    return CheckpointInfo(
        architecture=arch,
        modelType=config.get("model_type"),
        format=fmt,
        formatSource=source,
        quantMethod=raw_method,
        quantScheme=_quant_scheme(fmt, qc or (config.get("compression_config")
                                              if isinstance(config.get("compression_config"), dict) else {})),
        expertsFp4=is_fp4(fmt),
        numExperts=fact("numExperts", *CONFIG_KEYS["numExperts"]),
        expertsPerToken=fact("expertsPerToken", *CONFIG_KEYS["expertsPerToken"]),
        numSharedExperts=fact("numSharedExperts", *CONFIG_KEYS["numSharedExperts"]),
        hiddenSize=fact("hiddenSize", *CONFIG_KEYS["hiddenSize"]),
        intermediateSize=fact("intermediateSize", *CONFIG_KEYS["intermediateSize"]),
        moeIntermediateSize=fact("moeIntermediateSize", *CONFIG_KEYS["moeIntermediateSize"]),
        weightBlockSize=_weight_block_size(qc),
        numLayers=fact("numLayers", *CONFIG_KEYS["numLayers"]),
        **_attention_facts(fact, notes, get(*CONFIG_KEYS["hiddenSize"]) or defaults[1].get("hiddenSize", ("", None))[1]),
        kvCacheFp8=bool(kv_fp8) or arch in DEEPSEEK_V4_ARCHS,
        totalBytes=int(sum(t.nbytes for t in tensors)),
        replicatedBytes=int(sum(t.nbytes for t in tensors if tp_placement(t.name) == "whole")),
        kvHeadBytes=int(sum(t.nbytes for t in tensors if tp_placement(t.name) == "kv-heads")),
        numTensors=len(tensors),
        notes=notes,
    )


def _weight_block_size(q: dict[str, Any]) -> list[int] | None:
    """quantization_config.weight_block_size when it is a list of positive integers, else None."""
    b = q.get("weight_block_size")
    if isinstance(b, list) and b and all(type(x) is int and 0 < x < _MAX_FACT for x in b):
        return b
    return None


def _format_of(arch: str, config: dict[str, Any], hf_quant: dict[str, Any] | None, tensors: list[TensorMeta],
               notes: list[str]) -> tuple[str, str, str | None, bool]:
    """(format, which file/key decided it, raw quant method, KV cache fp8) per the lookup order above."""
    q = config.get("quantization_config")
    raw_method: str | None = None
    kv_fp8 = False

    if isinstance(q, dict) and q:
        method = q.get("quant_method")
        raw_method = method or q.get("quant_algo")
        if arch in DEEPSEEK_V4_ARCHS and (method in (None, "fp8", "modelopt") or q.get("moe_quant_algo")):
            fmt, source = _dsv4_format(config, q, hf_quant, tensors, notes)
        elif method is None or method == "modelopt":
            fmt, algo = _modelopt_format(q)
            raw_method = algo or raw_method
            source = f"config.json quantization_config (ModelOpt quant_algo={algo})"
        elif method == "compressed-tensors":
            fmt = _compressed_tensors_format(q)
            source = f"config.json quantization_config (compressed-tensors format={q.get('format')})"
        elif method in ("gptq", "awq"):
            fmt = method
            source = f"config.json quantization_config.quant_method={method}"
        elif method in ("fp8", "mxfp8", "mxfp4", "w4afp8"):
            fmt = method
            source = f"config.json quantization_config.quant_method={method}"
            if method == "fp8" and q.get("weight_block_size") not in (None, [128, 128]):
                notes.append(f"FP8 weight_block_size {q.get('weight_block_size')} (expected [128, 128])")
        else:
            fmt = "other"
            source = f"config.json quantization_config.quant_method={method} (no tuning rules for it)"
        kv_fp8 = str(q.get("kv_cache_quant_algo") or "").upper() == "FP8" or (
            isinstance(q.get("kv_cache_scheme"), dict) and q["kv_cache_scheme"].get("type") == "float"
            and q["kv_cache_scheme"].get("num_bits") == 8)
    elif isinstance(config.get("compression_config"), dict):
        q = config["compression_config"]
        raw_method = q.get("quant_method", "compressed-tensors")
        fmt = _compressed_tensors_format(q)
        source = "config.json compression_config (compressed-tensors)"
    elif hf_quant is not None:
        fmt, algo = _modelopt_format(hf_quant)
        raw_method = algo
        source = f"hf_quant_config.json (ModelOpt quant_algo={algo})"
        inner = hf_quant.get("quantization") if isinstance(hf_quant.get("quantization"), dict) else hf_quant
        kv_fp8 = str(inner.get("kv_cache_quant_algo") or "").upper() == "FP8"
    elif arch in DEEPSEEK_V4_ARCHS:
        fmt, source = _dsv4_format(config, {}, None, tensors, notes)
    else:
        probed = _probe_routed_expert_dtype(tensors)
        if probed == "F8_E4M3":
            fmt, source = "fp8", "no quantization config; routed-expert weights are F8_E4M3 in the safetensors header"
        else:
            fmt, source = "bf16", "no quantization_config, compression_config or hf_quant_config.json"

    return fmt, source, raw_method, bool(kv_fp8)


def _attention_facts(fact, notes: list[str], hidden: Any) -> dict[str, Any]:
    keys = ("numAttentionHeads", "numKeyValueHeads", "headDim", "kvLoraRank", "qkRopeHeadDim", "maxPositionEmbeddings")
    out = {k: fact(k, *CONFIG_KEYS[k]) for k in keys}
    heads = out["numAttentionHeads"]
    if out["numKeyValueHeads"] is None and heads is not None:
        out["numKeyValueHeads"] = heads  # transformers: num_key_value_heads defaults to num_attention_heads (MHA)
    if out["headDim"] is None and out["kvLoraRank"] is None and heads and isinstance(hidden, int):
        out["headDim"] = hidden // heads
        notes.append(f"config.json has no head_dim: hidden_size / num_attention_heads = {out['headDim']}")
    return {k: (int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None) for k, v in out.items()}
