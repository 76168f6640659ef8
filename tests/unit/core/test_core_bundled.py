"""moe_core: one bundled-backend decision for both planes, verified backends first, import hygiene."""

import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import moe_core
from moe_core import registry
from moe_core.bundled import resolve_bundled
from moe_core.checkpoint import CheckpointInfo
from moe_core.formats import EXPERT_FORMATS, TABLE
from moe_core.gpu import FAMILIES, PRODUCTS, from_name
from moe_core.runtime import BUNDLED

ROOT = Path(__file__).resolve().parents[3]


def _env():
    return {"PYTHONPATH": ":".join(str(ROOT / s) for s in ("operator", "runtime", "kernels")), "PATH": "/usr/bin:/bin"}


# ------------------------------------------------------------------------------------ verified

def test_registry_verified_entries():
    assert registry.get("triton").verified.startswith("2026-11-29 on H200")
    assert registry.get("torch").verified
    for name in ("flashinfer_trtllm", "flashinfer_mxfp4", "flashinfer_cutlass"):
        assert registry.get(name).verified is None  # never ran here


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["cpu"])
@pytest.mark.parametrize("wfmt", EXPERT_FORMATS)
def test_no_unverified_backend_outranks_a_verified_one(family, wfmt):
    every = {"flashinfer-python": "9.9", "triton": "9.9"}
    for installed in (None, every):
        order = [b.verified is not None for b in registry.candidates(family, wfmt, installed)]
        assert order == sorted(order, reverse=True), (family, wfmt, order)


def _spec(name, priority, verified, requirements=()):
    return registry.BackendSpec(name=name, summary=name, families=frozenset({"sm90"}), weight_formats=frozenset({"nvfp4"}),
                                deferred_finalize=False, priority=priority, implementation="x:y",
                                requirements=requirements, verified=verified)


FAST_UNVERIFIED = _spec("fast", 90, None)
SLOW_VERIFIED = _spec("slow", 10, "2026-11-29 on H200",
                      (registry.Requirement("triton", "3.0", "Triton JIT kernels"),))


def _resolve(installed, backend="auto", explicit=False):
    return resolve_bundled(family="sm90", where="sm90", architecture="DeepseekV3ForCausalLM", checkpoint_format="nvfp4",
                           shared_experts=1, installed=installed, backend=backend, explicit=explicit,
                           backends=(FAST_UNVERIFIED, SLOW_VERIFIED))


def test_auto_takes_the_verified_backend_over_a_higher_priority_unverified_one():
    r = _resolve({"triton": "3.6"})
    assert r.backends == ["slow", "fast"] and not r.errors
    why = next(d.reason for d in r.decisions if d.key == "moe.runnerBackend")
    assert "unverified" not in why


def test_unverified_backend_only_when_nothing_verified_fits_and_the_reason_says_so():
    r = _resolve({"triton": None})
    assert r.backends == ["fast"] and not r.errors
    why = next(d.reason for d in r.decisions if d.key == "moe.runnerBackend")
    assert "unverified" in why and "no verified backend fits" in why
    assert any(n.startswith("[B3] slow not used") for n in r.notes)
    r = _resolve({"triton": "3.6"}, backend="fast", explicit=True)  # an explicit choice is kept, and labelled
    assert r.backends == ["fast"] and "unverified" in r.decisions[0].reason


# ------------------------------------------------------------------ one decision, two planes

def _installed(family):
    from moe_operator.images import bundled_image_flashinfer

    return {"flashinfer-python": bundled_image_flashinfer(from_name(family)), "triton": "3.6"}


@pytest.mark.parametrize("product", sorted(p for p, v in PRODUCTS.items() if not v[1].startswith("gfx")))
@pytest.mark.parametrize("fmt", BUNDLED.checkpoint_formats)
@pytest.mark.parametrize("shared", [0, 1])
def test_planner_and_plan_check_resolve_alike(product, fmt, shared):
    """The runtime re-resolves the planner's plan, and resolves without a plan, to the planner's answer."""
    from moe_operator import planner
    from moe_runtime.plan_check import resolve

    gpu = from_name(product)
    info = CheckpointInfo(architecture="DeepseekV3ForCausalLM", format=fmt, formatSource="t", numExperts=8,
                          numSharedExperts=shared)
    p = planner.plan(info, gpu)
    assert not p.errors
    installed = _installed(product)
    with_plan = resolve(json.loads(p.model_dump_json()), gpu.family, product, info, {}, installed)
    without = resolve(None, gpu.family, product, info, {}, installed)
    assert with_plan.backends == without.backends and with_plan.backends[0] == p.moe.runnerBackend
    assert with_plan.deferred == without.deferred == p.moe.deferredFinalize
    assert not p.env  # plan.json is the only channel: nothing rendered for the bundled runtime


def test_formats_table_agrees_with_the_registry_and_runtime():
    assert set(BUNDLED.checkpoint_formats) <= set(TABLE)
    for fmt in BUNDLED.checkpoint_formats:
        assert TABLE[fmt].expert in EXPERT_FORMATS
    for spec in registry.BACKENDS:
        assert spec.weight_formats <= set(EXPERT_FORMATS)
    assert registry.backends_for_format("dsv4_fp4") == ["flashinfer_mxfp4", "triton", "torch"]
    assert registry.backends_for_format("w4afp8") == []
    assert TABLE["mixed"].fp4 and TABLE["ct_mxfp4_pack"].fp4 and not TABLE["modelopt_fp8"].fp4


# ------------------------------------------------------------------------------ import hygiene

def test_moe_core_imports_no_torch_kubernetes_or_kopf():
    mods = [f"moe_core.{m.name}" for m in pkgutil.iter_modules(moe_core.__path__)]
    assert {"moe_core.bundled", "moe_core.runtime", "moe_core.registry", "moe_core.formats"} <= set(mods)
    code = (f"import sys; [__import__(m) for m in {mods!r}]; "
            "bad = [m for m in ('torch', 'kubernetes', 'kopf', 'moe_operator', 'moe_runtime', 'moe_kernels') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())


def test_runtime_serve_loads_neither_kopf_nor_the_kubernetes_client():
    code = ("import sys, moe_runtime.serve, moe_runtime.plan_check, moe_runtime.loader; "
            "bad = [m for m in ('kopf', 'kubernetes', 'moe_operator') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())


def test_no_runtime_module_imports_the_operator():
    pat = re.compile(r"^\s*(from|import)\s+moe_operator\b", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "runtime" / "moe_runtime").rglob("*.py") if pat.search(p.read_text())]
    assert offenders == []
