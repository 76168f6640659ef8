"""Model cache rendering (pure): the PVC per (model, revision), the locked-down fill Job, the pod
parts, the cluster-wide defaults."""

import pytest

from moe_core.checkpoint import CheckpointInfo
from moe_operator import model_cache
from moe_operator.api import MoEDeploymentSpec

SHA = "0123456789abcdef0123456789abcdef01234567"


def spec(cache=None, uri=f"hf://org/dsv3@{SHA}", token=False):
    m = {"uri": uri}
    if cache is not None:
        m["cache"] = cache
    if token:
        m["tokenSecretRef"] = {"name": "hf", "key": "tok"}
    return MoEDeploymentSpec.model_validate({"model": m, "engine": {"name": "sglang"}})


def test_one_claim_per_model_and_revision_sized_from_the_checkpoint():
    s = spec({"enabled": True})
    ck = CheckpointInfo(architecture="DeepseekV3ForCausalLM", format="nvfp4", formatSource="t", totalBytes=408_867_154_944)
    pvc = model_cache.pvc("ns", s, ck)
    assert pvc["metadata"]["name"] == model_cache.claim_name("org/dsv3", SHA)
    assert model_cache.claim_name("org/dsv3", SHA) != model_cache.claim_name("org/dsv3", "f" * 40)
    assert pvc["spec"]["resources"]["requests"]["storage"] == "419Gi"  # 380.8 GiB + 10%, rounded up
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and "storageClassName" not in pvc["spec"]
    assert pvc["metadata"]["annotations"] == {"moe.serving.dev/model": "org/dsv3", "moe.serving.dev/revision": SHA}
    assert "ownerReferences" not in pvc["metadata"]  # shared: it outlives each MoEDeployment
    sized = model_cache.pvc("ns", spec({"enabled": True, "size": "2Ti", "storageClassName": "fast",
                                        "accessMode": "ReadWriteOnce"}), ck)
    assert sized["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "2Ti"}},
                             "storageClassName": "fast"}


def test_fill_job_is_locked_down_and_takes_the_token_by_reference():
    job = model_cache.fill_job("ns", spec({"enabled": True}, token=True), "img:1")
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": {"drop": ["ALL"]}}
    assert c["command"] == ["moe-operator", "download-model", "--repo", "org/dsv3", "--revision", SHA,
                            "--dir", model_cache.MOUNT, "--termination-log", "/dev/termination-log"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "tok"}}} in c["env"]
    assert pod["restartPolicy"] == "Never"  # the next pod continues the .part files; podFailurePolicy needs Never


def test_pods_mount_it_read_only_behind_the_ready_check():
    parts = model_cache.pod_parts(spec({"enabled": True}), "img:1")
    assert parts.volume["persistentVolumeClaim"]["readOnly"] is True and parts.mount["readOnly"] is True
    cmd = parts.init_container["command"]
    assert SHA in cmd[3:] and SHA not in cmd[2] and parts.init_container["volumeMounts"][0]["readOnly"]


@pytest.mark.parametrize("hostile", ["x';touch {p};'", 'x";touch {p};"', "x$(touch {p})", "x`touch {p}`",
                                     "x\"; touch {p}; echo \""])
def test_the_rendered_ready_check_runs_no_tenant_string_in_a_real_sh(tmp_path, hostile):
    """The schema refuses these sub-paths; the init command must be safe even for one that got
    past it: run as rendered in a real sh, with and without the marker."""
    import json
    import subprocess

    from moe_operator.download_cli import READY_MARKER

    pwned = tmp_path / "pwned"
    s = spec({"enabled": True}, uri="pvc://models/ok")
    uri = "pvc://models/" + hostile.format(p=pwned)
    s = s.model_copy(update={"model": s.model.model_copy(update={"uri": uri})})  # unvalidated, as if admitted
    c = model_cache.pod_parts(s, "img:1").init_container
    cache = tmp_path / "cache"
    cache.mkdir()
    argv, env = model_cache.local_invocation(c, {model_cache.VOLUME: str(cache)})
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "has no ready marker" in r.stderr and not pwned.exists(), r.stderr
    rev = model_cache.source(s).revision
    (cache / READY_MARKER).write_text(json.dumps({"revision": rev, "bytesTotal": 1}))
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    # a revision JSON escapes (quotes, backslashes) does not match as text: refused, never run
    assert r.returncode == (0 if json.dumps(rev)[1:-1] == rev else 1) and not pwned.exists(), r.stderr


def test_cluster_defaults_fill_only_what_the_spec_leaves_unset():
    unset = spec()
    assert unset.model.cache.enabled is None and not model_cache.enabled(unset)
    on = model_cache.with_defaults(unset, True, "fast")
    assert model_cache.enabled(on) and on.model.cache.storageClassName == "fast"
    off = model_cache.with_defaults(spec({"enabled": False}), True, "fast")
    assert not model_cache.enabled(off) and off.model.cache.storageClassName == "fast"
    mine = model_cache.with_defaults(spec({"enabled": True, "storageClassName": "mine"}), False, "fast")
    assert model_cache.enabled(mine) and mine.model.cache.storageClassName == "mine"
    assert not model_cache.enabled(model_cache.with_defaults(spec(uri="pvc://models/x"), True, None))  # hf:// only


def test_the_fill_job_names_the_operators_pull_secrets(monkeypatch):
    from moe_operator import images

    assert "imagePullSecrets" not in model_cache.fill_job("ns", spec({"enabled": True}), "img:1")["spec"]["template"]["spec"]
    monkeypatch.setattr(images, "REGISTRIES", images.Registries(pull_secrets=("regcred",)))
    pod = model_cache.fill_job("ns", spec({"enabled": True}), "img:1")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_engines_that_download_themselves_use_the_operators_hub(monkeypatch):
    """issue 27 item 1: the endpoint comes from the operator's configuration, for the fill Job and for
    every container that downloads from the hub itself (sglang/vLLM engines, the bundled fetch)."""
    from moe_operator.render import model_location

    s = MoEDeploymentSpec.model_validate({"model": {"uri": f"hf://org/dsv3@{SHA}", "tokenSecretRef": {
        "name": "hf", "key": "tok"}, "cache": {"enabled": False}}})
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert not [e for e in model_location(s, "sglang", "img").extra_env if e["name"] == "HF_ENDPOINT"]
    monkeypatch.setenv("HF_ENDPOINT", "https://hub-mirror.internal")
    for engine in ("sglang", "vllm"):
        env = model_location(s, engine, "img").extra_env
        assert {"name": "HF_ENDPOINT", "value": "https://hub-mirror.internal"} in env
    fetch = model_location(s, "bundled", "img").init_containers[0]["env"]
    assert {"name": "HF_ENDPOINT", "value": "https://hub-mirror.internal"} in fetch
    job = model_cache.fill_job("ns", spec({"enabled": True}), "img:1", model_cache.hub_endpoint())
    assert {"name": "HF_ENDPOINT", "value": "https://hub-mirror.internal"} in job["spec"]["template"]["spec"]["containers"][0]["env"]
