"""huggingface_hub retries 5xx answers and timeouts itself (http_backoff, 5 retries); the hub-pool
deadline stops those retries (hub_deadline.py), so a failing hub frees a pool thread soon after the
deadline instead of about six request timeouts later. The real client against a socket that answers
503 to everything."""

import socket
import threading
import time

import pytest

from moe_operator import hub_deadline, inspection

ANSWER = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"


@pytest.fixture
def failing_hub(monkeypatch):
    import huggingface_hub.constants as c

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    hits = []

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            hits.append(time.monotonic())
            try:
                conn.recv(65536)
                conn.sendall(ANSWER)
            finally:
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    monkeypatch.setattr(c, "ENDPOINT", url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    yield hits
    srv.close()


def test_the_deadline_stops_the_clients_own_retries(failing_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    t = time.monotonic()
    with pytest.raises(inspection.InspectionFailed) as e, hub_deadline.within(1.5):
        inspection.inspect_hf("hf://org/m@" + "a" * 40, None)  # hf_hub_download retries its HEAD
    took = time.monotonic() - t
    assert e.value.reason == "HubTimeout" and "deadline passed" in e.value.message
    assert took < 6, took  # the client alone would retry 5 times with 1+2+4+8+8 s of backoff
    assert 1 <= len(failing_hub) < 6  # fewer than the client's own 1 + 5 retries


def test_outside_a_deadline_nothing_is_stopped():
    hub_deadline.install()
    assert getattr(hub_deadline._local, "deadline", None) is None
    with hub_deadline.within(0):
        time.sleep(0.01)
        with pytest.raises(hub_deadline.HubDeadline):
            hub_deadline._hook(type("R", (), {"method": "GET", "url": type("U", (), {"path": "/x"})()})())
    hub_deadline._hook(None)  # no deadline on this thread any more: the hook passes


def test_a_failed_hub_call_is_answered_from_memory_for_its_retry_delay(failing_hub, tmp_path, monkeypatch):
    """issue 32 item 7: reconciles in between get the same failure and the hub is not asked again."""
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(inspection, "HUB_WAIT_SECONDS", 10.0)
    inspection.reset()
    uri = "hf://org/m"  # model_info: answered 503 at once (no client retry)
    with pytest.raises(inspection.InspectionFailed) as first:
        inspection._hub_call(("resolve", uri), lambda: inspection.resolve_revision(uri, None), uri, "reading the headers")
    asked = len(failing_hub)
    with pytest.raises(inspection.InspectionFailed) as again:
        inspection._hub_call(("resolve", uri), lambda: inspection.resolve_revision(uri, None), uri, "reading the headers")
    assert again.value is first.value and len(failing_hub) == asked  # not asked again
    monkeypatch.setattr(inspection, "FAILED_HOLD_SECONDS", {True: 0.0, False: 0.0})
    inspection._failed[("resolve", uri)] = (0.0, first.value)  # the hold is over: the hub is asked
    inspection.HUB._entries.clear()  # (and the pool's own 5 s hold of a failure)
    with pytest.raises(inspection.InspectionFailed):
        inspection._hub_call(("resolve", uri), lambda: inspection.resolve_revision(uri, None), uri, "reading the headers")
    assert len(failing_hub) > asked
    inspection.reset()
