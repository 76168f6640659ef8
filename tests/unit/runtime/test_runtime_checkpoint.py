"""make-checkpoint -> inspect round trip (4 formats x 2 architectures), on-disk layout details, and
the `inspect` / `probe` CLI contracts."""

import json

import pytest
from safetensors import safe_open

from moe_core.checkpoint import inspect_dir
from moe_runtime.checkpoint_writer import make_checkpoint
from moe_runtime.cli import main
from moe_runtime.loader import validate_checkpoint

ARCHS = {"deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    out = {}
    for arch in ARCHS:
        for fmt in ("bf16", "fp8", "nvfp4", "mxfp4"):
            out[arch, fmt] = make_checkpoint(root / f"{arch}-{fmt}", arch, fmt, "tiny")
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_round_trip_inspect_and_validate(ckpts, arch, fmt):
    info = inspect_dir(ckpts[arch, fmt])
    assert info.architecture == ARCHS[arch]
    assert info.format == fmt
    assert info.expertsFp4 == (fmt in ("nvfp4", "mxfp4"))
    assert info.numExperts == 8 and info.expertsPerToken == 2 and info.hiddenSize == 64
    assert info.numFiles > 1  # tiny checkpoints are sharded on purpose
    v = validate_checkpoint(ckpts[arch, fmt])  # the runtime's strict check accepts what it wrote
    assert v.expert_format == fmt and not v.ignored


def test_nvfp4_layout_is_modelopt(ckpts):
    d = ckpts["deepseek_v3", "nvfp4"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    assert cfg["quantization_config"]["quant_algo"] == "NVFP4" and cfg["quantization_config"]["group_size"] == 16
    hq = json.loads((d / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4" and "exclude_modules" in hq["quantization"]
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    p = "model.layers.1.mlp.experts.3.gate_proj."
    with safe_open(str(d / index[p + "weight"]), "pt") as f:
        assert f.get_slice(p + "weight").get_dtype() == "U8" and f.get_slice(p + "weight").get_shape() == [32, 32]
        assert f.get_slice(p + "weight_scale").get_dtype() == "F8_E4M3" and f.get_slice(p + "weight_scale").get_shape() == [32, 4]
        assert f.get_slice(p + "weight_scale_2").get_shape() == [] and f.get_slice(p + "input_scale").get_dtype() == "F32"
    with safe_open(str(d / index["model.layers.1.self_attn.q_a_proj.weight"]), "pt") as f:
        assert f.get_slice("model.layers.1.self_attn.q_a_proj.weight").get_dtype() == "BF16"  # attention stays bf16


def test_fp8_layout_is_deepseek_block(ckpts):
    d = ckpts["qwen3_moe", "fp8"]
    q = json.loads((d / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128]
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv" in index
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in index
    assert "model.layers.0.mlp.gate.weight_scale_inv" not in index  # the router stays unquantized


def test_mxfp4_layout(ckpts):
    d = ckpts["deepseek_v3", "mxfp4"]
    assert json.loads((d / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    p = "model.layers.2.mlp.experts.7.down_proj."
    with safe_open(str(d / index[p + "weight"]), "pt") as f:
        assert f.get_slice(p + "weight").get_shape() == [64, 16]  # [H, I/2]
        assert f.get_slice(p + "weight_scale").get_dtype() == "U8" and f.get_slice(p + "weight_scale").get_shape() == [64, 1]
    assert "model.layers.2.mlp.shared_experts.down_proj.weight_scale" not in index


def test_tokenizer_files_and_config(ckpts):
    from moe_runtime.tokenizer import Tokenizer

    d = ckpts["qwen3_moe", "bf16"]
    tok = Tokenizer(d)
    cfg = json.loads((d / "config.json").read_text())
    assert tok.vocab_size <= cfg["vocab_size"]
    assert tok.decode(tok.encode("Hello experts!")) == "Hello experts!"
    assert cfg["eos_token_id"] in tok.stop_ids
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_inspect_cli_writes_termination_log(ckpts, tmp_path, capsys):
    log = tmp_path / "termination-log"
    assert main(["inspect", str(ckpts["deepseek_v3", "nvfp4"]), "--termination-log", str(log)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "nvfp4" and out["architecture"] == "DeepseekV3ForCausalLM"
    assert json.loads(log.read_text())["format"] == "nvfp4"


def test_inspect_cli_error_exit_code(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 1  # bad input
    assert "does not exist" in capsys.readouterr().err


def test_make_checkpoint_cli(tmp_path):
    assert main(["make-checkpoint", "--arch", "qwen3_moe", "--format", "mxfp4", "--size", "tiny", str(tmp_path / "c")]) == 0
    assert inspect_dir(tmp_path / "c").format == "mxfp4"


def test_probe_without_gpu_says_so(monkeypatch, capsys):
    import moe_runtime.probe as probe
    from moe_runtime.errors import RuntimeFailure

    def no_gpu():
        raise RuntimeFailure("no NVIDIA GPU driver found on this machine (NVML: test)", exit_code=1)

    monkeypatch.setattr(probe, "probe_nvml", no_gpu)
    assert main(["probe"]) == 1
    assert "no NVIDIA GPU" in capsys.readouterr().err


def test_gpu_family_mapping():
    from moe_runtime.probe import gpu_family

    assert gpu_family(9, 0) == "sm90" and gpu_family(10, 0) == "sm100" and gpu_family(8, 6) == "sm80"
    assert gpu_family(12, 1) == "sm121" and gpu_family(8, 9) == "sm89"


def test_probe_annotations_are_read_back_by_the_operator(monkeypatch, capsys):
    import moe_runtime.probe as probe
    from moe_core.gpu import from_node_labels

    result = probe.ProbeResult(count=8, driverVersion="580.159.03", cudaDriverVersion="13.0", gpus=[
        probe.GpuInfo(i, "NVIDIA H200", "9.0", "sm90", 143771 * 1024 * 1024) for i in range(8)])
    ann = probe.node_annotations(result)
    assert ann["moe.serving.dev/gpu.product"] == "NVIDIA-H200" and ann["moe.serving.dev/gpu.family"] == "hopper"
    facts = from_node_labels({}, {}, ann)
    assert facts.gpu_class is not None, facts.reason
    assert facts.gpu_class.family == "sm90" and facts.gpu_class.count == 8 and facts.gpu_class.memoryMiB == 143771
    # the driver version reaches the planner's driver rules where GFD is absent
    assert ann["moe.serving.dev/cuda.driver-version.major"] == "580"
    assert facts.gpu_class.driverVersion == "580.159.03" and facts.gpu_class.driverMajor == 580
    # GFD's driver labels, when present, win over the probe's as a whole set
    gfd = from_node_labels({"nvidia.com/cuda.driver-version.major": "595", "nvidia.com/cuda.driver-version.minor": "58"},
                           {}, ann)
    assert gfd.gpu_class is not None and gfd.gpu_class.driverVersion == "595.58"

    patched = {}
    monkeypatch.setattr(probe, "probe_nvml", lambda: result)
    monkeypatch.setattr(probe, "annotate_node", lambda node, a: patched.update({node: a}))
    assert main(["probe", "--annotate-node", "gpu-node-1"]) == 0
    assert patched["gpu-node-1"] == ann
    assert json.loads(capsys.readouterr().out)["family"] == "sm90"
