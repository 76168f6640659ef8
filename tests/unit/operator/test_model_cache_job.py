"""The model cache Job's container and the engine pod's ready check, run on this machine exactly as
rendered (kwok runs no containers): the command, args and env of model_cache.fill_job() with each
volume's mountPath mapped to a local directory, against the local hub server (HF_ENDPOINT from the
Job's own env, the token through its secretKeyRef); a pvc:// model copied to the cache with
`download-model --from`; then the init container's marker check of pod_parts() on the result."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hub_server import Hub  # noqa: E402

from moe_operator import model_cache  # noqa: E402
from moe_operator.api import MoEDeploymentSpec  # noqa: E402
from moe_operator.download_cli import EXIT_CHECKSUM, EXIT_FAILED, EXIT_REFUSED, EXIT_UNREADABLE, READY_MARKER  # noqa: E402
from moe_operator.render import model_location  # noqa: E402
from moe_operator.sample_checkpoints import write_sample  # noqa: E402

EXE = {"moe-operator": str(Path(sys.executable).parent / "moe-operator")}


@pytest.fixture
def hub():
    h = Hub()
    h.start()
    yield h
    h.stop()


def spec(uri, token=False, **cache):
    m = {"uri": uri, "cache": {"enabled": True, **cache}}
    if token:
        m["tokenSecretRef"] = {"name": "hf", "key": "tok"}
    return MoEDeploymentSpec.model_validate({"model": m, "engine": {"name": "sglang"}})


def run_here(container, dirs, tmp_path, secrets=None, env_extra=None):
    argv, env = model_cache.local_invocation(container, {k: str(v) for k, v in dirs.items()}, secrets, EXE)
    argv = [str(tmp_path / "term") if a == "/dev/termination-log" else a for a in argv]
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run(argv, env={**base, "HF_HUB_DISABLE_XET": "1", **env, **(env_extra or {})},
                          capture_output=True, text=True, timeout=120)


def checkpoint_files(tmp_path):
    d = write_sample("deepseek-v3-nvfp4", tmp_path / "ck")
    return {p.name: p.read_bytes() for p in d.iterdir()}


def test_the_rendered_fill_job_downloads_the_pinned_commit_and_the_pods_check_passes(hub, tmp_path):
    files = checkpoint_files(tmp_path)
    sha = hub.upload("org/dsv3", files, token="sekret")
    hub.upload("org/dsv3", {**files, "config.json": b"{}"})  # main moved on: the Job fetches the pinned sha
    s = spec(f"hf://org/dsv3@{sha}", token=True)
    job = model_cache.fill_job("ns", s, "img:1", hf_endpoint=hub.url)
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "HF_ENDPOINT", "value": hub.url} in c["env"]
    cache, home = tmp_path / "cache", tmp_path / "home"
    home.mkdir()
    r = run_here(c, {"model-cache": cache, "tmp": home}, tmp_path, secrets={("hf", "tok"): "sekret"})
    assert r.returncode == 0, r.stderr + r.stdout
    assert (cache / "config.json").read_bytes() == files["config.json"]
    st = next(n for n in files if n.endswith(".safetensors"))
    assert (cache / st).read_bytes() == files[st]
    marker = json.loads((cache / READY_MARKER).read_text())
    assert marker["revision"] == sha and marker["bytesDone"] == marker["bytesTotal"] > 0
    assert json.loads((tmp_path / "term").read_text())["ready"] is True
    # without the Secret's value the gated repo refuses, and the Job says so
    r = run_here(c, {"model-cache": tmp_path / "other", "tmp": home}, tmp_path)
    assert r.returncode == EXIT_REFUSED and "org/dsv3" in json.loads((tmp_path / "term").read_text())["error"]

    # the engine pod's init container accepts this cache, and refuses one without the marker
    parts = model_cache.pod_parts(s, "img:1")
    check = parts.init_container
    assert run_here(check, {"model-cache": cache}, tmp_path).returncode == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_here(check, {"model-cache": empty}, tmp_path)
    assert r.returncode == 1 and f"no ready marker for {sha}" in r.stderr
    other = spec(f"hf://org/dsv3@{'f' * 40}")
    assert run_here(model_cache.pod_parts(other, "img:1").init_container, {"model-cache": cache},
                    tmp_path).returncode == 1  # a marker of another revision is not this cache


def test_a_pvc_model_is_copied_to_the_cache_when_asked_and_pods_mount_the_copy(tmp_path):
    s = spec("pvc://models/deepseek/v3", storageClassName="fast-nvme")
    assert model_cache.enabled(s)
    assert not model_cache.enabled(model_cache.with_defaults(
        MoEDeploymentSpec.model_validate({"model": {"uri": "pvc://models/deepseek/v3"}}), True, "fast"))  # only when asked
    claim = model_cache.pvc("ns", s, None)
    assert claim["spec"]["storageClassName"] == "fast-nvme"
    assert claim["metadata"]["annotations"] == {"moe.serving.dev/model": "pvc://models/deepseek/v3",
                                                "moe.serving.dev/revision": "pvc://models/deepseek/v3"}
    job = model_cache.fill_job("ns", s, "img:1", hf_endpoint="http://mirror")
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["moe-operator", "download-model", "--from", "/models/source/deepseek/v3",
                            "--revision", "pvc://models/deepseek/v3", "--dir", model_cache.MOUNT,
                            "--termination-log", "/dev/termination-log"]
    assert {"name": "model-source", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert {"name": "model-source", "mountPath": "/models/source", "readOnly": True} in c["volumeMounts"]
    assert not any(e["name"] in ("HF_ENDPOINT", "HF_TOKEN") for e in c["env"])

    src = tmp_path / "claim"
    write_sample("deepseek-v3-nvfp4", src / "deepseek" / "v3")
    (src / "deepseek" / "v3" / "notes.bin").write_bytes(b"x" * 100)  # not what engines read
    cache, home = tmp_path / "cache", tmp_path / "home"
    home.mkdir()
    r = run_here(c, {"model-cache": cache, "model-source": src, "tmp": home}, tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    for p in (src / "deepseek" / "v3").iterdir():
        if p.suffix != ".bin":
            assert (cache / p.name).read_bytes() == p.read_bytes()
    assert not (cache / "notes.bin").exists()
    progress = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert progress[-1]["ready"] and progress[-1]["revision"] == "pvc://models/deepseek/v3"
    assert run_here(model_cache.pod_parts(s, "img:1").init_container, {"model-cache": cache}, tmp_path).returncode == 0

    loc = model_location(s, "sglang", "img:1")
    assert loc.path == model_cache.MOUNT and loc.volumes[0]["persistentVolumeClaim"] == {
        "claimName": claim["metadata"]["name"], "readOnly": True}
    assert loc.extra_args == []  # the served name is spec.model.servedName (default: the object's name), render.served_name
    plain = model_location(MoEDeploymentSpec.model_validate({"model": {"uri": "pvc://models/deepseek/v3"}}), "sglang", "i")
    assert plain.path == "/models/models/deepseek/v3" and not plain.init_containers


def test_a_copy_resumes_from_its_part_file(tmp_path):
    src = tmp_path / "src"
    write_sample("deepseek-v3-nvfp4", src)
    big = src / "model-big.safetensors"
    big.write_bytes(os.urandom(1 << 20))
    cache = tmp_path / "cache"
    part = cache / ".partial" / "model-big.safetensors.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(big.read_bytes()[:300_000])  # what a killed copy left
    r = subprocess.run([EXE["moe-operator"], "download-model", "--from", str(src), "--revision", "pvc://c/x",
                        "--dir", str(cache), "--interval", "0.1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (cache / "model-big.safetensors").read_bytes() == big.read_bytes() and not part.exists()
    r = subprocess.run([EXE["moe-operator"], "download-model", "--from", str(tmp_path / "nothing"), "--revision",
                        "pvc://c/y", "--dir", str(tmp_path / "c2")], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_REFUSED and "no *.safetensors" in r.stdout.splitlines()[-1]


class FakeKube:
    """What model_cache.ensure() calls, in memory; the Job's pod is the real program run here."""

    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.termination: dict | None = None
        self.log = ""

    def get(self, kind, ns, name):
        return self.objects.get((kind, ns, name))

    def apply(self, obj):
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        stored = json.loads(json.dumps(obj))
        stored["metadata"]["uid"] = (self.objects.get(key) or {}).get("metadata", {}).get("uid") or f"uid-{len(self.objects)}"
        self.objects[key] = stored
        return stored

    def create(self, obj):
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        return None if key in self.objects else self.apply(obj)

    def landed(self, obj, kind=None):
        return None  # this fake's creates are always answered (test_kube_create_token.py: lost answers)

    def list_moeds(self, namespaces=None):
        return []

    def merge_patch_metadata(self, kind, ns, name, patch):
        meta = self.objects[(kind, ns, name)]["metadata"]
        for part in ("labels", "annotations"):
            for k, v in (patch.get(part) or {}).items():
                if v is None:
                    (meta.get(part) or {}).pop(k, None)
                else:
                    meta.setdefault(part, {})[k] = v

    def job_termination_message(self, ns, job):
        return self.termination

    def job_log_tail(self, ns, job):
        return self.log


