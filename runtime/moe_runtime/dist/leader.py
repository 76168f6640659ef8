"""Leader / follower: the engine runs on rank 0; every model call is mirrored on the other ranks over
the group's gloo control channel. A rank that can no longer follow exits non-zero naming why."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from ..log import log
from .group import Group


def fatal(msg: str) -> None:
    """A rank that can no longer follow the group: one error line, exit 1 (the launcher takes the rest down)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    log("fatal", msg)
    os._exit(1)


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _mirrored_methods(model) -> set[str]:
    """The model's own methods (CausalLM's, not nn.Module's): the calls that change or read its state."""
    names = set()
    for cls in type(model).__mro__:
        if cls in (nn.Module, object):
            break
        names.update(n for n, v in vars(cls).items() if callable(v) and not n.startswith("_"))
    return names


class LeaderModel:
    """Rank 0's model: each call is broadcast to the followers (the batch of every step), then run here.
    A heartbeat keeps idle followers inside their collective timeout; a failed call is fatal."""

    def __init__(self, model, group: Group):
        self._model, self._g = model, group
        self._lock = threading.Lock()
        self._last = time.time()
        self._stopped = False
        self._mirrored = _mirrored_methods(model)
        self._beat = max(min(group.collective_timeout / 4, 10.0), 0.05)
        threading.Thread(target=self._heartbeat, name="moe-heartbeat", daemon=True).start()

    def _send(self, cmd) -> None:
        with self._lock:
            if self._stopped:
                return
            dist.broadcast_object_list([cmd], src=0, group=self._g.ctrl)
            self._last = time.time()

    def _heartbeat(self) -> None:
        while not self._stopped:
            time.sleep(self._beat)
            if time.time() - self._last >= self._beat:
                try:
                    self._send(("ping",))
                except Exception as e:  # noqa: BLE001
                    if not self._stopped:
                        fatal(f"rank 0: a follower rank is gone (control channel: {type(e).__name__}: {e}); "
                              "the group goes down")

    def _call(self, name: str, args, kwargs):
        try:
            self._send((name, _to(args, "cpu"), _to(kwargs, "cpu")))
            fn = self._model if name == "__call__" else getattr(self._model, name)
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the followers are out of step now
            fatal(f"rank 0: model call {name} failed with the group of {self._g.layout.world} "
                  f"({type(e).__name__}: {e}); the group goes down")

    def __call__(self, *args, **kwargs):
        return self._call("__call__", args, kwargs)

    def __getattr__(self, name):
        attr = getattr(self._model, name)
        if name in self._mirrored:
            return lambda *a, **k: self._call(name, a, k)
        return attr

    def stop(self) -> None:
        try:
            self._send(("stop",))
        except Exception:  # noqa: BLE001 - followers already gone
            pass
        self._stopped = True


def follow(model, group: Group) -> int:
    """A non-zero rank: run every call rank 0 broadcasts until it says stop. A failed collective (rank 0
    gone, or silent past the timeout) is fatal with the cause."""
    r = group.layout.rank
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=group.ctrl)
        except Exception as e:  # noqa: BLE001
            fatal(f"rank {r}: rank 0 is gone or silent for more than {group.collective_timeout:.0f}s "
                  f"({type(e).__name__}: {e}); the group goes down")
        cmd = box[0]
        if cmd[0] == "ping":
            continue
        if cmd[0] == "stop":
            log("shutdown", f"rank {r}: rank 0 stopped; exiting", rank=r)
            return 0
        name, args, kwargs = cmd
        try:
            fn = model if name == "__call__" else getattr(model, name)
            with torch.inference_mode():
                fn(*_to(args, group.device), **_to(kwargs, group.device))
        except Exception as e:  # noqa: BLE001
            fatal(f"rank {r}: model call {name} failed ({type(e).__name__}: {e}); the group goes down")
