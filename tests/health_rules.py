"""kstatus and Argo CD's judgement of objects, from the Go program tests/unit/operator/health_check
(sigs.k8s.io/cli-utils pkg/kstatus/status.Compute; gopher-lua run as Argo CD runs argocd-cm health
scripts) on the chart's files/argocd/health.lua. Built once through the Go module proxy, cached
under ~/.cache/moe-operator/health-check/<digest of its sources>."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "unit" / "operator" / "health_check"
HEALTH_LUA = ROOT / "charts" / "moe-operator" / "files" / "argocd" / "health.lua"


def build() -> Path:
    """The program's path; FAILs the test without Go (skips under MOE_SKIP_INTEGRATION=1)."""
    go = shutil.which("go")
    if go is None:
        if os.environ.get("MOE_SKIP_INTEGRATION") == "1":
            pytest.skip("go not found and MOE_SKIP_INTEGRATION=1")
        pytest.fail("go not found: the kstatus/Argo CD checks build tests/unit/operator/health_check with Go "
                    "(or set MOE_SKIP_INTEGRATION=1 to skip them)", pytrace=False)
    h = hashlib.sha256()
    for f in sorted(PROGRAM.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    exe = Path.home() / ".cache" / "moe-operator" / "health-check" / h.hexdigest()[:16] / "health-check"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([go, "build", "-o", str(exe), "."], cwd=PROGRAM, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"go build of {PROGRAM} failed:\n{r.stderr}"
    return exe


def judge(exe: Path, objects: list[dict], script: Path = HEALTH_LUA) -> list[dict]:
    """One {"kstatus", "kstatusMessage", "argo", "argoMessage"} per object."""
    r = subprocess.run([str(exe), str(script)], input="".join(json.dumps(o) + "\n" for o in objects),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(out) == len(objects) and not any(o.get("error") for o in out), out
    return out
