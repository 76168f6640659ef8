"""The HTTP layer: OpenAI wire format (protocol), the ASGI guard (guard), the app with its named
handlers (app), generation output and SSE (streaming), and what serve hands it (state)."""
