"""Key material of the dev cluster, generated with the `openssl` CLI (present on every Debian
machine; the `cryptography` wheel is not a dependency of the operator):

- a cluster CA (root CA of the controller-manager, CSR signer, kubeconfig trust anchor),
- the API server's serving certificate for 127.0.0.1/localhost and the in-cluster names,
- the service-account key pair (API server verifies with the public key, signs with the private
  key; the controller manager signs legacy tokens with it),
- random bearer tokens for the static token file (admin in system:masters, and one identity per
  control plane component so RBAC sees the usual bootstrap users).
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


class PkiError(RuntimeError):
    pass


@dataclass(frozen=True)
class Pki:
    dir: Path

    ca_crt = property(lambda s: s.dir / "ca.crt")
    ca_key = property(lambda s: s.dir / "ca.key")
    serving_crt = property(lambda s: s.dir / "apiserver.crt")
    serving_key = property(lambda s: s.dir / "apiserver.key")
    sa_key = property(lambda s: s.dir / "sa.key")
    sa_pub = property(lambda s: s.dir / "sa.pub")
    token_file = property(lambda s: s.dir / "tokens.csv")

    def complete(self) -> bool:
        return all(p.is_file() for p in (self.ca_crt, self.ca_key, self.serving_crt,
                                         self.serving_key, self.sa_key, self.sa_pub, self.token_file))

    def tokens(self) -> dict[str, str]:
        """user -> token, from the static token file."""
        out = {}
        for line in self.token_file.read_text().splitlines():
            token, user, *_ = line.split(",")
            out[user] = token
        return out


# user -> groups; the component users are the ones the RBAC bootstrap policy grants roles to.
USERS = {
    "admin": "system:masters",
    "system:kube-controller-manager": "",
    "system:kube-scheduler": "",
}


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PkiError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()[-800:]}")


def generate(pki_dir: Path, service_ip: str) -> Pki:
    """Create all key material in `pki_dir` (idempotent: an existing complete set is kept, so a
    restarted cluster keeps validating the tokens it issued)."""
    pki = Pki(pki_dir)
    if pki.complete():
        return pki
    if shutil.which("openssl") is None:
        raise PkiError("openssl is not on PATH (apt-get install openssl)")
    pki_dir.mkdir(parents=True, exist_ok=True)
    pki_dir.chmod(0o700)
    d = pki_dir
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
             "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=moe-dev-cluster-ca", cwd=d)
    (d / "apiserver.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,IP:" + service_ip + ",DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
    )
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=d)
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "3650", "-out", "apiserver.crt", "-extfile", "apiserver.ext", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    # Static token file format: token,user,uid,"group1,group2"
    lines = [f'{secrets.token_hex(24)},{user},{user},"{groups}"' for user, groups in USERS.items()]
    pki.token_file.write_text("\n".join(lines) + "\n")
    for p in d.iterdir():
        p.chmod(0o600)
    return pki
