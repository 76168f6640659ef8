"""`moe-operator plan --model hf://org/name[@rev]` (issue 32 item 5): headers and configs from a
hub, through the operator's inspection code, against a local HTTP server speaking the hub API
(tests/hub_server.py) with the real huggingface_hub client. Never the weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hub_server import Hub  # noqa: E402

from moe_core.checkpoint import read_safetensors_header  # noqa: E402
from moe_operator.cli import main  # noqa: E402
from moe_operator.sample_checkpoints import write_sample  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


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
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield h
    h.stop()


def plan(argv, capsys):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return rc, out, err


def weights_read(hub) -> list:
    """GETs of a safetensors file's bytes past its header (a Range from 0 reads the header)."""
    return [r for r in hub.requests if r[0] == "GET" and r[1].endswith(".safetensors")
            and not (r[2] or "").startswith("bytes=0-")]


def test_plan_reads_a_hub_model_at_its_commit(hub, tmp_path, capsys):
    sha = hub.upload("org/dsv3", repo_files("deepseek-v3-nvfp4", tmp_path))
    rc, out, err = plan(["--model", "hf://org/dsv3", "--gpu", "B200", "--engine", "sglang"], capsys)
    assert rc == 0, err
    assert f"model       hf://org/dsv3 = hf://org/dsv3@{sha}" in out
    assert "DeepseekV3ForCausalLM" in out and "format=nvfp4" in out
    assert any(r[1].endswith(".safetensors") for r in hub.requests)  # the header was read...
    assert not weights_read(hub), hub.requests  # ...and nothing past it
    # the same plan as from the directory (the inspection code is the operator's, the facts the same)
    rc, local, _ = plan(["--checkpoint", str(tmp_path / "deepseek-v3-nvfp4"), "--gpu", "B200", "--engine", "sglang",
                         "-o", "json"], capsys)
    rc2, remote, _ = plan(["--model", f"hf://org/dsv3@{sha}", "--gpu", "B200", "--engine", "sglang", "-o", "json"], capsys)
    assert rc == rc2 == 0
    a, b = json.loads(local), json.loads(remote)
    assert a["decisions"] == b["decisions"] and a["env"] == b["env"] and a["moe"] == b["moe"]


def test_a_revision_is_resolved_and_named(hub, tmp_path, capsys):
    old = hub.upload("org/dsv3", repo_files("deepseek-v3-fp8", tmp_path))
    hub.upload("org/dsv3", repo_files("deepseek-v3-nvfp4", tmp_path))  # main moves on
    rc, out, err = plan(["--model", f"hf://org/dsv3@{old}", "--gpu", "H200", "--engine", "sglang"], capsys)
    assert rc == 0, err
    assert f"model       hf://org/dsv3@{old}\n" in out and "format=fp8" in out
    rc, out, _ = plan(["--model", "hf://org/dsv3@main", "--gpu", "B200", "--engine", "sglang"], capsys)
    assert rc == 0 and "format=nvfp4" in out


def test_gated_model_needs_hf_token(hub, tmp_path, capsys, monkeypatch):
    hub.upload("org/gated", repo_files("deepseek-v3-nvfp4", tmp_path), token="hf_secret")
    rc, out, err = plan(["--model", "hf://org/gated", "--gpu", "B200"], capsys)
    assert rc == 1 and out == ""
    assert err.startswith("error: hf://org/gated") and "set HF_TOKEN" in err and err.count("\n") == 1
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    rc, _, err = plan(["--model", "hf://org/gated", "--gpu", "B200"], capsys)
    assert rc == 1 and "HF_TOKEN" in err
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    rc, out, err = plan(["--model", "hf://org/gated", "--gpu", "B200"], capsys)
    assert rc == 0 and "format=nvfp4" in out, err


@pytest.mark.parametrize("argv,needle", [
    (["--model", "hf://org/missing"], "hf://org/missing"),
    (["--model", "hf://no-slash"], "not hf://org/name[@revision]"),
    (["--model", "s3://bucket/x"], "not hf://org/name[@revision]"),
    (["--model", "pvc://claim/x"], "copy it out and use --checkpoint"),
    (["--checkpoint", "hf://org/dsv3"], "use --model hf://org/dsv3"),
])
def test_bad_models_are_one_error_line(hub, argv, needle, capsys):
    rc, out, err = plan([*argv, "--gpu", "H200"], capsys)
    assert rc == 1 and out == "" and needle in err and err.count("\n") == 1, err


def test_model_and_checkpoint_exclude_each_other(capsys):
    rc, _, err = plan(["--model", "hf://a/b", "--checkpoint", "/x", "--gpu", "H200"], capsys)
    assert rc == 3 and "not allowed with" in err
    rc, _, err = plan(["--gpu", "H200"], capsys)
    assert rc == 3 and "--checkpoint" in err and "--model" in err


def test_the_command_line_reads_hf_endpoint_and_hf_token(tmp_path):
    """The installed command as a user runs it: HF_ENDPOINT and HF_TOKEN from the environment."""
    h = Hub()
    url = h.start()
    try:
        h.upload("org/gated", repo_files("deepseek-v3-nvfp4", tmp_path), token="hf_secret")
        env = {**os.environ, "HF_ENDPOINT": url, "HF_TOKEN": "hf_secret", "HF_HUB_DISABLE_XET": "1",
               "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HUB_OFFLINE": "0"}
        r = subprocess.run([sys.executable, "-m", "moe_operator.cli", "plan", "--model", "hf://org/gated", "--gpu", "B200",
                            "-o", "json"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["decisions"]
    finally:
        h.stop()