def test_the_operator_reports_a_checksum_mismatch_of_its_job_naming_the_file(hub, tmp_path):
    """ensure(): the Job created, its progress lines as Downloading, then a failed Job whose pod left
    the program's own termination message (a corrupted weights file) as Failed with the file's name."""
    files = checkpoint_files(tmp_path)
    sha = hub.upload("org/dsv3", files)
    st = next(n for n in files if n.endswith(".safetensors"))
    hub.corrupt("org/dsv3", sha, st)
    s = spec(f"hf://org/dsv3@{sha}")
    kube = FakeKube()
    first = model_cache.ensure(kube, "ns", "alpha", s, None, "img:1")
    assert first.state == "Pending" and "created" in first.message
    job = kube.get("Job", "ns", f"{first.claimName}-fill")
    c = job["spec"]["template"]["spec"]["containers"][0]
    home = tmp_path / "home"
    home.mkdir()
    r = run_here(c, {"model-cache": tmp_path / "cache", "tmp": home}, tmp_path, env_extra={"HF_ENDPOINT": hub.url})
    # the exit code is one the Job's podFailurePolicy fails the Job on, without a retry
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and r.returncode == EXIT_CHECKSUM in rule["onExitCodes"]["values"]
    kube.log = r.stdout  # the pod's log while it ran
    assert model_cache.ensure(kube, "ns", "alpha", s, None, "img:1").state == "Downloading"
    job["status"] = {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                                                  "message": "Container download for pod ns/x failed with exit code 4 "
                                                             "matching FailJob rule at index 0"}]}
    kube.termination = json.loads((tmp_path / "term").read_text())
    failed = model_cache.ensure(kube, "ns", "alpha", s, None, "img:1")
    assert failed.state == "Failed" and st in failed.message and "ChecksumMismatch" in failed.message
    assert "exit code 4: a permanent error, the Job failed without retrying" in failed.message
    assert f"delete Job {first.claimName}-fill" in failed.message
    # a transient failure that used up the Job's retries says so
    kube.termination = {"error": "download of org/dsv3 failed: ConnectError: refused", "exitCode": 1}
    job["status"] = {"failed": 7, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    again = model_cache.ensure(kube, "ns", "alpha", s, None, "img:1")
    assert again.state == "Failed" and "ConnectError" in again.message and "after 7 attempts" in again.message


def test_the_fill_job_fails_at_once_on_permanent_exit_codes_and_retries_the_rest():
    """podFailurePolicy: FailJob on download-model's permanent exit codes (checksum, hub refused,
    unreadable source), evictions not counted; restartPolicy Never (the API server refuses a
    podFailurePolicy with OnFailure); the same for a pvc:// copy Job."""
    for s in (spec(f"hf://org/m@{'a' * 40}"), spec("pvc://models/m")):
        job = model_cache.fill_job("ns", s, "img:1")
        pod = job["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        assert job["spec"]["backoffLimit"] == 6  # transient errors (network, 5xx) are retried
        rules = job["spec"]["podFailurePolicy"]["rules"]
        assert rules[0] == {"action": "FailJob", "onExitCodes": {"containerName": "download", "operator": "In",
                                                                 "values": [EXIT_CHECKSUM, EXIT_REFUSED, EXIT_UNREADABLE]}}
        assert rules[1] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
        assert pod["containers"][0]["name"] == "download"
        assert EXIT_FAILED not in rules[0]["onExitCodes"]["values"] and 0 not in rules[0]["onExitCodes"]["values"]
        assert pod["securityContext"]["runAsUser"] == 65532 and pod["securityContext"]["runAsNonRoot"] is True


def _as_non_root(argv):
    """argv run as uid/gid 65532 (the copy Job's) when this test runs as root (root reads every
    file, so an unreadable one needs another uid); as this user otherwise."""
    if os.getuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    if not setpriv:
        pytest.skip("running as root without setpriv: cannot read a file as another uid")
    return [setpriv, "--reuid", "65532", "--regid", "65532", "--clear-groups", *argv]


def test_a_copy_refuses_a_source_file_it_cannot_read_before_copying_anything():
    """A pvc:// source whose weights file is root-owned mode 0600 (unreadable to the copy Job's
    uid 65532 through the read-only mount): exit EXIT_UNREADABLE (the Job's podFailurePolicy fails
    it at once) before any byte is copied, naming the file, its owner and mode and the fix; a folder
    without r-x is refused too (a walk would skip it and mark a partial copy ready); once readable
    the same run copies everything. Run as uid 65532 for real (setpriv) when the test runs as root."""
    base = Path(tempfile.mkdtemp(prefix="moe-copy-"))
    try:
        base.chmod(0o755)
        src, cache = base / "src", base / "cache"
        write_sample("deepseek-v3-nvfp4", src)
        for p in [src, *src.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        cache.mkdir()
        (base / "log").mkdir()
        if os.getuid() == 0:
            os.chown(cache, 65532, 65532)  # what fsGroup gives the Job on the cache PVC
            os.chown(base / "log", 65532, 65532)
        weights = sorted(p.name for p in src.iterdir() if p.suffix == ".safetensors")[-1]
        (src / weights).chmod(0o600 if os.getuid() == 0 else 0o000)
        argv = _as_non_root([EXE["moe-operator"], "download-model", "--from", str(src), "--revision", "pvc://c/x",
                             "--dir", str(cache), "--interval", "0.1", "--termination-log", str(base / "log" / "term")])
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == EXIT_UNREADABLE, r.stdout + r.stderr
        term = json.loads((base / "log" / "term").read_text())
        error = term["error"]
        assert term["permanent"] is True and term["exitCode"] == EXIT_UNREADABLE
        assert f"file {weights} of {src} cannot be read" in error and "Permission denied" in error
        assert "mode 0600" in error or "mode 0000" in error
        assert "chmod -R a+rX" in error and "non-root uid 65532" in error
        assert not [p for p in cache.rglob("*") if p.is_file()]  # checked before anything was copied

        (src / weights).chmod(0o644)
        sub = src / "extra"
        sub.mkdir()
        (sub / "more.json").write_text("{}")
        sub.chmod(0o700 if os.getuid() == 0 else 0o000)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == EXIT_UNREADABLE, r.stdout + r.stderr
        assert "folder extra of" in json.loads((base / "log" / "term").read_text())["error"]

        sub.chmod(0o755)
        src.chmod(0o700 if os.getuid() == 0 else 0o000)  # the model folder itself
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == EXIT_UNREADABLE and "folder . of" in json.loads((base / "log" / "term").read_text())["error"]

        src.chmod(0o755)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert (cache / weights).read_bytes() == (src / weights).read_bytes()
        assert (cache / "extra" / "more.json").read_text() == "{}"
    finally:
        for p in [base, *base.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_a_group_readable_source_is_read_with_the_charts_copy_groups():
    """Model files root:2000 mode 0640: the copy as uid 65532 alone refuses them, and the message
    names the chart value that fixes it (modelCache.copySupplementalGroups: [2000]); the copy Job
    of a pvc:// model gets those groups as supplementalGroups (non-root all the same), and run
    with that group the same copy succeeds. A hub download Job never gets them."""
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to own files by another group and run as uid 65532")
    s = spec("pvc://models/m")
    job = model_cache.fill_job("ns", s, "img:1", copy_groups=(2000, 2000))
    ctx = job["spec"]["template"]["spec"]["securityContext"]
    assert ctx["supplementalGroups"] == [2000] and ctx["runAsUser"] == 65532 and ctx["runAsNonRoot"] is True
    hub_job = model_cache.fill_job("ns", spec(f"hf://org/m@{'a' * 40}"), "img:1", copy_groups=(2000,))
    assert "supplementalGroups" not in hub_job["spec"]["template"]["spec"]["securityContext"]
    assert "supplementalGroups" not in model_cache.fill_job("ns", s, "img:1")["spec"]["template"]["spec"]["securityContext"]

    base = Path(tempfile.mkdtemp(prefix="moe-copy-grp-"))
    try:
        base.chmod(0o755)
        src, cache = base / "src", base / "cache"
        write_sample("deepseek-v3-nvfp4", src)
        src.chmod(0o755)
        for p in src.iterdir():
            os.chown(p, 0, 2000)
            p.chmod(0o640)
        cache.mkdir()
        os.chown(cache, 65532, 65532)
        cmd = [EXE["moe-operator"], "download-model", "--from", str(src), "--revision", "pvc://c/x", "--dir", str(cache)]
        as_job = ["setpriv", "--reuid", "65532", "--regid", "65532"]
        r = subprocess.run([*as_job, "--clear-groups", *cmd], capture_output=True, text=True, timeout=60)
        assert r.returncode == EXIT_UNREADABLE, r.stdout + r.stderr
        error = json.loads(r.stdout.splitlines()[-1])["error"]
        assert "mode 0640" in error and "modelCache.copySupplementalGroups: [2000]" in error
        groups = ",".join(map(str, ctx["supplementalGroups"]))
        r = subprocess.run([*as_job, "--groups", groups, *cmd], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads((cache / READY_MARKER).read_text())["revision"] == "pvc://c/x"
    finally:
        shutil.rmtree(base, ignore_errors=True)


class GcKube(FakeKube):
    def list_labeled(self, kind, ns, selector):
        want = dict(p.split("=") for p in selector.split(","))
        return [o for (k, n, _), o in self.objects.items() if k == kind and n == ns
                and all((o["metadata"].get("labels") or {}).get(key) == v for key, v in want.items())]

    def delete(self, kind, ns, name):
        self.objects.pop((kind, ns, name), None)


def _hf_spec():
    return MoEDeploymentSpec.model_validate({"model": {"uri": "hf://org/m@" + "a" * 40, "cache": {"enabled": True}}})


def test_a_cache_pvc_or_job_the_operator_did_not_make_is_not_used(monkeypatch):
    monkeypatch.setattr(model_cache, "RECORD", model_cache.Record())
    kube, s = GcKube(), _hf_spec()
    claim = model_cache.source(s).claim
    kube.apply({"kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": "ns", "annotations": {
        model_cache.A_READY: json.dumps({"revision": "a" * 40})}}})  # a tenant's, with a forged ready marker
    st = model_cache.ensure(kube, "ns", "u", s, None, "img:1")
    assert st.state == "Failed" and "did not make it" in st.message and ("Job", "ns", claim + "-fill") not in kube.objects
    # the operator's own PVC, but a tenant's Job of the fill Job's name: its result is not trusted
    kube.objects.clear()
    kube.apply({"kind": "Job", "metadata": {"name": claim + "-fill", "namespace": "ns"}, "status": {"succeeded": 1}})
    st = model_cache.ensure(kube, "ns", "u", s, None, "img:1")
    assert st.state == "Failed" and f"Job {claim}-fill exists but the operator did not make it" in st.message
    assert model_cache.A_READY not in (kube.get("PersistentVolumeClaim", "ns", claim)["metadata"].get("annotations") or {})


def test_the_gc_deletes_only_its_own_caches_on_its_own_clock(monkeypatch):
    import datetime as dt

    monkeypatch.setattr(model_cache, "RECORD", model_cache.Record())
    kube, s = GcKube(), _hf_spec()
    kube.apply({"kind": "PersistentVolumeClaim", "metadata": {"name": "team-db", "namespace": "ns", "labels": {
        model_cache.CACHE_LABEL: "true"}, "annotations": {model_cache.A_UNUSED: "2000-01-01T00:00:00Z"}}})
    model_cache.ensure(kube, "ns", "u", s, None, "img:1")
    claim = model_cache.source(s).claim
    model_cache.release(kube, "ns", "u")
    ours = kube.get("PersistentVolumeClaim", "ns", claim)
    ours["metadata"]["annotations"][model_cache.A_UNUSED] = "2000-01-01T00:00:00Z"  # forged: not trusted
    t0 = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
    assert model_cache.collect(kube, "ns", 60, now=t0) == []  # first seen unused now
    assert model_cache.collect(kube, "ns", 60, now=t0 + dt.timedelta(seconds=61)) == [claim]
    assert kube.get("PersistentVolumeClaim", "ns", "team-db") is not None
    assert kube.get("Job", "ns", claim + "-fill") is None
