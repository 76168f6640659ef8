"""Locate (and if needed build) the control plane binaries.

The build itself lives in `deploy/local/build.sh` (one Go module, one `go build`, cached by
version). This module only runs it and parses its last stdout line `BIN_DIR=...`, so the cache
key is computed in exactly one place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .log import log

BINARY_NAMES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")
ENV_BIN_DIR = "MOE_K8S_BIN_DIR"  # use prebuilt binaries from this dir, never build


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class Binaries:
    dir: Path

    def __getattr__(self, name: str) -> Path:  # binaries.kube_apiserver -> dir/kube-apiserver
        if name.startswith("_"):
            raise AttributeError(name)
        exe = name.replace("_", "-")
        if exe not in BINARY_NAMES:
            raise AttributeError(name)
        return self.dir / exe

    def path(self, name: str) -> Path:
        return self.dir / name

    @property
    def kwok_stages(self) -> Path:
        return self.dir / "kwok-stages.yaml"

    def missing(self) -> list[str]:
        names = [n for n in BINARY_NAMES if not os.access(self.dir / n, os.X_OK)]
        if not self.kwok_stages.is_file():
            names.append("kwok-stages.yaml")
        return names


def repo_root() -> Path | None:
    """The checkout this package runs from (editable install or PYTHONPATH), if any."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "deploy" / "local" / "build.sh").is_file():
            return parent
    return None


def build_script() -> Path:
    root = repo_root()
    if root is None:
        raise BuildError(
            "deploy/local/build.sh not found: run from a moe-operator checkout "
            f"(pip install -e .) or set {ENV_BIN_DIR} to a directory with prebuilt binaries"
        )
    return root / "deploy" / "local" / "build.sh"


def ensure_binaries(build: bool = True) -> Binaries:
    """Return the binaries for the pinned versions, building them first when the cache is cold.
    Build progress streams to stderr; on failure the error carries the go error tail."""
    if os.environ.get(ENV_BIN_DIR):
        b = Binaries(Path(os.environ[ENV_BIN_DIR]))
        if missing := b.missing():
            raise BuildError(f"{ENV_BIN_DIR}={b.dir} lacks {', '.join(missing)}")
        return b
    script = build_script()
    args = ["bash", str(script)] + ([] if build else ["--print-dir"])
    t0 = time.monotonic()
    # stderr is inherited so the user sees the build's own progress lines live.
    proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=None if build else subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BIN_DIR=")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or "").strip()[-2000:] if not build else "(see the [k8s-build] lines above)"
        raise BuildError(f"{script} failed with exit code {proc.returncode}: {tail}")
    b = Binaries(Path(lines[-1].split("=", 1)[1]))
    if missing := b.missing():
        hint = "" if build else " (not built yet: run deploy/local/build.sh)"
        raise BuildError(f"{b.dir} lacks {', '.join(missing)}{hint}")
    if build:
        log(f"binaries ready in {time.monotonic() - t0:.1f}s: {b.dir}")
    return b


if __name__ == "__main__":  # python -m moe_operator.devcluster.binaries
    try:
        print(ensure_binaries().dir)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
