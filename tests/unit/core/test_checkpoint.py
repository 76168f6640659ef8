"""Checkpoint inspection on directories the tests write (real dtypes and JSON, headers only)."""

import json
import struct

import pytest

from moe_core.checkpoint import InspectionError, inspect_dir
from moe_operator.sample_checkpoints import SAMPLES, write_safetensors, write_sample

EXPECTED = {
    "deepseek-v4-flash-fp4": ("DeepseekV4ForCausalLM", "dsv4_fp4", True),
    "deepseek-v4-pro-nvfp4": ("DeepseekV4ForCausalLM", "dsv4_nvfp4", True),
    "deepseek-v3-nvfp4": ("DeepseekV3ForCausalLM", "nvfp4", True),
    "deepseek-v3-fp8": ("DeepseekV3ForCausalLM", "fp8", False),
    "kimi-k2-fp8": ("DeepseekV3ForCausalLM", "fp8", False),
    "gpt-oss-120b-mxfp4": ("GptOssForCausalLM", "mxfp4", True),
    "qwen3-moe-235b-fp8": ("Qwen3MoeForCausalLM", "fp8", False),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_samples_classified(tmp_path, name):
    info = inspect_dir(write_sample(name, tmp_path / name))
    assert (info.architecture, info.format, info.expertsFp4) == EXPECTED[name]
    assert info.numExperts and info.totalBytes > 0 and info.numFiles == 1


def _ckpt(tmp_path, config, tensors=None, hf_quant=None):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    write_safetensors(tmp_path / "model.safetensors", tensors or {"x": ("BF16", [2, 2])})
    return tmp_path


BASE = {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 8, "n_shared_experts": 1}


def test_bf16_without_quant_config(tmp_path):
    info = inspect_dir(_ckpt(tmp_path, BASE))
    assert info.format == "bf16" and not info.expertsFp4


def test_hf_quant_config_nested_modelopt_nvfp4(tmp_path):
    info = inspect_dir(_ckpt(tmp_path, BASE, hf_quant={"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}}))
    assert info.format == "nvfp4" and info.kvCacheFp8 and "hf_quant_config.json" in info.formatSource


def test_config_quantization_config_wins_over_hf_quant_config(tmp_path):
    cfg = {**BASE, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    info = inspect_dir(_ckpt(tmp_path, cfg, hf_quant={"quantization": {"quant_algo": "NVFP4"}}))
    assert info.format == "fp8"


@pytest.mark.parametrize("q,fmt", [
    ({"quant_algo": "NVFP4"}, "nvfp4"),  # no quant_method -> ModelOpt
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "modelopt_fp8"),
    ({"quant_method": "modelopt", "quant_algo": "MXFP8"}, "mxfp8"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"model.layers.3.mlp.experts": {"quant_algo": "W4A16_NVFP4"}}}, "mixed_w4a16"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"model.layers.3.mlp.experts": {"quant_algo": "NVFP4"}}}, "mixed"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "w4afp8"),
    ({"quant_method": "mxfp4"}, "mxfp4"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "ct_nvfp4"),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}, "ct_mxfp4_pack"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}}}, "ct_int4_g32"),
    ({"quant_method": "awq"}, "awq"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}, "gptq"),
    ({"quant_method": "bitsandbytes"}, "other"),
])
def test_quantization_config_formats(tmp_path, q, fmt):
    assert inspect_dir(_ckpt(tmp_path, {**BASE, "quantization_config": q})).format == fmt


@pytest.mark.parametrize("dtype,fmt", [("U8", "dsv4_fp4"), ("I8", "dsv4_fp4"), ("F8_E4M3", "dsv4_fp8")])
def test_dsv4_expert_dtype_probe(tmp_path, dtype, fmt):
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "quantization_config": {"quant_method": "fp8"}}
    t = {"model.layers.1.mlp.experts.7.w2.weight": (dtype, [4, 4])}
    info = inspect_dir(_ckpt(tmp_path, cfg, t))
    assert info.format == fmt and "safetensors" in info.formatSource


def test_dsv4_routed_experts_quant_method(tmp_path):
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "quantization_config": {"quant_method": "fp8", "routed_experts_quant_method": "mxfp4"}}
    assert inspect_dir(_ckpt(tmp_path, cfg)).format == "dsv4_fp4"


# --- bad input: specific errors naming the file ---------------------------------------------

def test_not_a_directory(tmp_path):
    with pytest.raises(InspectionError, match="does not exist"):
        inspect_dir(tmp_path / "nope")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(InspectionError, match="is not a directory"):
        inspect_dir(f)


def test_no_config_json(tmp_path):
    with pytest.raises(InspectionError, match="no config.json"):
        inspect_dir(tmp_path)


def test_malformed_json_names_file_and_position(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["X"],\n "bad": }')
    with pytest.raises(InspectionError) as e:
        inspect_dir(tmp_path)
    assert "config.json" in str(e.value) and "line 2" in str(e.value)


def test_malformed_hf_quant_config(tmp_path):
    _ckpt(tmp_path, BASE)
    (tmp_path / "hf_quant_config.json").write_text("[1, 2")
    with pytest.raises(InspectionError, match="hf_quant_config.json: invalid JSON"):
        inspect_dir(tmp_path)


def test_missing_architectures(tmp_path):
    _ckpt(tmp_path, {"model_type": "x"})
    with pytest.raises(InspectionError, match="architectures"):
        inspect_dir(tmp_path)


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(InspectionError, match="no \\*.safetensors"):
        inspect_dir(tmp_path)


def test_truncated_safetensors_header(tmp_path):
    _ckpt(tmp_path, BASE)
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[:20])
    with pytest.raises(InspectionError) as e:
        inspect_dir(tmp_path)
    assert "model.safetensors" in str(e.value) and "truncated safetensors header" in str(e.value)


def test_truncated_safetensors_data(tmp_path):
    _ckpt(tmp_path, BASE, {"a": ("BF16", [64, 64])})
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[:-100])
    with pytest.raises(InspectionError, match="truncated safetensors data: tensor 'a'"):
        inspect_dir(tmp_path)


def test_garbage_safetensors(tmp_path):
    _ckpt(tmp_path, BASE)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"junk")
    with pytest.raises(InspectionError, match="invalid safetensors header length"):
        inspect_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(InspectionError, match="8-byte header length is missing"):
        inspect_dir(tmp_path)
