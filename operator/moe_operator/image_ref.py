"""Container image references parsed by the distribution reference grammar, and matched against the
admin's allowed registries on registry and path components. Pure.

Grammar: github.com/distribution/reference, regexp.go (domain, path components, tag, digest) and
normalize.go splitDockerDomain (the first component is a registry only if it has '.' or ':' or is
'localhost'; docker.io and index.docker.io are one registry; a single docker.io component is under
library/). A string prefix is not a registry: `ghcr.io/moe-operator@evil.example/x` is not a valid
reference at all, and `ghcr.io/moe-operator-evil/x` is not under `ghcr.io/moe-operator`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_DOMAIN = rf"{_HOST}(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
IMAGE_PATTERN = rf"^{_NAME}(?::{_TAG})?(?:@{_DIGEST})?$"
_REF = re.compile(rf"^(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$")
NAME_MAX = 255  # distribution's NameTotalLengthMax


@dataclass(frozen=True)
class ImageRef:
    registry: str            # normalised: docker.io for Docker Hub, lower case
    path: tuple[str, ...]    # path components; docker.io single names under library/
    tag: str = ""
    digest: str = ""

    def __str__(self) -> str:
        return "/".join((self.registry, *self.path)) + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else "")


def _split_domain(name: str) -> tuple[str, str]:
    first, sep, rest = name.partition("/")
    if not sep or (not any(c in first for c in ".:") and first != "localhost" and first.lower() == first):
        domain, rest = "docker.io", name
    else:
        domain = first
    if domain == "index.docker.io":
        domain = "docker.io"
    if domain == "docker.io" and "/" not in rest:
        rest = "library/" + rest
    return domain.lower(), rest


def parse(image: str) -> ImageRef:
    """The reference, or ValueError saying what is wrong with it."""
    m = _REF.match(image)
    if not m:
        if image != image.strip() or any(c.isspace() for c in image):
            raise ValueError(f"image {image!r} contains whitespace")
        raise ValueError(f"image {image!r} is not a valid reference: [registry[:port]/]path[:tag][@algorithm:hex], "
                         "path components in lower case")
    if len(m["name"]) > NAME_MAX:
        raise ValueError(f"image name {m['name'][:40]}... is longer than {NAME_MAX} characters")
    domain, rest = _split_domain(m["name"])
    return ImageRef(domain, tuple(rest.split("/")), m["tag"] or "", m["digest"] or "")


def parse_prefix(entry: str) -> tuple[str, tuple[str, ...]]:
    """An allowed-registry entry: a registry with optional leading path components
    (ghcr.io, ghcr.io/moe-operator, docker.io/library, localhost:5000/team)."""
    entry = entry.strip().rstrip("/")
    first, sep, rest = entry.partition("/")
    if any(c in first for c in ".:") or first == "localhost":
        domain, path = first, rest
    else:  # a Docker Hub namespace: "bitnami" is docker.io/bitnami (official images: docker.io/library)
        domain, path = "docker.io", entry
    if domain.lower() == "index.docker.io":
        domain = "docker.io"
    if not re.fullmatch(_DOMAIN, domain) or (path and not re.fullmatch(rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*", path)):
        raise ValueError(f"allowed image registry {entry!r} is not a registry[/path] prefix")
    return domain.lower(), tuple(path.split("/")) if path else ()


def allowed(image: str, entries: tuple[str, ...]) -> bool:
    try:
        ref = parse(image)
    except ValueError:
        return False
    for e in entries:
        domain, path = parse_prefix(e)
        if ref.registry == domain and ref.path[:len(path)] == path:
            return True
    return False
