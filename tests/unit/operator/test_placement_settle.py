"""Placement hysteresis (issue 34 item 3): a running workload keeps a class that stopped fitting
for the settle period; idle workloads and spec changes follow placement at once."""

from moe_operator.placement import Placement, settle_hold
from test_render_placement import classes, spec

CUR = "sm120/NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"
GONE = Placement(None, None, {})


def test_a_running_workload_waits_out_the_settle_period():
    s = spec(gpu={"allowedArchitectures": ["sm120"]})
    msg = settle_hold(s, CUR, GONE, running=True, leaving_for=5, settle=60)
    assert msg and CUR in msg and "55s more" in msg and "labels" in msg
    assert settle_hold(s, CUR, GONE, running=True, leaving_for=60, settle=60) is None  # settled: move
    assert settle_hold(s, CUR, GONE, running=False, leaving_for=0, settle=60) is None  # nothing runs: at once
    assert settle_hold(s, None, GONE, running=True, leaving_for=0, settle=60) is None  # never placed


def test_a_spec_that_no_longer_allows_the_class_moves_at_once():
    s = spec(gpu={"allowedArchitectures": ["sm100"]})
    assert settle_hold(s, CUR, GONE, running=True, leaving_for=0, settle=60) is None
    s = spec(gpu={"product": "NVIDIA-B200"})
    assert settle_hold(s, CUR, GONE, running=True, leaving_for=0, settle=60) is None


def test_no_hold_while_placement_keeps_the_class():
    inv = classes()[CUR]
    kept = Placement(inv, object(), {})  # type: ignore[arg-type]
    kept.plan = type("P", (), {"errors": []})()
    assert settle_hold(spec(), CUR, kept, running=True, leaving_for=0, settle=60) is None
