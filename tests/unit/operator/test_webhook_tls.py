"""The webhook's own certificate (issue 26 item 6): made with `cryptography`, renewed while serving
at two thirds of its lifetime with the new CA published before the new certificate is served, and
a Degraded signal (metric + /healthz detail) when admission is not being served."""

import asyncio
import ssl
import time

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from moe_operator import webhook_tls
from moe_operator.metrics import ADMISSION_SERVING
from moe_operator.webhook_tls import Health, Issued, degraded_reason, detail, issue, renew_at


def _certs(pem: bytes) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(pem)


@pytest.mark.parametrize("host,san", [("moe-operator-webhook.moe-system.svc", x509.DNSName),
                                      ("127.0.0.1", x509.IPAddress)])
def test_issued_certificate_is_signed_by_its_ca_for_the_host(host, san):
    now = time.time()
    got = issue(host, 3600, now=now)
    ca, = _certs(got.ca_pem)
    cert, = _certs(got.cert_pem)
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(v) for v in names.get_values_for_type(san)] == [host]
    assert ExtendedKeyUsageOID.SERVER_AUTH in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_after_utc.timestamp() == pytest.approx(now + 3600, abs=1) == got.not_after
    assert got.not_after - got.not_before == pytest.approx(3600)
    assert b"PRIVATE KEY" in got.key_pem and b"PRIVATE KEY" not in got.cert_pem + got.ca_pem
    other = issue(host, 3600)
    assert other.ca_pem != got.ca_pem  # a new CA each time: its key is never kept


def test_renewal_is_due_at_two_thirds_of_the_lifetime():
    i = Issued(b"", b"", b"", not_before=1000.0, not_after=1000.0 + 90 * 86400)
    assert renew_at(i) == pytest.approx(1000.0 + 60 * 86400)


def test_degraded_reasons():
    h = Health(enabled=True, listening=True, not_after=1000.0, renew_at=800.0, check_ok=True)
    assert degraded_reason(h, 500.0) is None
    assert degraded_reason(Health(), 500.0) is None  # admission off: nothing to serve
    assert degraded_reason(Health(enabled=True), 500.0).startswith("NotListening")
    assert degraded_reason(h, 1001.0).startswith("CertificateExpired")
    late = 800.0 + webhook_tls.RETRY_SECONDS + webhook_tls.PROPAGATION_SECONDS
    assert degraded_reason(h, late - 1) is None and degraded_reason(h, late).startswith("RenewalFailing")
    bad = Health(enabled=True, listening=True, not_after=1000.0, check_ok=False, check_error="SSLError: verify failed")
    assert degraded_reason(bad, 500.0) == "SelfCheckFailed: SSLError: verify failed"
    d = detail(bad, now=500.0)
    assert d["degraded"] is True and d["reason"].startswith("SelfCheckFailed") and ADMISSION_SERVING._value.get() == 0
    assert detail(h, now=500.0) == {"enabled": True, "degraded": False, "listening": True, "renewals": 0,
                                    "certificateExpiresInSeconds": 500, "renewInSeconds": 300}
    assert ADMISSION_SERVING._value.get() == 1


async def _served_cert(port: int, bundle: bytes, host: str = "127.0.0.1") -> x509.Certificate:
    ctx = ssl.create_default_context(cadata=bundle.decode())
    _, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=host)
    der = w.get_extra_info("ssl_object").getpeercert(binary_form=True)
    w.close()
    return x509.load_der_x509_certificate(der)


