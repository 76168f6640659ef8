"""The ASGI guard around the app: API key, body-size limit, a JSON 500 for any exception, and
request/error metrics labelled by route template."""

from __future__ import annotations

import hmac

from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..log import log
from .protocol import ERROR_TYPES, error
from .state import ServerState


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than this server's limit of {limit} bytes")


class Guard:
    """Pure ASGI middleware around the app: API key, body-size limit (413, whether or not the
    client sent Content-Length), a JSON 500 for any exception, and request/error metrics labelled
    by route template (never the raw path)."""

    PUBLIC = ("/health", "/ready", "/metrics", "/version")

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        opts, m = self.state.options, self.state.metrics
        status: list[int] = []

        async def send_(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        async def respond(resp: Response):
            await resp(scope, receive, send_)

        try:
            if opts.api_key and scope["path"] not in self.PUBLIC and not self._authorized(scope, opts.api_key):
                await respond(error(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                return
            limit = opts.max_body_bytes
            length = self._header(scope, b"content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                await respond(error(413, _BodyTooLarge(limit).detail) if length.isdigit()
                              else error(400, f"invalid Content-Length header {length!r}"))
                return
            seen = 0

            async def receive_():
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > limit:
                        raise _BodyTooLarge(limit)
                return message

            await self.app(scope, receive_, send_)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the client gets JSON, not a traceback
            log("http_error", f"{scope.get('method')} {self._route(scope)}: {type(e).__name__}: {e}")
            if not status:
                await respond(error(500, f"internal server error: {type(e).__name__}", "server_error"))
        finally:
            code = status[0] if status else 499  # no response at all: the client went away
            route = self._route(scope)
            m.requests.labels(route, str(code)).inc()
            if code >= 400:
                m.errors.labels(route, ERROR_TYPES.get(code, "server_error" if code >= 500 else "invalid_request_error")).inc()

    @staticmethod
    def _header(scope, name: bytes) -> str | None:
        for k, v in scope.get("headers", ()):
            if k.lower() == name:
                return v.decode("latin-1").strip()
        return None

    def _authorized(self, scope, key: str) -> bool:
        auth = self._header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    @staticmethod
    def _route(scope) -> str:
        route = scope.get("route")
        return getattr(route, "path", None) or "unmatched"

