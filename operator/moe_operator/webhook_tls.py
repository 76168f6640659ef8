"""The webhook's own TLS when no certificate directory is given (no cert-manager): a CA and the
serving certificate it signs, made with `cryptography` (no openssl binary: the image may be
distroless), renewed while the operator runs, and a self-check that admission is being served.

Renewal, at two thirds of the certificate's lifetime (`renew_at`): a new CA and certificate are
made, the CA bundle the API server trusts becomes old CA + new CA and is published (the chart's
configuration patched by `on_ca`, kopf's own one by yielding a new client config), and only after
the publication and a short propagation delay does the server load the new certificate, in place
(new handshakes use it; the listening socket is never closed). A failed publication keeps the old,
still valid certificate and retries. The CA key is discarded after signing: nothing else is ever
signed with it.

`HEALTH` is what the operator knows about its admission endpoint; /healthz shows it (the probe in
webhook.py) and the moe_operator_admission_* metrics export it. Degraded means: not listening, the
certificate expired or past its renewal time, or the self-check handshake (the published bundle
verifying the served certificate for the host the API server dials) failed.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ipaddress
import logging
import os
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import kopf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .metrics import ADMISSION_CERT_EXPIRY, ADMISSION_RENEWALS, ADMISSION_SERVING

log = logging.getLogger("moe_operator.webhook")
DAY = 86400.0
# The serving certificate's lifetime (90 days, as before); tests shorten it.
CERT_SECONDS = float(os.environ.get("MOE_WEBHOOK_CERT_SECONDS", str(90 * DAY)))
RENEW_FRACTION = 2 / 3
# Between publishing a new CA bundle and serving the certificate it verifies: the API server's
# informer must see the patched configuration first.
PROPAGATION_SECONDS = float(os.environ.get("MOE_WEBHOOK_PROPAGATION_SECONDS", "10"))
RETRY_SECONDS = 60.0  # a failed publication is retried this often (the old certificate still serves)
CHECK_SECONDS = float(os.environ.get("MOE_WEBHOOK_CHECK_SECONDS", "60"))  # the self-check's period
CLOCK_SKEW = dt.timedelta(minutes=5)  # notBefore this far back: API servers whose clock is behind


@dataclass(frozen=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes
    not_before: float  # epoch seconds of the serving certificate's validity
    not_after: float


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue(host: str, lifetime_s: float = CERT_SECONDS, now: float | None = None) -> Issued:
    """A new CA (P-256) and a serving certificate for `host` it signs, valid `lifetime_s` from now."""
    # whole seconds: X.509 times have no fraction, and Issued must say what the certificate says
    start = dt.datetime.fromtimestamp(int(time.time() if now is None else now), dt.timezone.utc)
    end = start + dt.timedelta(seconds=max(1, int(lifetime_s)))
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "moe-operator webhook CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start - CLOCK_SKEW).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start - CLOCK_SKEW).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([_san(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return Issued(cert.public_bytes(pem), key_pem, ca.public_bytes(pem), start.timestamp(), end.timestamp())


def renew_at(issued: Issued) -> float:
    """When to renew (epoch seconds): two thirds into the serving certificate's lifetime."""
    return issued.not_before + RENEW_FRACTION * (issued.not_after - issued.not_before)


def write(d: Path, issued: Issued) -> tuple[str, str, str]:
    """tls.crt, tls.key (mode 0600) and ca.crt in `d`, replaced atomically; returns their paths."""
    out = []
    for name, data in (("tls.crt", issued.cert_pem), ("tls.key", issued.key_pem), ("ca.crt", issued.ca_pem)):
        tmp = d / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, d / name)
        out.append(str(d / name))
    return out[0], out[1], out[2]


def operator_ca(host: str, lifetime_s: float = CERT_SECONDS) -> tuple[str, str, str]:
    """A CA and a serving certificate it signs, written to a new private directory: (cert, key, ca)."""
    return write(Path(tempfile.mkdtemp(prefix="moe-webhook-")), issue(host, lifetime_s))


# --- health ------------------------------------------------------------------------------------

