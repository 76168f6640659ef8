"""A non-streaming client that goes away mid-generation leaves no bare traceback in the JSON log
(issue 31 item 8): asyncio's "_GatheringFuture exception was never retrieved" was printed. A live
`moe-runtime serve` on the tiny checkpoint, a raw socket closed before the answer."""

import json
import socket
import time

from test_runtime_server import Server, make_checkpoint  # noqa: F401 - the same real server


def test_non_streaming_disconnect_logs_no_traceback(tmp_path):
    model = make_checkpoint(tmp_path / "m", "deepseek_v3", "nvfp4", "tiny")
    s = Server(model, tmp=tmp_path).wait_ready()
    try:
        body = json.dumps({"prompt": "hi", "max_tokens": 400, "ignore_eos": True}).encode()
        for _ in range(2):
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(0.3)
            c.close()
        time.sleep(1.5)
        import httpx
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        logs = s.logs()
        assert "Traceback" not in logs and "never retrieved" not in logs, logs[-2000:]
        assert all(line.startswith("{") for line in logs.splitlines() if line.strip()), logs[-2000:]
    finally:
        s.stop()
