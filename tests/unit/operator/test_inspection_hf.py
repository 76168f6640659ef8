"""hf:// inspection: config.json + hf_quant_config.json + safetensors headers from the hub, never weights.

The hub is replaced by a stand-in at the two huggingface_hub calls the operator makes; the point is
what the operator does with the answers (classification, errors with causes)."""

import json
from types import SimpleNamespace

import pytest

from moe_operator import inspection
from moe_operator.api import MoEDeploymentSpec


@pytest.fixture
def hub(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.utils import EntryNotFoundError

    files = {}
    calls = []

    def download(repo, filename, revision=None, token=None, etag_timeout=None):
        calls.append((repo, filename, revision, token))
        if filename not in files:
            raise EntryNotFoundError(f"{filename} not found")
        p = tmp_path / filename
        p.write_text(files[filename])
        return str(p)

    class Api:
        def __init__(self, token=None):
            pass

        def get_safetensors_metadata(self, repo, revision=None, timeout=None):
            t = SimpleNamespace(dtype="U8", shape=[8, 8], data_offsets=[0, 64])
            return SimpleNamespace(files_metadata={"model-00001.safetensors": SimpleNamespace(
                tensors={"model.layers.3.mlp.experts.0.w1.weight": t})})

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    inspection.reset()
    return files, calls


def spec(uri, token=False):
    d = {"model": {"uri": uri}}
    if token:
        d["model"]["tokenSecretRef"] = {"name": "hf", "key": "token"}
    return MoEDeploymentSpec.model_validate(d)


def test_hf_dsv4_fp4_from_headers_with_revision_and_token(hub):
    files, calls = hub
    files["config.json"] = json.dumps({"architectures": ["DeepseekV4ForCausalLM"], "n_routed_experts": 256,
                                       "quantization_config": {"quant_method": "fp8"}})
    uri = "hf://deepseek-ai/DeepSeek-V4-Flash@abc123"
    info = inspection.inspect_spec(spec(uri, token=True), hub=True, hf_token=lambda: "tok")
    assert info.format == "dsv4_fp4" and "safetensors" in info.formatSource and info.totalBytes == 64
    assert calls[0] == ("deepseek-ai/DeepSeek-V4-Flash", "config.json", "abc123", "tok")
    # cached per (uri, revision, token access): the same token, no second round trip
    inspection.inspect_spec(spec(uri, token=True), hub=True, hf_token=lambda: "tok")
    assert len([c for c in calls if c[1] == "config.json"]) == 1
    # facts read with a token never reach a caller without it (issue 27 item 7): nor the webhook
    with pytest.raises(inspection.InspectionPending):
        inspection.inspect_spec(spec(uri))
    assert inspection.cached(uri) is None
    # another token, or none, asks the hub with its own access
    inspection.inspect_spec(spec(uri, token=True), hub=True, hf_token=lambda: "other")
    inspection.inspect_spec(spec(uri), hub=True)
    assert [c[3] for c in calls if c[1] == "config.json"] == ["tok", "other", None]
    # facts read without a token are public: any token gets them, the webhook too
    inspection.inspect_spec(spec(uri, token=True), hub=True, hf_token=lambda: "third")
    assert len([c for c in calls if c[1] == "config.json"]) == 3 and inspection.cached(uri)[1].format == "dsv4_fp4"


def test_hf_malformed_config_is_a_clear_failure(hub):
    files, _ = hub
    files["config.json"] = "{nope"
    with pytest.raises(inspection.InspectionFailed) as e:
        inspection.inspect_spec(spec("hf://org/broken"), hub=True)
    assert e.value.reason == "MalformedConfig" and "config.json" in e.value.message and not e.value.retry


def test_explicit_format_skips_inspection(hub):
    _, calls = hub
    s = MoEDeploymentSpec.model_validate({"model": {"uri": "hf://org/x", "format": "nvfp4",
                                                    "architecture": "DeepseekV3ForCausalLM"}})
    info = inspection.inspect_spec(s)
    assert info.format == "nvfp4" and info.architecture == "DeepseekV3ForCausalLM" and not calls