@dataclass
class Health:
    """What the operator knows about its admission endpoint (one per process: HEALTH)."""

    enabled: bool = False
    listening: bool = False
    not_after: float | None = None  # of the certificate being served
    renew_at: float | None = None   # None: renewed by someone else (a certificate directory)
    renewals: int = 0
    last_error: str | None = None   # of the last renewal or publication attempt, cleared by a success
    check_ok: bool | None = None    # the last self-check handshake (None: not run yet)
    check_error: str | None = None
    degraded_logged: bool = field(default=False, repr=False)


HEALTH = Health()


def degraded_reason(h: Health, now: float) -> str | None:
    """Why admission is not (or soon not) being served, or None (pure)."""
    if not h.enabled:
        return None
    if not h.listening:
        return "NotListening: the webhook server is not listening"
    if h.not_after is not None and now >= h.not_after:
        return f"CertificateExpired: the serving certificate expired {now - h.not_after:.0f}s ago"
    if h.renew_at is not None and now >= h.renew_at + RETRY_SECONDS + PROPAGATION_SECONDS:
        return f"RenewalFailing: the certificate was due for renewal {now - h.renew_at:.0f}s ago: {h.last_error or 'pending'}"
    if h.check_ok is False:
        return f"SelfCheckFailed: {h.check_error}"
    return None


def detail(h: Health, now: float | None = None) -> dict[str, Any]:
    """The /healthz detail of admission; updates the metrics and logs a change of state once."""
    now = time.time() if now is None else now
    if not h.enabled:
        return {"enabled": False}
    reason = degraded_reason(h, now)
    ADMISSION_SERVING.set(0 if reason else 1)
    if h.not_after is not None:
        ADMISSION_CERT_EXPIRY.set(h.not_after)
    if bool(reason) != h.degraded_logged:
        h.degraded_logged = bool(reason)
        (log.warning if reason else log.info)("admission %s", f"degraded: {reason}" if reason else "served again")
    out: dict[str, Any] = {"enabled": True, "degraded": bool(reason), "listening": h.listening, "renewals": h.renewals}
    if reason:
        out["reason"] = reason
    if h.not_after is not None:
        out["certificateExpiresInSeconds"] = round(h.not_after - now)
    if h.renew_at is not None:
        out["renewInSeconds"] = round(h.renew_at - now)
    return out


def _not_after(cert_pem: bytes) -> float:
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc.timestamp()


async def self_check(host: str, addr: str | None, port: int, bundle: bytes, timeout: float = 5.0) -> str | None:
    """A TLS handshake with our own listener, verified as the API server verifies it (the published
    bundle, `host` as the name); None when it passes, else why not."""
    ctx = ssl.create_default_context(cadata=bundle.decode())
    dial = "127.0.0.1" if addr in (None, "", "0.0.0.0", "::") else addr
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(dial, port, ssl=ctx, server_hostname=host), timeout)
    except (OSError, ssl.SSLError, asyncio.TimeoutError) as e:
        return f"{type(e).__name__}: {e}"
    writer.close()
    try:
        await writer.wait_closed()
    except (OSError, ssl.SSLError):
        pass
    return None


async def _check_loop(h: Health, host: str, addr: str | None, port: int, bundle: Callable[[], bytes]) -> None:
    while True:
        err = await self_check(host, addr, port, bundle())
        h.check_ok, h.check_error = err is None, err
        detail(h)
        await asyncio.sleep(CHECK_SECONDS)


def _client_config(url: str, bundle: bytes) -> kopf.WebhookClientConfig:
    cfg = kopf.WebhookClientConfig(url=url)
    cfg["caBundle"] = base64.b64encode(bundle).decode("ascii")
    return cfg


