"""`moe-operator download-model` as a real process against a local HTTP server speaking the hub API:
only the files engines read, progress lines, the ready marker, a resumed download after a kill -9,
gated repos with the token from the environment, failures with the cause."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hub_server import Hub  # noqa: E402

from moe_operator.download_cli import EXIT_CHECKSUM, EXIT_FAILED, EXIT_REFUSED, READY_MARKER  # noqa: E402

EXE = str(Path(sys.executable).parent / "moe-operator")
WEIGHTS = os.urandom(3 * 1024 * 1024 + 17)


def files(extra=None):
    f = {"config.json": json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}).encode(),
         "tokenizer.json": b'{"version": "1.0"}', "model-00001-of-00001.safetensors": WEIGHTS,
         "pytorch_model.bin": b"x" * 1000, "original/consolidated.pth": b"y" * 1000}
    f.update(extra or {})
    return f


@pytest.fixture
def hub():
    h = Hub()
    h.start()
    yield h
    h.stop()


def env(hub, tmp_path, **kw):
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf-home"), **kw)
    return e


def start(hub, tmp_path, repo, sha, **kw):
    cmd = [EXE, "download-model", "--repo", repo, "--revision", sha, "--dir", str(tmp_path / "cache"),
           "--interval", "0.2", "--termination-log", str(tmp_path / "term")]
    return subprocess.Popen(cmd, env=env(hub, tmp_path, **kw), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_downloads_only_what_engines_read_reports_progress_and_marks_ready(hub, tmp_path):
    sha = hub.upload("org/m", files())
    p = start(hub, tmp_path, "org/m", sha)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    cache = tmp_path / "cache"
    assert (cache / "model-00001-of-00001.safetensors").read_bytes() == WEIGHTS
    assert (cache / "tokenizer.json").is_file() and not (cache / "pytorch_model.bin").exists()
    assert not (cache / "original").exists()
    lines = [json.loads(x) for x in out.splitlines()]
    total = len(WEIGHTS) + len(files()["config.json"]) + len(files()["tokenizer.json"])
    assert all(x["bytesTotal"] == total for x in lines if "bytesTotal" in x)
    final = json.loads((tmp_path / "term").read_text())
    assert final["ready"] and final["revision"] == sha and final["bytesDone"] == total
    assert json.loads((cache / READY_MARKER).read_text())["revision"] == sha
    # a second run (a re-created Job) finds the marker and downloads nothing
    before = len(hub.requests)
    p = start(hub, tmp_path, "org/m", sha)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and json.loads(out.splitlines()[-1])["already"] and len(hub.requests) == before


def test_a_killed_download_resumes_with_a_range_request(hub, tmp_path):
    sha = hub.upload("org/m", files())
    hub.throttle = 1024 * 1024  # ~3 s for the weights
    p = start(hub, tmp_path, "org/m", sha)
    done = 0
    deadline = time.time() + 60
    while done < 256 * 1024 and time.time() < deadline:
        line = p.stdout.readline()
        if line.startswith("{"):
            done = json.loads(line).get("bytesDone", 0)
    assert done >= 256 * 1024, "no progress reported"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    assert not (tmp_path / "cache" / READY_MARKER).exists()
    hub.throttle = None
    p = start(hub, tmp_path, "org/m", sha)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert (tmp_path / "cache" / "model-00001-of-00001.safetensors").read_bytes() == WEIGHTS
    ranges = [r for m, path, r in hub.requests if m == "GET" and path.endswith(".safetensors") and r]
    assert ranges and int(ranges[-1].split("=")[1].split("-")[0]) > 0  # continued, not restarted


def test_gated_repo_needs_the_token_and_failures_say_why(hub, tmp_path):
    sha = hub.upload("org/gated", files(), token="sekret")
    p = start(hub, tmp_path, "org/gated", sha)
    p.communicate(timeout=60)
    assert p.returncode == EXIT_REFUSED  # 401: permanent, the Job fails at once (podFailurePolicy)
    term = json.loads((tmp_path / "term").read_text())
    assert "org/gated" in term["error"] and term["permanent"] is True and term["exitCode"] == EXIT_REFUSED
    p = start(hub, tmp_path, "org/gated", sha, HF_TOKEN="sekret")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    no_weights = hub.upload("org/empty", {"config.json": b"{}"})
    p = start(hub, tmp_path, "org/empty", no_weights)
    p.communicate(timeout=60)
    assert p.returncode == EXIT_REFUSED and "no *.safetensors" in json.loads((tmp_path / "term").read_text())["error"]


def test_the_operator_reads_the_programs_progress_lines(hub, tmp_path):
    from moe_operator.model_cache import _progress_from_log
    sha = hub.upload("org/m", files())
    hub.throttle = 2 * 1024 * 1024
    p = start(hub, tmp_path, "org/m", sha)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    lines = out.splitlines()
    mid = next(i for i, x in enumerate(lines) if 0 < json.loads(x).get("bytesDone", 0) < json.loads(x)["bytesTotal"])
    done, total = _progress_from_log("\n".join(["some log noise", *lines[:mid + 1]]))
    assert 0 < done < total == json.loads(lines[-1])["bytesTotal"]
    assert _progress_from_log("\n".join(lines)) == (total, total)
    assert _progress_from_log("no json here") == (None, None)


def test_a_file_that_is_not_the_hubs_fails_the_download_naming_it(hub, tmp_path):
    """The tree's lfs.oid (sha256) for weights, the git blob id for the rest: checked before a file
    takes its name; a mismatch deletes it and fails with the file's name; a retry fetches it again."""
    sha = hub.upload("org/m", files())
    weights = "model-00001-of-00001.safetensors"
    hub.corrupt("org/m", sha, weights)
    p = start(hub, tmp_path, "org/m", sha)
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_CHECKSUM, err  # the fill Job's podFailurePolicy fails the Job on it at once
    term = json.loads((tmp_path / "term").read_text())
    error = term["error"]
    assert term["permanent"] is True and term["exitCode"] == EXIT_CHECKSUM
    assert "ChecksumMismatch" in error and weights in error and "sha256" in error
    assert [m for m, path, _ in hub.requests if m == "GET" and path.endswith(weights)] == ["GET"]  # fetched once
    assert hashlib.sha256(WEIGHTS).hexdigest() in error
    cache = tmp_path / "cache"
    assert not (cache / weights).exists() and not (cache / READY_MARKER).exists()
    assert not list((cache / ".partial").rglob("*.part"))  # the bad bytes are gone, not resumed from
    hub.corrupted.clear()  # the retry (the Job's next pod) gets the right bytes
    p = start(hub, tmp_path, "org/m", sha)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert (cache / weights).read_bytes() == WEIGHTS
    # a small (non-LFS) file is checked against its git blob id
    sha2 = hub.upload("org/m2", files())
    hub.corrupt("org/m2", sha2, "tokenizer.json")
    (tmp_path / "two").mkdir()
    p = start(hub, tmp_path / "two", "org/m2", sha2)
    p.communicate(timeout=120)
    assert p.returncode == EXIT_CHECKSUM
    error = json.loads((tmp_path / "two" / "term").read_text())["error"]
    assert "tokenizer.json" in error and "git-sha1" in error


