"""Pinned revisions: hf://org/name resolves to the hub's commit at first use, through the real
huggingface_hub client against a local HTTP server speaking the hub API (HF_ENDPOINT)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hub_server import Hub  # noqa: E402

from moe_core.checkpoint import read_safetensors_header  # noqa: E402
from moe_core.gpu import from_name  # noqa: E402
from moe_operator import inspection  # noqa: E402
from moe_operator.api import MoEDeploymentSpec  # noqa: E402
from moe_operator.planner import plan  # noqa: E402
from moe_operator.render import Owner, render  # noqa: E402
from moe_operator.sample_checkpoints import write_sample  # noqa: E402


def repo_files(sample: str, tmp: Path) -> dict[str, bytes]:
    d = write_sample(sample, tmp / sample)
    files = {p.name: p.read_bytes() for p in d.iterdir()}
    st = next(p for p in d.iterdir() if p.suffix == ".safetensors")
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {t.name: st.name for t in read_safetensors_header(st)}}).encode()
    return files


@pytest.fixture
def hub(monkeypatch, tmp_path):
    import huggingface_hub.constants as c
    h = Hub()
    url = h.start()
    monkeypatch.setattr(c, "ENDPOINT", url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    inspection.reset()
    yield h
    h.stop()


def spec(uri, policy="pin"):
    return MoEDeploymentSpec.model_validate({"model": {"uri": uri, "revisionPolicy": policy}, "engine": {"name": "sglang"}})


def test_first_use_pins_the_sha_and_a_new_upload_changes_nothing(hub, tmp_path):
    sha1 = hub.upload("org/dsv3", repo_files("deepseek-v3-nvfp4", tmp_path))
    s = spec("hf://org/dsv3")
    p1 = inspection.pin(s, {})
    assert p1.revision == sha1 and p1.uri == f"hf://org/dsv3@{sha1}" and "first use" in p1.how
    info = inspection.inspect_spec(s.model_copy(update={"model": s.model.model_copy(update={"uri": p1.uri})}), hub=True)
    assert info.format == "nvfp4"
    assert inspection.cache_key(p1.uri).endswith(sha1)  # the sha is in the inspection cache key
    status = {"revision": p1.revision, "revisionUri": s.model.uri}

    sha2 = hub.upload("org/dsv3", repo_files("deepseek-v3-fp8", tmp_path))  # a new upload to main
    assert sha2 != sha1
    asked = len(hub.requests)
    again = inspection.pin(s, status)
    assert again.revision == sha1 and len(hub.requests) == asked  # pinned: not even a round trip
    # inspection of the pinned uri still sees the first commit's files (nvfp4), not the fp8 upload
    inspection._cache.clear()
    assert inspection.inspect_spec(s.model_copy(update={"model": s.model.model_copy(update={"uri": again.uri})}), hub=True).format == "nvfp4"

    # the spec changes (an explicit branch): re-resolved
    changed = inspection.pin(spec("hf://org/dsv3@main"), status)
    assert changed.revision == sha2
    # follow: the new upload is picked up once the last resolution is FOLLOW_RESOLVE_SECONDS old
    import time
    soon = inspection.pin(spec("hf://org/dsv3", policy="follow"), status)
    assert soon.revision == sha1  # resolved moments ago (first use): trusted for a while
    later = time.monotonic() + inspection.FOLLOW_RESOLVE_SECONDS + 1
    followed = inspection.pin(spec("hf://org/dsv3", policy="follow"), status, now=lambda: later)
    assert followed.revision == sha2 and followed.how.startswith("following")
    inspection._cache.clear()
    assert inspection.inspect_spec(spec(followed.uri), hub=True).format == "fp8"


def test_follow_keeps_the_pinned_sha_when_the_hub_is_down(hub, tmp_path):
    sha1 = hub.upload("org/m", repo_files("deepseek-v3-fp8", tmp_path))
    s = spec("hf://org/m", policy="follow")
    status = {"revision": sha1, "revisionUri": "hf://org/m"}
    hub.stop()
    kept = inspection.pin(s, status)
    assert kept.revision == sha1 and "unreachable" in kept.how
    with pytest.raises(inspection.InspectionFailed) as e:  # nothing pinned yet: the hub is needed
        inspection.pin(spec("hf://org/other"), {})
    assert e.value.reason == "HubError" and e.value.retry


def test_unknown_repo_and_gated_repo_are_clear_failures(hub, tmp_path):
    hub.upload("org/gated", repo_files("deepseek-v3-fp8", tmp_path), token="sekret")
    with pytest.raises(inspection.InspectionFailed) as e:
        inspection.pin(spec("hf://org/missing"), {})
    assert e.value.reason in ("NotFound", "Unauthorized") and not e.value.retry and "hf://org/missing" in e.value.message
    with pytest.raises(inspection.InspectionFailed) as e:
        inspection.pin(spec("hf://org/gated"), {})
    assert e.value.reason == "Unauthorized"
    ok = inspection.pin(spec("hf://org/gated"), {}, token=lambda: "sekret")
    assert ok.revision == hub.repos["org/gated"].refs["main"]


def test_sha_in_the_uri_needs_no_hub_and_reaches_the_pod(hub):
    sha = "0123456789abcdef0123456789abcdef01234567"
    p = inspection.pin(spec(f"hf://org/x@{sha}"), {})
    assert p.revision == sha and not hub.requests
    s = spec(p.uri)
    pl = plan(inspection.from_explicit_format(s.model_copy(update={"model": s.model.model_copy(
        update={"format": "fp8", "architecture": "DeepseekV3ForCausalLM"})})), from_name("H200"), engine="sglang")
    dep = next(o for o in render(Owner("x", "ns", "u"), s, pl, from_name("H200")) if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--revision") + 1] == sha
    assert {"name": "HF_REVISION", "value": sha} in c["env"]


def test_pvc_and_file_uris_are_not_pinned():
    assert inspection.pin(spec("pvc://models/dsv3"), {}) is None
    assert inspection.pin(spec("file:///models/dsv3"), {}) is None
