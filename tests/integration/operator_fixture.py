"""Run the real operator process (kopf) against the local control plane, for integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "deploy" / "samples"
CHECKPOINTS = SAMPLES / "checkpoints"


class OperatorProcess:
    def __init__(self, kubeconfig: str, log_path: Path, extra: list[str] | None = None):
        self.kubeconfig, self.log_path, self.extra = kubeconfig, log_path, extra or []
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "MOE_RESYNC_SECONDS": "2", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("operator", "runtime", "kernels"))}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_operator.cli", "run", "--kubeconfig", self.kubeconfig, "--standalone",
             "--metrics-port", "0", "--liveness", "", "--local-models-dir", str(CHECKPOINTS), *self.extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


def wait_for(fn: Callable[[], Any], timeout: float = 60, what: str = "condition", log: Callable[[], str] | None = None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except Exception as e:  # noqa: BLE001 - retry until the deadline
            last = e
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}\n" + (log() if log else ""))


def kubectl_json(kubectl, *args: str) -> Any:
    """`kubectl ARGS -o json`, parsed; a failing kubectl fails the test (get_json: None instead)."""
    return json.loads(kubectl(*args, "-o", "json").stdout)


def get_json(kubectl, *args: str) -> Any:
    r = kubectl("get", *args, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def condition(obj: dict | None, type_: str) -> dict | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return None
