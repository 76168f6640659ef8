"""Ready / Reconciling / Stalled (operator/moe_operator/conditions.py) on each state the reconcile
writes, judged by the real rules: kstatus (sigs.k8s.io/cli-utils v0.37.2 pkg/kstatus/status,
status.Compute) and Argo CD's Lua runner (gopher-lua as argoproj/argo-cd util/lua/lua.go runs an
argocd-cm health script) on the chart's files/argocd/health.lua, both in the Go program
tests/unit/operator/health_check (built once through the Go module proxy, cached by its sources).

The condition lists are made with reconcile.set_condition, the shapes the reconcile writes.
Without Go the kstatus tests FAIL saying so, unless MOE_SKIP_INTEGRATION=1 (then they skip);
tests/health_rules.py builds and runs the program.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import health_rules  # noqa: E402

from moe_operator.conditions import rollup  # noqa: E402
from moe_operator.reconcile import set_condition  # noqa: E402
NOW = "2026-12-02T00:00:00Z"


def conds(gen: int, *items: tuple[str, str, str]) -> list[dict]:
    out: list[dict] = []
    for type_, status, reason in items:
        out = set_condition(out, type_, status, reason, f"{type_} {reason}", gen)
    return out


def obj(conditions: list[dict], gen: int = 1, observed: int | None = 1, **meta) -> dict:
    status = {"conditions": conditions}
    if observed is not None:
        status["observedGeneration"] = observed
    return {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
            "metadata": {"name": "m", "namespace": "ns", "generation": gen, **meta}, "spec": {}, "status": status}


def by_type(cs: list[dict]) -> dict[str, dict]:
    return {c["type"]: c for c in cs}


PLANNED = ("Planned", "True", "Planned")
INSPECTED = ("CheckpointInspected", "True", "Inspected")
APPLIED = ("Degraded", "False", "Applied")
READY = (INSPECTED, PLANNED, APPLIED, ("Available", "True", "ReplicasReady"), ("Progressing", "False", "Complete"))

# name -> (conditions before the rollup at generation 1, Ready, Reconciling, Stalled, kstatus, Argo CD)
STATES = {
    "inspecting": ([("CheckpointInspected", "Unknown", "Inspecting")], "False", "True", "False", "InProgress", "Progressing"),
    "policy refused": ([("Planned", "False", "PolicyViolation"), ("Available", "False", "NotPlanned")],
                       "False", "False", "True", "Failed", "Degraded"),
    "no GPU class": ([INSPECTED, ("Planned", "False", "NoFeasibleGpuClass"), ("Available", "False", "NotPlanned")],
                     "False", "False", "True", "Failed", "Degraded"),
    "hub 404": ([("CheckpointInspected", "False", "NotFound"), ("Planned", "False", "CheckpointNotInspected")],
                "False", "False", "True", "Failed", "Degraded"),
    "gated without token": ([("CheckpointInspected", "False", "Unauthorized")], "False", "False", "True", "Failed", "Degraded"),
    "hub down (retried)": ([("CheckpointInspected", "False", "HubError"), ("Planned", "False", "CheckpointNotInspected")],
                           "False", "True", "False", "InProgress", "Progressing"),
    "cache filling": ([INSPECTED, PLANNED, ("ModelCacheReady", "False", "Downloading"),
                       ("Available", "False", "WaitingForModelCache")], "False", "True", "False", "InProgress", "Progressing"),
    "cache failed": ([INSPECTED, PLANNED, ("ModelCacheReady", "False", "Failed"), ("Available", "False", "WaitingForModelCache")],
                     "False", "False", "True", "Failed", "Degraded"),
    "pods starting": ([INSPECTED, PLANNED, APPLIED, ("Available", "False", "ReplicasNotReady"), ("Progressing", "True", "RollingOut")],
                      "False", "True", "False", "InProgress", "Progressing"),
    "ready": (list(READY), "True", "False", "False", "Current", "Healthy"),
    "scaled to zero": ([INSPECTED, PLANNED, APPLIED, ("Available", "True", "ScaledToZero"), ("Progressing", "False", "ScaledToZero")],
                       "True", "False", "False", "Current", "Healthy"),
    "rolling, old pods serve": ([INSPECTED, PLANNED, APPLIED, ("Available", "True", "ReplicasReady"),
                                 ("Progressing", "True", "RollingOneAtATime")], "True", "True", "False", "InProgress", "Progressing"),
    "waiting for capacity": ([INSPECTED, PLANNED, APPLIED, ("Available", "True", "ReplicasReady"),
                              ("Progressing", "True", "WaitingForCapacity")], "True", "True", "False", "InProgress", "Progressing"),
    "KEDA CRD missing": ([INSPECTED, PLANNED, ("Degraded", "True", "KedaMissing"), ("Available", "True", "ReplicasReady"),
                          ("Progressing", "False", "Complete")], "False", "False", "True", "Failed", "Degraded"),
    "LWS CRD missing": ([INSPECTED, PLANNED, ("Degraded", "True", "LeaderWorkerSetMissing"), ("Progressing", "False", "LeaderWorkerSetMissing")],
                        "False", "False", "True", "Failed", "Degraded"),
    "API conflict (retried)": ([INSPECTED, PLANNED, ("Degraded", "True", "ApiConflict"), ("Available", "True", "ReplicasReady")],
                               "False", "True", "False", "InProgress", "Progressing"),
    "API server busy (retried)": ([INSPECTED, PLANNED, ("Degraded", "True", "ApiServerBusy"), ("Progressing", "False", "ApiServerBusy")],
                                  "False", "True", "False", "InProgress", "Progressing"),
    "apply refused (422)": ([INSPECTED, PLANNED, ("Degraded", "True", "ApplyInvalid"), ("Progressing", "False", "ApplyInvalid")],
                            "False", "False", "True", "Failed", "Degraded"),
    "endpoint picker missing (FailClose)": (list(READY) + [("InferencePoolReady", "False", "EndpointPickerMissing")],
                                            "False", "False", "True", "Failed", "Degraded"),
    "endpoint picker missing (FailOpen)": (list(READY) + [("InferencePoolReady", "False", "EndpointPickerMissingFailOpen")],
                                           "True", "False", "False", "Current", "Healthy"),
    "placement held": (list(READY) + [("PlacementHeld", "True", "SettlingInventory")], "True", "True", "False", "InProgress", "Progressing"),
    # the pool has no ready endpoint (day2.endpoint_picker_condition): a state of the rollout, never Stalled
    "pool without endpoints, pods starting": ([INSPECTED, PLANNED, APPLIED, ("Available", "False", "ReplicasNotReady"),
                                               ("Progressing", "True", "RollingOut"),
                                               ("InferencePoolReady", "False", "NoReadyEndpoints")],
                                              "False", "True", "False", "InProgress", "Progressing"),
    "pool without endpoints, scaled to zero": ([INSPECTED, PLANNED, APPLIED, ("Available", "True", "ScaledToZero"),
                                                ("Progressing", "False", "ScaledToZero"),
                                                ("InferencePoolReady", "False", "NoReadyEndpoints")],
                                               "True", "False", "False", "Current", "Healthy"),
}


@pytest.mark.parametrize("name", list(STATES))
def test_rollup_per_state(name):
    items, ready, reconciling, stalled, _, _ = STATES[name]
    out = by_type(rollup(conds(1, *items), 1, now=NOW))
    assert (out["Ready"]["status"], out["Reconciling"]["status"], out["Stalled"]["status"]) == (ready, reconciling, stalled), out
    for t in ("Ready", "Reconciling", "Stalled"):
        assert out[t]["observedGeneration"] == 1 and out[t]["reason"]
    if stalled == "True":  # the cause is named where kubectl's Reason column shows it
        cause = next(i for i in items if (i[0] == "Degraded" and i[1] == "True") or i[2] in (
            "PolicyViolation", "NoFeasibleGpuClass", "NotFound", "Unauthorized", "Failed", "EndpointPickerMissing"))
        assert out["Ready"]["reason"] == out["Stalled"]["reason"] == cause[2]


def test_old_generation_conditions_do_not_make_ready():
    """Generation 2 seen (a new spec), inspection pending: Available=True from generation 1 says
    nothing about it."""
    old = conds(1, *READY)
    now = set_condition(old, "CheckpointInspected", "Unknown", "Inspecting", "reading", 2)
    out = by_type(rollup(now, 2, now=NOW))
    assert out["Ready"]["status"] == "False" and out["Reconciling"]["status"] == "True"
    assert out["Reconciling"]["reason"] == "Inspecting"
    # nothing at generation 2 yet
    out = by_type(rollup(old, 2, now=NOW))
    assert out["Ready"]["status"] == "False" and out["Reconciling"]["reason"] == "LatestGenerationNotObserved"
    # an old Stalled cause does not stall the new generation
    refused = conds(1, ("Planned", "False", "PolicyViolation"))
    assert by_type(rollup(refused, 2, now=NOW))["Stalled"]["status"] == "False"


def test_transition_time_kept_while_status_stays():
    first = rollup(conds(1, *READY), 1, now="2026-12-01T00:00:00Z")
    again = by_type(rollup(first, 1, now="2026-12-01T01:00:00Z"))
    assert again["Ready"]["lastTransitionTime"] == "2026-12-01T00:00:00Z"
    broke = set_condition(first, "Degraded", "True", "KedaMissing", "no CRD", 1)
    after = by_type(rollup(broke, 1, now="2026-12-01T02:00:00Z"))
    assert after["Ready"]["lastTransitionTime"] == "2026-12-01T02:00:00Z"
    assert after["Ready"]["status"] == "False"
    # the rollup output validates against the status model the CRD is generated from
    from moe_operator.api import MoEDeploymentStatus
    MoEDeploymentStatus.model_validate({"conditions": list(after.values())})


# --------------------------------------------------------------- kstatus and Argo CD, for real
@pytest.fixture(scope="module")
def health_check() -> Path:
    return health_rules.build()


def judge(exe: Path, objects: list[dict]) -> list[dict]:
    return health_rules.judge(exe, objects)


@pytest.mark.slow
def test_kstatus_and_argocd_on_each_state(health_check):
    names = list(STATES)
    got = judge(health_check, [obj(rollup(conds(1, *STATES[n][0]), 1, now=NOW)) for n in names])
    for name, res in zip(names, got):
        assert (res["kstatus"], res["argo"]) == STATES[name][4:], (name, res)
    # before the rollup, kstatus reads a refused object as Current (no Ready/Reconciling/Stalled):
    # what issue 32 reported, and why Stalled is written
    before = judge(health_check, [obj(conds(1, *STATES["policy refused"][0]))])[0]
    assert before["kstatus"] == "Current"


@pytest.mark.slow
def test_kstatus_and_argocd_follow_the_generation(health_check):
    ready = rollup(conds(1, *READY), 1, now=NOW)
    new_spec = obj(ready, gen=2, observed=1)  # the user changed the spec; the operator has not seen it
    seen_pending = obj(rollup(set_condition(ready, "CheckpointInspected", "Unknown", "Inspecting", "", 2), 2, now=NOW),
                       gen=2, observed=2)
    served = obj(rollup(conds(2, *READY), 2, now=NOW), gen=2, observed=2)
    no_status = {k: v for k, v in obj([]).items() if k != "status"}
    deleting = obj(ready, deletionTimestamp="2026-12-02T00:00:00Z")
    a, b, c, d, e = judge(health_check, [new_spec, seen_pending, served, no_status, deleting])
    assert (a["kstatus"], a["argo"]) == ("InProgress", "Progressing") and "generation" in a["kstatusMessage"]
    assert (b["kstatus"], b["argo"]) == ("InProgress", "Progressing")
    assert (c["kstatus"], c["argo"]) == ("Current", "Healthy")
    # kstatus has no rule for a custom resource without status (Current): Argo CD's check waits
    assert (d["kstatus"], d["argo"]) == ("Current", "Progressing")
    assert e["kstatus"] == "Terminating"


@pytest.mark.slow
def test_argocd_rejects_what_argocd_would(health_check, tmp_path):
    """The runner is Argo CD's: a script using the string library (not opened for argocd-cm scripts)
    fails, and a status outside Argo's codes reads Unknown."""
    bad = tmp_path / "bad.lua"
    bad.write_text('return { status = string.lower("HEALTHY") }\n')
    r = subprocess.run([str(health_check), str(bad)], input=json.dumps(obj([])) + "\n", capture_output=True, text=True)
    assert "lua:" in json.loads(r.stdout)["error"]
    odd = tmp_path / "odd.lua"
    odd.write_text('return { status = "Fine" }\n')
    r = subprocess.run([str(health_check), str(odd)], input=json.dumps(obj([])) + "\n", capture_output=True, text=True)
    assert json.loads(r.stdout)["argo"] == "Unknown"


def test_printer_columns_show_ready_and_reason():
    """`kubectl get moed`: READY and REASON from the Ready condition, first; URL in -o wide."""
    from moe_operator.crd import PRINTER_COLUMNS

    cols = {c["name"]: c for c in PRINTER_COLUMNS}
    assert [c["name"] for c in PRINTER_COLUMNS[:2]] == ["Ready", "Reason"]
    assert cols["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert cols["Reason"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].reason'
    assert cols["Serving"]["jsonPath"] == ".status.readyReplicas" and cols["URL"]["priority"] == 1
    assert len(cols) == len(PRINTER_COLUMNS)


def test_crd_defaults_status_to_generation_zero():
    """A custom resource without status is Current to kstatus; the default makes a fresh object
    InProgress until the operator's first status write (checked on the API server by
    tests/integration/test_ready_status.py)."""
    from moe_operator.crd import crd

    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert schema["default"] == {"observedGeneration": 0}
