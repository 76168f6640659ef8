"""A short API-server outage (issue 34 item 5), against the real API server: the operator reaches it
through a TCP proxy of this module that drops every connection and refuses new ones for a while
(the shared fixture's API server keeps serving the other tests). Meanwhile an owned ConfigMap is
deleted and a new MoEDeployment created. Asserted: no traceback in the log, at most one line per
kind of failure, and recovery (the new object Planned, the ConfigMap back) once the API answers."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from .operator_fixture import OperatorProcess, wait_for
from .test_operator import apply_sample, wait_planned

OUTAGE_SECONDS = 25


class Proxy:
    """127.0.0.1:port -> the API server, byte for byte (TLS end to end). `cut()` closes every
    connection and the listener (connection refused, as a stopped API server); `restore()` listens
    again on the same port."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.port = 0
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self.port = s.getsockname()[1]
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:
                    client.close(), upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture(scope="module")
def proxied(crd, kubeconfig, tmp_path_factory):
    kc = yaml.safe_load(Path(kubeconfig).read_text())
    server = kc["clusters"][0]["cluster"]["server"]
    host, port = re.match(r"https://([^:/]+):(\d+)", server).groups()
    proxy = Proxy((host, int(port)))
    for c in kc["clusters"]:
        c["cluster"]["server"] = f"https://{host}:{proxy.port}"
    d = tmp_path_factory.mktemp("outage")
    (d / "kubeconfig").write_text(yaml.safe_dump(kc))
    op = OperatorProcess(str(d / "kubeconfig"), d / "operator.log")
    op.start()
    time.sleep(2)
    yield proxy, op
    op.stop()
    proxy.cut()


def _warnings(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "level=WARNING" in ln or "level=ERROR" in ln]


def _kind(line: str) -> str:
    """A failure's kind: the message up to its first colon or parenthesis, numbers and names left out."""
    msg = line.split("msg=", 1)[-1]
    return re.sub(r"[0-9]+", "N", re.split(r"[:(]", msg, maxsplit=1)[0]).strip()


def test_an_api_outage_logs_one_line_per_kind_no_traceback_and_recovers(kubectl, namespace, proxied):
    proxy, op = proxied
    first = apply_sample(kubectl, namespace, "qwen3-moe-fp8.yaml")["metadata"]["name"]
    wait_planned(kubectl, namespace, first, op)
    wait_for(lambda: kubectl("get", "configmap", f"{first}-plan", "-n", namespace, check=False).returncode == 0,
             30, "plan ConfigMap", op.log_tail)
    time.sleep(3)
    start = len(op.log_path.read_text(errors="replace").splitlines())

    proxy.cut()
    t_cut = time.monotonic()
    kubectl("delete", "configmap", f"{first}-plan", "-n", namespace)  # the admin kubectl goes direct
    second = apply_sample(kubectl, namespace, "gpt-oss-mxfp4-h100.yaml")["metadata"]["name"]
    time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - t_cut)))
    proxy.restore()

    wait_planned(kubectl, namespace, second, op, timeout=90)
    wait_for(lambda: kubectl("get", "configmap", f"{first}-plan", "-n", namespace, check=False).returncode == 0,
             60, "plan ConfigMap back", op.log_tail)
    wait_for(lambda: "watches of the operator's objects: back" in op.log_path.read_text(errors="replace"),
             30, "the watches back", op.log_tail)
    lines = op.log_path.read_text(errors="replace").splitlines()[start:]
    text = "\n".join(lines)
    assert "Traceback" not in text, text[-4000:]
    kinds = Counter(_kind(ln) for ln in _warnings(text))
    repeated = {k: n for k, n in kinds.items() if n > 1}
    assert kinds, "the outage left no line at all"
    assert not repeated, f"kinds of failure logged more than once: {repeated}\n" + "\n".join(_warnings(text))[-4000:]