class CheckedWebhookServer(kopf.WebhookServer):
    """kopf's server for a certificate directory (cert-manager or the chart's Secret: kopf reloads
    changed files itself), with the health record and the self-check."""

    health: Health = HEALTH

    async def __call__(self, fn: Any) -> AsyncIterator[kopf.WebhookClientConfig]:
        h = self.health
        h.enabled = True
        bundle = Path(self.cafile).read_bytes() if self.cafile else b""
        checker = None
        try:
            async for cfg in super().__call__(fn):
                h.listening = True
                h.not_after = _not_after(Path(self.certfile).read_bytes()) if self.certfile else None
                bundle = base64.b64decode(cfg.get("caBundle", "")) or bundle
                if checker is None and self.port:
                    checker = asyncio.create_task(_check_loop(h, self.host or "", self.addr, int(self.port), lambda: bundle))
                yield cfg
        finally:
            h.listening = False
            if checker:
                checker.cancel()


class RenewingWebhookServer(kopf.WebhookServer):
    """kopf's aiohttp server with a certificate this process issues and renews (module docstring).
    `on_ca(bundle)` publishes a CA bundle (blocking: it runs on a thread); the first bundle is
    `ca` of webhook.server() and is published by the caller."""

    health: Health = HEALTH

    def __init__(self, *, host: str, addr: str, port: int, lifetime_s: float = CERT_SECONDS,
                 on_ca: Callable[[bytes], None] | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="moe-webhook-"))
        self.lifetime_s, self.on_ca = lifetime_s, on_ca
        self.issued = issue(host, lifetime_s)
        certfile, pkeyfile, cafile = write(self.dir, self.issued)
        super().__init__(addr=addr, port=port, host=host, certfile=certfile, pkeyfile=pkeyfile, cafile=cafile)
        self.bundle = self.issued.ca_pem

    async def __call__(self, fn: Any) -> AsyncIterator[kopf.WebhookClientConfig]:
        import aiohttp.web

        async def _serve_fn(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return await self._serve(fn, request)

        h = self.health
        h.enabled = True
        context = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certfile, self.pkeyfile)
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.post(f"{(self.path or '').rstrip('/')}/{{id:.*}}", _serve_fn)])
        runner = aiohttp.web.AppRunner(app, handle_signals=False)
        await runner.setup()
        checker = None
        try:
            site = aiohttp.web.TCPSite(runner, self.addr or None, self.port, ssl_context=context,
                                       reuse_port=True, reuse_address=True)
            await site.start()
            h.listening, h.not_after, h.renew_at = True, self.issued.not_after, renew_at(self.issued)
            url = self._build_url("https", self.host, self.port, self.path or "")
            checker = asyncio.create_task(_check_loop(h, self.host, self.addr, int(self.port), lambda: self.bundle))
            yield _client_config(url, self.bundle)
            while True:
                await asyncio.sleep(max(0.0, renew_at(self.issued) - time.time()))
                new = issue(self.host, self.lifetime_s)
                bundle = self.issued.ca_pem + new.ca_pem  # trusted by the API server while it switches
                while not await self._publish(bundle):
                    await asyncio.sleep(min(RETRY_SECONDS, max(1.0, (self.issued.not_after - time.time()) / 10)))
                self.bundle = bundle
                yield _client_config(url, bundle)  # kopf patches the configuration it manages
                await asyncio.sleep(PROPAGATION_SECONDS)
                certfile, pkeyfile, _ = write(self.dir, new)
                context.load_cert_chain(certfile, pkeyfile)  # new handshakes; the socket stays open
                self.issued = new
                h.not_after, h.renew_at, h.renewals, h.last_error = new.not_after, renew_at(new), h.renewals + 1, None
                ADMISSION_RENEWALS.labels("ok").inc()
                log.info("webhook serving certificate renewed; valid until %s",
                         dt.datetime.fromtimestamp(new.not_after, dt.timezone.utc).isoformat())
                detail(h)
        finally:
            h.listening = False
            if checker:
                checker.cancel()
            await runner.cleanup()

    async def _publish(self, bundle: bytes) -> bool:
        if self.on_ca is None:
            return True
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.on_ca, bundle)
            return True
        except Exception as e:  # noqa: BLE001 - any failure: keep the old certificate and retry
            self.health.last_error = f"publishing the CA bundle failed: {type(e).__name__}: {e}"
            ADMISSION_RENEWALS.labels("publish_failed").inc()
            log.warning("webhook certificate renewal: %s (the current certificate is kept)", self.health.last_error)
            return False