def test_expected_digest_reads_the_hubs_listing():
    from huggingface_hub.hf_api import RepoFile
    from hub_server import tree_entry

    from moe_operator.download_cli import expected_digest
    lfs = RepoFile(**tree_entry("a.safetensors", b"weights"))
    assert expected_digest(lfs) == ("sha256", hashlib.sha256(b"weights").hexdigest())
    small = RepoFile(**tree_entry("config.json", b"{}"))
    assert expected_digest(small) == ("git-sha1", "9e26dfeeb6e641a33dae4961196235bdb965b21b")  # git hash-object
    assert expected_digest(RepoFile(path="x", size=1, oid=None)) is None


def test_a_listed_file_the_hub_does_not_serve_is_permanent_a_5xx_is_retried(hub, tmp_path):
    """404 of a file the tree lists: EXIT_REFUSED at once (no retries of it). A hub answering 503
    for a file: retried with backoff within the run, then EXIT_FAILED (transient: the Job retries)."""
    sha = hub.upload("org/m", files())
    weights = "model-00001-of-00001.safetensors"
    hub.status_for[f"/org/m/resolve/{sha}/{weights}"] = 404  # the tree still lists it
    p = start(hub, tmp_path, "org/m", sha)
    p.communicate(timeout=60)
    term = json.loads((tmp_path / "term").read_text())
    assert p.returncode == EXIT_REFUSED, term
    assert weights in term["error"] and term["permanent"] is True
    assert len([1 for m, path, _ in hub.requests if m == "GET" and path.endswith(weights)]) == 1

    sha2 = hub.upload("org/flaky", files())
    hub.status_for[f"/org/flaky/resolve/{sha2}/{weights}"] = 503
    (tmp_path / "two").mkdir()
    p = start(hub, tmp_path / "two", "org/flaky", sha2)
    p.communicate(timeout=120)
    term = json.loads((tmp_path / "two" / "term").read_text())
    assert p.returncode == EXIT_FAILED, term
    assert "permanent" not in term and term["exitCode"] == EXIT_FAILED
    assert len([1 for m, path, _ in hub.requests if m == "GET" and path.endswith(weights) and "flaky" in path]) == 5
