"""Write kubeconfig files (token auth, CA embedded so the file is self-contained)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import yaml

CONTEXT = "moe-dev"


def write(path: Path, server: str, ca_file: Path, user: str, token: str) -> Path:
    ca_data = base64.b64encode(ca_file.read_bytes()).decode()
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": server, "certificate-authority-data": ca_data}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user}}],
        "current-context": CONTEXT,
    }
    tmp = path.with_suffix(".tmp")
    # 0600: the file holds a bearer token.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    tmp.replace(path)
    return path


def read_server_and_token(path: Path) -> tuple[str, str, str]:
    """(server, token, ca_data_b64) of the current context of a kubeconfig written by write()."""
    cfg = yaml.safe_load(path.read_text())
    ctx = next(c for c in cfg["contexts"] if c["name"] == cfg["current-context"])["context"]
    cluster = next(c for c in cfg["clusters"] if c["name"] == ctx["cluster"])["cluster"]
    user = next(u for u in cfg["users"] if u["name"] == ctx["user"])["user"]
    return cluster["server"], user.get("token", ""), cluster.get("certificate-authority-data", "")
