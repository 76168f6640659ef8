"""`spec.model.uri` parsed once: hf://org/name[@rev], pvc://claim[/sub/path], file:///path. Pure.

The engine pod, the inspection Job and the policy check all read a URI through this, so the
mount of a pvc:// or file:// model is built in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelURI:
    scheme: str            # hf | pvc | file
    repo: str = ""         # hf: org/name
    revision: str = ""     # hf: @rev ('' = default branch)
    claim: str = ""        # pvc: claim name
    subpath: str = ""      # pvc: path inside the claim
    path: str = ""         # file: host path

    @classmethod
    def parse(cls, uri: str) -> "ModelURI":
        scheme, sep, rest = uri.partition("://")
        if not sep or scheme not in ("hf", "pvc", "file"):
            raise ValueError(f"unsupported model uri {uri!r}: use hf://, pvc:// or file://")
        if scheme == "hf":
            repo, _, revision = rest.partition("@")
            return cls("hf", repo=repo, revision=revision)
        if scheme == "pvc":
            claim, _, sub = rest.partition("/")
            return cls("pvc", claim=claim, subpath=sub.strip("/"))
        return cls("file", path=rest)

    def volume(self, name: str = "model") -> tuple[dict[str, Any], dict[str, Any], str]:
        """(volume, read-only mount, model path in the container) for pvc:// and file://."""
        if self.scheme == "pvc":
            mount = f"/models/{self.claim}"
            return ({"name": name, "persistentVolumeClaim": {"claimName": self.claim, "readOnly": True}},
                    {"name": name, "mountPath": mount, "readOnly": True},
                    f"{mount}/{self.subpath}".rstrip("/"))
        if self.scheme == "file":
            return ({"name": name, "hostPath": {"path": self.path, "type": "Directory"}},
                    {"name": name, "mountPath": self.path, "readOnly": True}, self.path)
        raise ValueError("hf:// models are downloaded, not mounted")
