"""A deadline for every hub request made on the operator's hub pool, retries included.

huggingface_hub retries a timed-out or 5xx request itself (`http_backoff`: up to 5 retries with
backoff), so one inspection with a 10 s request timeout can hold a hub-pool thread for about six
timeouts. A request hook on the hub client checks the calling thread's deadline before each
request and raises `HubDeadline`, an exception the client does not retry: a thread is back in the
pool at most one request timeout (plus one backoff sleep) after its deadline.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

_local = threading.local()
_installed = threading.Lock()
_done = False


class HubDeadline(Exception):
    """The inspection's deadline passed before this request was sent."""


def _hook(request) -> None:
    deadline = getattr(_local, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise HubDeadline(f"deadline passed before {request.method} {request.url.path}")


def install() -> None:
    """Add the hook to the hub client huggingface_hub builds (now and after it rebuilds it)."""
    global _done
    with _installed:
        if _done:
            return
        from huggingface_hub import set_client_factory
        from huggingface_hub.utils import _http

        base = _http.default_client_factory

        def factory():
            client = base()
            hooks = dict(client.event_hooks)
            client.event_hooks = {**hooks, "request": [*hooks.get("request", []), _hook]}
            return client

        set_client_factory(factory)
        _done = True


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Hub requests made by this thread inside the block fail with HubDeadline after `seconds`."""
    install()
    before = getattr(_local, "deadline", None)
    _local.deadline = time.monotonic() + seconds
    try:
        yield
    finally:
        _local.deadline = before
