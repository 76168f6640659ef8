"""Registry consistency: implementations resolve, torch backend loads every format, torch-free import."""

import importlib
import subprocess
import sys

import pytest

from moe_core import registry
from moe_core.formats import EXPERT_FORMATS
from moe_kernels.backends import installed_packages, load_backend
from moe_kernels.selftest import selftest


@pytest.mark.parametrize("spec", registry.BACKENDS, ids=lambda s: s.name)
def test_implementation_path_exists(spec):
    module, sep, attr = spec.implementation.partition(":")
    assert sep == ":" and module.startswith("moe_kernels.")
    if spec.name == "triton":
        pytest.importorskip("triton")
    mod = importlib.import_module(module)  # flashinfer wrappers import without flashinfer
    assert callable(getattr(mod, attr))
    assert load_backend(spec.name) is getattr(mod, attr)


@pytest.mark.parametrize("spec", registry.BACKENDS, ids=lambda s: s.name)
def test_formats_are_known(spec):
    assert spec.weight_formats <= set(EXPERT_FORMATS)


def test_torch_backend_loads_every_listed_format_on_cpu():
    spec = registry.get("torch")
    assert spec.weight_formats == set(EXPERT_FORMATS) and "cpu" in spec.families
    for fmt in sorted(spec.weight_formats):
        res = selftest("torch", fmt, "cpu")
        assert res.ok, res.message


def test_selftest_reports_failures_instead_of_raising():
    res = selftest("flashinfer_mxfp4", "nvfp4", "cpu")
    assert not res.ok and "does not load" in res.message
    res = selftest("no_such_backend", "bf16", "cpu")
    assert not res.ok


def test_planner_backend_names_present():
    assert {"triton", "torch", "flashinfer_trtllm", "flashinfer_mxfp4", "flashinfer_cutlass"} <= set(registry.names())


def test_package_import_is_torch_free():
    code = ("import sys, moe_kernels, moe_core.registry, moe_kernels.backends; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "print(moe_kernels.backends.installed_packages())")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())


def test_installed_packages_shape():
    got = installed_packages()
    assert set(got) == {"flashinfer-python", "triton"}
    assert all(v is None or isinstance(v, str) for v in got.values())


def _env():
    import os
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
