"""revocation.strip_token: every env entry reading the revoked Secret leaves every pod template."""

from __future__ import annotations

from moe_operator.revocation import revoked, strip_token

TOK = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
OTHER = {"name": "X", "valueFrom": {"secretKeyRef": {"name": "other", "key": "k"}}}


def test_strips_engine_and_init_containers_of_deployments_and_leaderworkersets():
    pod = {"spec": {"containers": [{"name": "engine", "env": [TOK, OTHER, {"name": "A", "value": "1"}]}],
                    "initContainers": [{"name": "fetch-model", "env": [TOK]}]}}
    dep = {"kind": "Deployment", "spec": {"template": pod}}
    out = strip_token(dep, "hf")
    assert out["spec"]["template"]["spec"]["containers"][0]["env"] == [OTHER, {"name": "A", "value": "1"}]
    assert out["spec"]["template"]["spec"]["initContainers"][0]["env"] == []
    assert dep["spec"]["template"]["spec"]["initContainers"][0]["env"] == [TOK]  # the input is not changed
    assert strip_token(out, "hf") is None
    lws = {"kind": "LeaderWorkerSet", "spec": {"leaderWorkerTemplate": {"leaderTemplate": pod, "workerTemplate": pod}}}
    out = strip_token(lws, "hf")
    assert all(TOK not in c["env"] for t in ("leaderTemplate", "workerTemplate")
               for c in out["spec"]["leaderWorkerTemplate"][t]["spec"]["containers"])


def test_revoked_when_the_label_is_gone_or_the_secret_is():
    assert revoked(None) and revoked({}) and revoked({"moe.serving.dev/model-token": "false"})
    assert not revoked({"moe.serving.dev/model-token": "true"})