async def _stop(pending: asyncio.Future, gen) -> None:
    """Cancel the generator's pending step (its finally closes the listener), then close it."""
    pending.cancel()
    try:
        await pending
    except (asyncio.CancelledError, StopAsyncIteration):
        pass
    await gen.aclose()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_short_lived_certificate_is_renewed_while_serving(monkeypatch):
    """Lifetime 3 s: at 2 s a new CA is published (old + new CA in one bundle) before the new
    certificate is served on the same socket; handshakes verified with the published bundles pass
    before and after, the health record counts the renewal and is not Degraded."""
    monkeypatch.setattr(webhook_tls, "PROPAGATION_SECONDS", 0.2)
    monkeypatch.setattr(webhook_tls, "CHECK_SECONDS", 0.2)
    published: list[bytes] = []
    health = Health()
    port = _free_port()
    srv = webhook_tls.RenewingWebhookServer(host="127.0.0.1", addr="127.0.0.1", port=port, lifetime_s=3,
                                            on_ca=published.append)
    srv.health = health

    async def scenario():
        gen = srv(lambda *a, **k: None)
        first = await gen.__anext__()
        bundle0 = srv.bundle
        assert _certs(bundle0) == _certs(srv.issued.ca_pem)
        cert0 = await _served_cert(port, bundle0)
        nxt = asyncio.ensure_future(gen.__anext__())
        second = await asyncio.wait_for(nxt, 3)  # yielded at publication, before the swap
        assert len(published) == 1 and published[0] == second_bundle(second)
        assert len(_certs(published[0])) == 2 and _certs(published[0])[0] == _certs(bundle0)[0]
        assert (await _served_cert(port, published[0])).serial_number == cert0.serial_number  # not yet swapped
        swap = asyncio.ensure_future(gen.__anext__())  # runs the swap, then waits for the next renewal
        deadline = time.monotonic() + 3
        while health.renewals < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cert1 = await _served_cert(port, published[0])
        assert cert1.serial_number != cert0.serial_number
        cert1.verify_directly_issued_by(_certs(published[0])[1])  # signed by the new CA
        assert cert1.not_valid_after_utc.timestamp() > cert0.not_valid_after_utc.timestamp()
        await asyncio.sleep(0.3)  # a self-check round against the new certificate
        assert health.check_ok is True and detail(health)["degraded"] is False and health.renewals == 1
        await _stop(swap, gen)
        assert not health.listening and first["url"] == f"https://127.0.0.1:{port}"

    def second_bundle(cfg):
        import base64

        return base64.b64decode(cfg["caBundle"])

    asyncio.run(scenario())


def test_a_failed_publication_keeps_the_old_certificate(monkeypatch):
    monkeypatch.setattr(webhook_tls, "PROPAGATION_SECONDS", 0.1)
    monkeypatch.setattr(webhook_tls, "RETRY_SECONDS", 0.2)
    monkeypatch.setattr(webhook_tls, "RENEW_FRACTION", 1 / 3)  # due at 1 s of 3: checked well before expiry
    calls = []

    def refuse(bundle):
        calls.append(bundle)
        raise RuntimeError("HTTP 403: forbidden")

    health = Health()
    port = _free_port()
    srv = webhook_tls.RenewingWebhookServer(host="127.0.0.1", addr="127.0.0.1", port=port, lifetime_s=3, on_ca=refuse)
    srv.health = health

    async def scenario():
        gen = srv(lambda *a, **k: None)
        await gen.__anext__()
        cert0 = await _served_cert(port, srv.bundle)
        nxt = asyncio.ensure_future(gen.__anext__())
        deadline = time.monotonic() + 2.5
        while len(calls) < 2 and time.monotonic() < deadline:  # refused, then retried
            await asyncio.sleep(0.05)
        assert len(calls) >= 2 and not nxt.done() and health.renewals == 0
        assert "HTTP 403" in health.last_error
        assert (await _served_cert(port, srv.bundle)).serial_number == cert0.serial_number
        await _stop(nxt, gen)

    asyncio.run(scenario())


def test_a_certificate_directory_is_served_checked_and_reported(tmp_path, monkeypatch):
    """cert-manager's layout (tls.crt, tls.key, ca.crt): kopf's server with the health record and
    the self-check; the expiry reported is the mounted certificate's, no renewal of our own."""
    from pathlib import Path

    from moe_operator.webhook import server

    monkeypatch.setattr(webhook_tls, "CHECK_SECONDS", 0.1)
    webhook_tls.write(tmp_path, issue("127.0.0.1", 7200))
    port = _free_port()
    srv, ca = server(f"127.0.0.1:{port}", cert_dir=str(tmp_path))
    assert isinstance(srv, webhook_tls.CheckedWebhookServer) and ca == (tmp_path / "ca.crt").read_bytes()
    health = Health()
    srv.health = health

    async def scenario():
        async with srv:  # kopf closes its servers' generators on exit
            await check(srv(lambda *a, **k: None))
        assert not health.listening

    async def check(gen):
        await gen.__anext__()
        deadline = time.monotonic() + 3
        while health.check_ok is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        d = detail(health)
        assert health.check_ok is True and d["degraded"] is False and "renewInSeconds" not in d
        assert 7100 < d["certificateExpiresInSeconds"] <= 7200
        cert = await _served_cert(port, Path(tmp_path / "ca.crt").read_bytes())
        assert cert == x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())

    asyncio.run(scenario())
