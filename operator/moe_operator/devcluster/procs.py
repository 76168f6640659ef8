"""Start and stop the component processes; nothing here knows what the components are.

Every process is started in its own session (so a Ctrl-C in the terminal that ran `up` does not
take the cluster down with it) with its output in a log file. Stopping is by PID only, and only
after checking that /proc/<pid>/cmdline is still the command we started: a PID recorded in an old
state file may have been reused by an unrelated process since.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Popen handles of the processes this Python process started: a child that exits stays a zombie
# (still listed in /proc) until its parent waits for it, so stop() reaps through these.
_CHILDREN: dict[int, subprocess.Popen] = {}


@dataclass
class Proc:
    name: str
    pid: int
    argv: list[str]
    log: str

    def to_json(self) -> dict:
        return asdict(self)


def free_port() -> int:
    """A loopback port that is free right now. Another process may take it before the component
    binds it; callers detect that from the component's exit and retry with new ports."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes

    PR_SET_PDEATHSIG = 1
    # SIGKILL, not SIGTERM: with etcd gone at the same moment, a gracefully stopping API server
    # waits on it for many seconds; the data is thrown away anyway.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
          die_with_parent: bool = False) -> Proc:
    """Start `argv` in its own session with output appended to `log_path`.

    die_with_parent: the kernel sends SIGKILL to the process when this one dies, however it dies
    (a test run killed by a timeout leaves no control plane behind). Off for `dev-cluster up`,
    whose processes must outlive the CLI."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, **(env or {})},
                             preexec_fn=_die_with_parent if die_with_parent else None)
    _CHILDREN[p.pid] = p
    return Proc(name=name, pid=p.pid, argv=argv, log=str(log_path))


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw.decode(errors="replace").rstrip("\0").split("\0") if raw else []


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def is_ours(proc: Proc) -> bool:
    """True while `proc` is alive and still runs the command we started.

    For a child of this Python process the Popen handle decides: its PID cannot be reused before
    we reap it. Otherwise (started by an earlier `up`) /proc/<pid>/cmdline must still match."""
    child = _CHILDREN.get(proc.pid)
    if child is not None:
        return child.poll() is None
    cmd = _cmdline(proc.pid)
    return bool(cmd) and cmd == proc.argv and not _is_zombie(proc.pid)


def exited(proc: Proc) -> int | None:
    """Exit code if we started it in this process and it has exited, else None."""
    child = _CHILDREN.get(proc.pid)
    return child.poll() if child is not None else None


def stop(proc: Proc, timeout: float = 15.0) -> bool:
    """SIGTERM, then SIGKILL after `timeout`; returns True if a process of ours was stopped."""
    if not is_ours(proc):
        return False
    try:
        os.kill(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_ours(proc):
            break
        time.sleep(0.1)
    else:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while is_ours(proc) and time.monotonic() < deadline + 5:
            time.sleep(0.1)
    child = _CHILDREN.pop(proc.pid, None)
    if child is not None:
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    return True


def log_tail(proc: Proc, lines: int = 25) -> str:
    """Last lines of this run of the component (logs are appended across runs; each run starts
    with a `==== <time> <argv>` header, so older runs' errors are not reported as this one's)."""
    try:
        text = Path(proc.log).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    starts = [i for i, ln in enumerate(text) if ln.startswith("==== ")]
    text = text[starts[-1] + 1:] if starts else text
    return "\n".join("    " + ln for ln in text[-lines:]) or "    (no output)"
