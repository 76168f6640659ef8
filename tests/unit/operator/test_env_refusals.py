"""The env a MoEDeployment may not set (env_policy), refused by the pydantic model the webhook and the
reconcile validate with; the smaller refusals of issue 27 item 10 (tolerations, images, pvc paths)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from moe_operator import env_policy
from moe_operator.api import MoEDeploymentSpec

TOKEN = {"tokenSecretRef": {"name": "hf"}}


def spec(env=(), model=None, **kw):
    return MoEDeploymentSpec.model_validate({"model": model or {"uri": "hf://org/name"},
                                             "env": [{"name": n, "value": "x"} for n in env], **kw})


@pytest.mark.parametrize("name,why", [
    ("PYTHONPATH", "loads code"), ("PYTHONHOME", "loads code"), ("PYTHONUSERBASE", "loads code"),
    ("PYTHONSTARTUP", "loads code"), ("PYTHONWARNINGS", "loads code"), ("PYTHONBREAKPOINT", "loads code"),
    ("LD_PRELOAD", "loads code"), ("LD_LIBRARY_PATH", "loads code"), ("PATH", "loads code"), ("HOME", "loads code"),
    ("BASH_ENV", "loads code"), ("SGLANG_CACHE_DIR", "fixed paths"), ("TRITON_CACHE_DIR", "fixed paths"),
    ("TORCHINDUCTOR_CACHE_DIR", "fixed paths"), ("VLLM_CACHE_ROOT", "fixed paths"),
    ("HF_ENDPOINT", "operator sets it"), ("HF_HUB_OFFLINE", "operator sets it"), ("HF_REVISION", "operator sets it"),
    ("HF_HUB_ETAG_TIMEOUT", "operator sets it"), ("LWS_LEADER_ADDRESS", "operator sets it"),
    ("NVIDIA_DRIVER_CAPABILITIES", "GPU"),
])
def test_env_that_loads_code_redirects_or_collides_is_refused(name, why):
    with pytest.raises(ValidationError, match=why):
        spec([name])


@pytest.mark.parametrize("name", ["PYTHONUNBUFFERED", "NCCL_DEBUG", "SGLANG_ENABLE_JIT_DEEPGEMM", "HTTPS_PROXY",
                                  "OMP_NUM_THREADS"])
def test_harmless_env_is_admitted(name):
    assert spec([name]).env[0].name == name


@pytest.mark.parametrize("name", ["HTTPS_PROXY", "https_proxy", "Http_Proxy", "ALL_PROXY", "NO_PROXY", "SSL_CERT_FILE",
                                  "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "HF_TOKEN"])
def test_hub_redirect_beside_a_token_is_refused_any_case(name):
    with pytest.raises(ValidationError, match="tokenSecretRef"):
        spec([name], model={"uri": "hf://org/name", **TOKEN})


def test_every_class_has_a_cel_rule_with_the_same_names():
    rules = " ".join(r for r, _ in env_policy.cel_item_rules())
    for n in env_policy.RESERVED_NAMES + env_policy.PYTHON_ALLOWED:
        assert f"'{n}'" in rules
    assert all(f"'{n}'" in env_policy.cel_token_rule()[0] for n in env_policy.REDIRECTS_HUB)


@pytest.mark.parametrize("tol,msg", [
    ({"key": "a", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 5}, "only to effect NoExecute"),
    ({"key": "a", "tolerationSeconds": 5}, "only to effect NoExecute"),
    ({"key": "a", "operator": "Exists", "value": "v"}, "must have no value"),
    ({"operator": "Equal", "value": "v"}, "without a key"),
])
def test_tolerations_the_api_server_would_refuse(tol, msg):
    with pytest.raises(ValidationError, match=msg):
        spec(tolerations=[tol])
    spec(tolerations=[{"key": "a", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5}])


@pytest.mark.parametrize("image", ["lmsysorg/sglang:v0.5 ", " x", "a b", "x/UPPER", "ghcr.io/moe-operator@evil.example/x",
                                   "x:tag@sha256:short"])
def test_malformed_images_are_refused(image):
    with pytest.raises(ValidationError, match="image"):
        spec(engine={"name": "sglang", "image": image})


@pytest.mark.parametrize("uri", ["pvc://models/x';touch /tmp/p;'", "pvc://models/a b", "pvc://models/$(id)",
                                 "pvc://models/a\"b", "pvc://models/a`id`"])
def test_pvc_sub_paths_have_a_restricted_character_set(uri):
    with pytest.raises(ValidationError, match="uri"):
        spec(model={"uri": uri})
    spec(model={"uri": "pvc://models/org/Name-v1.5_fp8+x=1@2"})


def test_the_token_goes_only_to_the_container_that_downloads():
    """Bundled engine, hf:// without the cache: the fetch init container gets the token, the engine
    (which serves the fetched directory) does not; with the cache, only the fill Job has it."""
    from moe_operator import model_cache
    from moe_operator.render import model_location

    s = spec(model={"uri": "hf://org/name@" + "0" * 40, **TOKEN}, engine={"name": "bundled"})
    loc = model_location(s, "bundled", "img:1")
    assert not [e for e in loc.extra_env if e["name"] == "HF_TOKEN"]
    assert [e for e in loc.init_containers[0]["env"] if e["name"] == "HF_TOKEN"]
    cached = spec(model={"uri": "hf://org/name@" + "0" * 40, **TOKEN, "cache": {"enabled": True}}, engine={"name": "sglang"})
    loc = model_location(cached, "sglang", "img:1")
    assert not [e for c in [{"env": loc.extra_env}, *loc.init_containers] for e in c.get("env") or [] if e["name"] == "HF_TOKEN"]
    job = model_cache.fill_job("ns", cached, "img:1")
    assert [e for e in job["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == "HF_TOKEN"]
