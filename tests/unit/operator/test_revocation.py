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


class _Kube:
    def __init__(self, workload):
        self.workload, self.patches = workload, []

    def get(self, kind, ns, name):
        w = self.workload
        return w if w and (w["kind"], w["metadata"]["namespace"], w["metadata"]["name"]) == (kind, ns, name) else None

    def merge_patch(self, obj):
        self.patches.append(obj)
        self.workload["spec"].update(obj["spec"])


def _body(image="evil.example/engine:1"):
    return {"metadata": {"namespace": "t", "name": "m"},
            "spec": {"model": {"uri": "hf://org/m"}, "engine": {"image": image}},
            "status": {"workload": {"kind": "Deployment", "name": "m"}}}


def _cfg(on_violation):
    from types import SimpleNamespace

    from moe_operator.policy import Policy

    return SimpleNamespace(policy=Policy(allowed_registries=("ghcr.io/moe-operator",), on_violation=on_violation))


def test_a_tightened_policy_scales_the_running_workload_to_zero_only_when_the_admin_says_so():
    from moe_operator.revocation import enforce

    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"namespace": "t", "name": "m"},
           "spec": {"replicas": 3, "template": {}}}
    kube = _Kube(dep)
    assert enforce(kube, _cfg("keep"), _body()) is None and not kube.patches  # the default keeps it running
    msg = enforce(kube, _cfg("scaleToZero"), _body())
    assert "scaled to 0 replicas" in msg and "evil.example/engine:1" in msg
    assert kube.patches == [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"namespace": "t", "name": "m"},
                             "spec": {"replicas": 0}}]  # a merge patch of replicas only: the template stays
    assert enforce(kube, _cfg("scaleToZero"), _body()) is None  # at 0 already: no second Event
    dep["spec"]["replicas"] = 2  # an allowed spec is never touched
    assert enforce(kube, _cfg("scaleToZero"), _body("ghcr.io/moe-operator/moe-runtime:1")) is None
    assert enforce(_Kube(None), _cfg("scaleToZero"), _body()) is None  # no workload yet
