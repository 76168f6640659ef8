"""What ships is what is tested (issue 26): the sdist and the wheel are built from pyproject.toml, the
wheel is installed into a fresh virtualenv, and every module it holds is imported from there, not from
the editable checkout.

- base install (the operator image's install: dependencies resolved from the package index, no torch):
  every module of moe_core and moe_operator imports, `moe-operator plan` plans a sample checkpoint and
  `moe-operator crd` prints the CRD;
- runtime modules (moe_runtime, moe_kernels): the wheel installed without dependencies into a second
  fresh virtualenv whose third-party packages come from the test environment's site-packages (torch
  is a multi-GB download; the dependency list itself is resolved by the base case and pip's check).
  The check is that every module the runtime needs is in the wheel, loaded from the wheel's copy.

A hand-written package list once left moe_operator.engine_rules out of the wheel, so the operator
image crashed at start while every test of the editable checkout passed.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "deploy" / "samples" / "checkpoints" / "deepseek-v3-nvfp4"

pytestmark = pytest.mark.slow


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # --no-build-isolation: the build backend (setuptools) of the test environment, no index access
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)])
    _run([sys.executable, "-c", "import setuptools.build_meta as b, sys; b.build_sdist(sys.argv[1])", str(out)], cwd=ROOT)
    return out


def _wheel(dist: Path) -> Path:
    (whl,) = dist.glob("moe_operator-*.whl")
    return whl


def _modules(whl: Path, packages: tuple[str, ...]) -> list[str]:
    names = []
    for n in zipfile.ZipFile(whl).namelist():
        if not n.endswith(".py") or not n.startswith(packages):
            continue
        mod = n[:-3].replace("/", ".")
        names.append(mod[: -len(".__init__")] if mod.endswith(".__init__") else mod)
    return sorted(names)


def _venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin" / "python"


def test_wheel_holds_every_package_folder_and_its_data(dist):
    whl = _wheel(dist)
    names = set(zipfile.ZipFile(whl).namelist())
    for top in ("operator", "runtime", "kernels"):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.relative_to(ROOT / top).as_posix()
            assert rel in names, f"{rel} (package {init.parent.name}) is not in the wheel"
    data = [*(ROOT / "operator").glob("moe_operator/templates/*.j2"), *(ROOT / "kernels").glob("moe_kernels/configs/*.json")]
    assert data
    for f in data:
        rel = f.relative_to(f.parents[2]).as_posix()
        assert rel in names, f"package data {rel} is not in the wheel"
    assert not any(n.startswith(("tests/", "operator/", "bench/")) for n in names), "the wheel carries non-package folders"
    (sdist,) = dist.glob("moe_operator-*.tar.gz")
    assert sdist.stat().st_size > 0


# the webhook's serving certificate (moe_operator.webhook_tls), verified against its CA
ISSUE_CERT = ("from cryptography import x509\n"
              "from moe_operator.webhook_tls import issue\n"
              "i = issue('moe-operator-webhook.moe-system.svc', 3600)\n"
              "x509.load_pem_x509_certificate(i.cert_pem).verify_directly_issued_by(x509.load_pem_x509_certificate(i.ca_pem))\n")


def test_base_install_of_the_wheel_imports_and_plans(dist, tmp_path):
    py = _venv(tmp_path / "base")
    _run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(_wheel(dist))])
    _run([str(py), "-m", "pip", "check"])
    mods = _modules(_wheel(dist), ("moe_core", "moe_operator"))
    assert "moe_operator.planner" in mods
    code = ("import importlib, json, sys\n"
            "mods = json.loads(sys.argv[1])\n"
            "for m in mods:\n"
            "    f = importlib.import_module(m).__file__\n"
            "    assert f.startswith(sys.prefix), (m, f)\n"
            "import importlib.util\n"
            "assert importlib.util.find_spec('torch') is None, 'the base install pulled torch'\n")
    _run([str(py), "-c", code, json.dumps(mods)], cwd=tmp_path)
    cli = tmp_path / "base" / "bin" / "moe-operator"
    plan = _run([str(cli), "plan", "--checkpoint", str(SAMPLE), "--gpu", "B200", "--engine", "sglang", "-o", "json"], cwd=tmp_path)
    planned = json.loads(plan.stdout)
    assert planned["moe"]["runnerBackend"] == "flashinfer_trtllm" and planned["errors"] == []
    crd = _run([str(cli), "crd"], cwd=tmp_path)
    assert "kind: CustomResourceDefinition" in crd.stdout and "MoEDeployment" in crd.stdout
    _run([str(py), "-c", ISSUE_CERT], cwd=tmp_path)  # no openssl binary: cryptography, a base dependency


def test_runtime_modules_of_the_wheel_import(dist, tmp_path):
    py = _venv(tmp_path / "rt")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", str(_wheel(dist))])
    # third-party packages (torch, safetensors, fastapi, ...) from this environment, after the venv's
    # own site-packages; its .pth files (the editable install's finder) are not processed from there
    site_dir = next(Path(p) for p in (tmp_path / "rt" / "lib").glob("python*/site-packages"))
    (site_dir / "zz_test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    mods = _modules(_wheel(dist), ("moe_runtime", "moe_kernels"))
    assert "moe_runtime.serve" in mods and "moe_kernels.triton_moe" in mods
    code = ("import importlib, json, sys\n"
            "mods = json.loads(sys.argv[1])\n"
            "for m in mods:\n"
            "    f = importlib.import_module(m).__file__\n"
            "    assert f.startswith(sys.prefix), (m, f)\n"
            "from moe_kernels import triton_config as c\n"
            "import os\n"
            "assert os.path.exists(c.table_path('NVIDIA H200')), 'tuned table not in the wheel'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([str(py), "-c", code, json.dumps(mods)], cwd=tmp_path, env=env)


def _uv() -> str:
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        pytest.fail("uv is not installed (it is in the dev extra: make setup)")
    return str(uv)


def test_base_install_at_the_declared_floors(dist, tmp_path):
    """Every base dependency at the lowest version pyproject.toml admits (uv's lowest-direct
    resolution): the operator's modules import, it plans, and the CRD it generates is the one shipped.
    A floor that admits a release the code cannot use fails here (huggingface-hub 0.x, whose
    downloader API differs; pydantic 2.7, whose JSON schema wraps $refs in allOf)."""
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (tmp_path / "floors.txt").write_text("\n".join(deps) + "\n")
    env = tmp_path / "floors"
    _run([_uv(), "venv", "-q", "-p", sys.executable, str(env)])
    py = env / "bin" / "python"
    _run([_uv(), "pip", "install", "-q", "-p", str(py), "--resolution", "lowest-direct", "-r", str(tmp_path / "floors.txt")])
    _run([_uv(), "pip", "install", "-q", "-p", str(py), "--no-deps", str(_wheel(dist))])
    listed = {d["name"].lower().replace("_", "-"): d["version"]
              for d in json.loads(_run([_uv(), "pip", "list", "-p", str(py), "--format", "json"]).stdout)}
    for d in deps:
        req = Requirement(d)
        floor = next((s.version for s in req.specifier if s.operator == ">="), None)
        if floor:
            got = listed[req.name.lower().replace("_", "-")]
            assert Requirement(f"x=={got}").specifier.contains(floor) or got.startswith(floor), \
                f"{req.name}: {got} installed, the floor is {floor} (lowest-direct did not resolve to it)"
    mods = _modules(_wheel(dist), ("moe_core", "moe_operator"))
    code = "import importlib, json, sys\nfor m in json.loads(sys.argv[1]):\n    importlib.import_module(m)\n"
    _run([str(py), "-c", code, json.dumps(mods)], cwd=tmp_path)
    cli = env / "bin" / "moe-operator"
    plan = json.loads(_run([str(cli), "plan", "--checkpoint", str(SAMPLE), "--gpu", "B200", "--engine", "sglang", "-o", "json"],
                           cwd=tmp_path).stdout)
    assert plan["moe"]["runnerBackend"] == "flashinfer_trtllm" and plan["errors"] == []
    crd = _run([str(cli), "crd"], cwd=tmp_path).stdout
    assert crd == (ROOT / "crds" / "moedeployments.yaml").read_text(), \
        "the CRD generated at the dependency floors differs from the shipped one"
    _run([str(py), "-c", ISSUE_CERT], cwd=tmp_path)  # cryptography at its floor makes the webhook's certificate
