"""sglang's FP8 AITER path is gated on SGLANG_USE_AITER (issue 30, env-gated backends).

sglang 0.5.23 layers/quantization/fp8.py:149 `_use_aiter = envs.SGLANG_USE_AITER.get() and _is_hip`;
Fp8MoEMethod.maybe_get_hip_aiter_quant_info returns None without it (:3409-3415), so apply() raises
"Unsupported runner backend" (:3356-3359). The plan renders the variable for an explicit aiter runner on ROCm, and
the start-up row SG-FP8-AITER sees the rendered env merged with the user's (selection._engine_case), the user's
value winning.
"""

from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import from_name

from moe_operator import planner
from moe_operator.engine_rules import judge
from moe_operator.planner import Choices, plan
from moe_operator.selection import _engine_case

DSV3, DSV4, QWEN3 = "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "Qwen3MoeForCausalLM"


def _ck(fmt="fp8", arch=DSV3):
    return CheckpointInfo(architecture=arch, format=fmt, formatSource="test", quantMethod="fp8" if fmt == "fp8" else None,
                          numExperts=64, numSharedExperts=1 if arch in (DSV3, DSV4) else 0)


def _plan(gpu, runner="aiter", version="0.5.23", fmt="fp8", arch=DSV3, env=None):
    return plan(_ck(fmt, arch), from_name(gpu), Choices(runner_backend=runner, env=env or {}),
                engine="sglang", engine_version=version)


def _aiter_refusals(p):
    return [e for e in p.errors if e.startswith("[SG-FP8-AITER]")]


def test_explicit_aiter_on_fp8_renders_the_variable_and_the_row_sees_it():
    for gpu, version, arch in (("MI300X", "0.5.23", DSV3), ("MI355X", "0.5.14", QWEN3)):
        p = _plan(gpu, version=version, arch=arch)
        assert not p.errors, (gpu, version, p.errors)
        assert p.env.get("SGLANG_USE_AITER") == "1"
        d = next(d for d in p.decisions if d.key == "env.SGLANG_USE_AITER")
        assert d.rule == "SQ-AITER" and "fp8.py:149" in d.reason and "maybe_get_hip_aiter_quant_info" in d.reason
        assert "--moe-runner-backend" in p.args and "aiter" in p.args


def test_deepseek_v4_fp8_experts_go_through_the_same_gate():
    p = _plan("MI355X", fmt="dsv4_fp8", arch=DSV4)
    assert not _aiter_refusals(p), p.errors
    assert p.env.get("SGLANG_USE_AITER") == "1"


def test_the_users_off_value_wins_and_is_refused():
    p = _plan("MI300X", env={"SGLANG_USE_AITER": "0"})
    assert p.env["SGLANG_USE_AITER"] == "0"  # never overridden
    refusals = _aiter_refusals(p)
    assert refusals and "SGLANG_USE_AITER 0" in refusals[0] and "Works instead:" in refusals[0], p.errors
    assert not any(d.key == "env.SGLANG_USE_AITER" and d.rule == "SQ-AITER" for d in p.decisions)


def test_off_rocm_nothing_is_rendered_and_aiter_is_still_refused():
    p = _plan("H200")
    assert "SGLANG_USE_AITER" not in p.env
    assert _aiter_refusals(p), p.errors  # _is_hip is False: no variable turns the path on


def test_auto_and_unread_releases_render_nothing():
    assert "SGLANG_USE_AITER" not in _plan("MI300X", runner="auto").env
    p = _plan("MI300X", version="0.5.24")  # newer than every release read: not judged, nothing guessed
    assert "SGLANG_USE_AITER" not in p.env
    assert any(w.startswith("[ER0]") for w in p.warnings)


def test_engine_case_merges_planner_env_under_the_users():
    f = planner._facts(_ck(), from_name("MI300X"),
                       Choices(runner_backend="aiter", env={"SGLANG_USE_AITER": "0", "USER_ONLY": "u"}), "sglang", "0.5.23")
    case = _engine_case(f, "aiter", [], {"SGLANG_USE_AITER": "1", "PLANNER_ONLY": "p"})
    assert dict(case.env) == {"SGLANG_USE_AITER": "0", "USER_ONLY": "u", "PLANNER_ONLY": "p"}
    assert [r.rule.id for r in judge.check(case)] == ["SG-FP8-AITER"]
    # without a user value the rendered one reaches the row; without either the row refuses
    f = planner._facts(_ck(), from_name("MI300X"), Choices(runner_backend="aiter"), "sglang", "0.5.23")
    assert not judge.check(_engine_case(f, "aiter", [], {"SGLANG_USE_AITER": "1"}))
    assert [r.rule.id for r in judge.check(_engine_case(f, "aiter"))] == ["SG-FP8-AITER"]
