"""A minimal REST client for the few calls the launcher makes itself (health, nodes).

Why not the `kubernetes` package: importing it costs a second and it is overkill for a readiness
poll and a bulk POST; this keeps `moe-operator dev-cluster status` instant. Tests and the operator
use the real client (or kubectl) against the written kubeconfig.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Api:
    def __init__(self, server: str, token: str, ca_pem: str | None):
        self.server = server.rstrip("/")
        self.token = token
        # Without a CA (a kubeconfig that trusts the system roots) fall back to the system store.
        self.ctx = ssl.create_default_context(cadata=ca_pem) if ca_pem else ssl.create_default_context()

    def request(self, method: str, path: str, body: Any = None, timeout: float = 10.0,
                content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                text = json.loads(text).get("message", text)
            except (ValueError, AttributeError):
                pass
            raise ApiError(e.code, text) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any, **kw: Any) -> Any:
        return self.request("POST", path, body, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("DELETE", path, **kw)


def probe(url: str, ctx: ssl.SSLContext | None = None, token: str | None = None, timeout: float = 2.0) -> tuple[bool, str]:
    """GET `url`; (True, body) on HTTP 200, else (False, reason). Never raises."""
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
            return resp.status == 200, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return False, e.read().decode(errors="replace")
    except (OSError, ValueError) as e:
        return False, str(e)
