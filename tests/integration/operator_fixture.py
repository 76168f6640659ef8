"""Run the real operator process (kopf) against the local control plane, for integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
# The file:///models/... samples of the demo, which the operator tests plan from the header-only
# checkpoints; deploy/samples/*.yaml (hf://, pvc://) are the golden path (test_golden_path.py).
SAMPLES = ROOT / "deploy" / "samples" / "demo"
GOLDEN_SAMPLES = ROOT / "deploy" / "samples"
CHECKPOINTS = ROOT / "deploy" / "samples" / "checkpoints"
# the demo samples' file:///models/..., and the temporary checkpoints tests write (as the demo allows /models)
ALLOWED_HOST_PATHS = ("/models", tempfile.gettempdir())
HOST_PATH_ARGS = [a for p in ALLOWED_HOST_PATHS for a in ("--allow-host-path", p)]


class OperatorProcess:
    def __init__(self, kubeconfig: str, log_path: Path, extra: list[str] | None = None, demo_models: bool = True,
                 env: dict[str, str] | None = None):
        """demo_models: --local-models-dir and the allowed host paths of the demo samples; False runs
        the operator with only `extra` (e.g. the chart's own policy flags)."""
        self.kubeconfig, self.log_path, self.extra = kubeconfig, log_path, extra or []
        self.demo_models, self.env = demo_models, env or {}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "MOE_RESYNC_SECONDS": "2", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("operator", "runtime", "kernels")), **self.env}
        log = open(self.log_path, "ab")
        models = ["--local-models-dir", str(CHECKPOINTS), *HOST_PATH_ARGS] if self.demo_models else []
        liveness = [] if any(a.startswith("--liveness") for a in self.extra) else ["--liveness", ""]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_operator.cli", "run", "--kubeconfig", self.kubeconfig, "--standalone",
             "--metrics-port", "0", *liveness, *models, *self.extra],
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


def chart_service_account_kubeconfig(dev_cluster, kubectl, out: Path, release: str = "moe-it",
                                     namespace: str = "moe-it-system", sets: tuple[str, ...] = ()) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a TokenRequest token), with
    exactly the chart's RBAC applied: the operator under test has what a real install gives it."""
    import yaml

    kubectl("create", "namespace", namespace, check=False)
    rendered = dev_cluster.helm("template", release, str(ROOT / "charts" / "moe-operator"), "-n", namespace,
                                "--show-only", "templates/rbac.yaml", "--show-only", "templates/serviceaccount.yaml",
                                *[a for s in sets for a in ("--set", s)]).stdout
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=moe-it", "-f", "-", input=rendered)
    sa = f"{release}-moe-operator"
    token = kubectl("-n", namespace, "create", "token", sa, "--duration=4h").stdout.strip()
    kc = yaml.safe_load(Path(dev_cluster.kubeconfig).read_text())
    for u in kc["users"]:
        u["user"] = {"token": token}
    out.write_text(yaml.safe_dump(kc))
    who = kubectl("--kubeconfig", str(out), "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").stdout
    assert who == f"system:serviceaccount:{namespace}:{sa}", who
    return out


def forbidden_lines(log_text: str) -> list[str]:
    """Requests the API server refused for lack of permission (not the refusals of writes into a
    namespace a test is deleting, which say so in the same line)."""
    lines = log_text.splitlines()
    out = []
    for i, ln in enumerate(lines):
        if not ("Forbidden" in ln or " 403" in ln or "forbidden" in ln):
            continue
        # The API server words this refusal two ways: the reason NamespaceTerminating (in the
        # structured body, maybe on a following line) or the message itself.
        window = lines[i:i + 3]
        if any("NamespaceTerminating" in x or "because it is being terminated" in x for x in window):
            continue
        out.append(ln)
    return out


def start_webhook_operator(kubeconfig: str, log_path: Path) -> tuple[OperatorProcess, int]:
    """An operator serving the validating webhook on a free 127.0.0.1 port (kopf manages the
    ValidatingWebhookConfiguration, by URL); the caller stops it and deletes that configuration."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    op = OperatorProcess(kubeconfig, log_path, ["--admission", f"127.0.0.1:{port}"])
    op.start()
    return op, port


def token_kubeconfig(dev_cluster, kubectl, namespace: str, service_account: str, out: Path) -> Path:
    """A kubeconfig authenticating as an existing ServiceAccount (e.g. the one a chart release
    created, with the RBAC that release installed)."""
    import yaml

    token = kubectl("-n", namespace, "create", "token", service_account, "--duration=2h").stdout.strip()
    kc = yaml.safe_load(Path(dev_cluster.kubeconfig).read_text())
    for u in kc["users"]:
        u["user"] = {"token": token}
    out.write_text(yaml.safe_dump(kc))
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
