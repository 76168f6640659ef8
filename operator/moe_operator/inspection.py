"""Checkpoint inspection per `model.uri` (I/O edge): file://, hf:// (headers over HTTP), pvc:// (a Job).

Results are cached per (uri, revision). Failures raise `InspectionFailed` with a reason and a
message naming the cause; the handler turns that into `CheckpointInspected=False` and backs off.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moe_core.formats import is_fp4
from moe_core.checkpoint import CheckpointInfo, InspectionError, TensorMeta, classify, inspect_dir

from .api import MoEDeploymentSpec
from .metrics import INSPECTION_SECONDS
from .model_uri import ModelURI

log = logging.getLogger("moe_operator.inspection")


class InspectionFailed(Exception):
    def __init__(self, reason: str, message: str, retry: bool = True):
        self.reason, self.message, self.retry = reason, message, retry
        super().__init__(message)


class InspectionPending(Exception):
    """The inspection Job is still running; try again shortly."""


_cache: dict[str, CheckpointInfo] = {}


def cache_key(uri: str) -> str:
    return uri  # the revision is part of the uri (hf://org/name@rev)


def resolve_local(uri: str, local_models_dir: str | None) -> Path:
    """file:///models/x -> a local path. With --local-models-dir D (dev/demo), /models/x also maps to D/x."""
    path = Path(ModelURI.parse(uri).path)
    if local_models_dir and not path.exists():
        candidate = Path(local_models_dir) / path.name
        if candidate.exists():
            return candidate
    return path


def from_explicit_format(spec: MoEDeploymentSpec) -> CheckpointInfo:
    return CheckpointInfo(architecture=spec.model.architecture or "Unknown", format=spec.model.format,
                          formatSource="spec.model.format (inspection skipped)",
                          expertsFp4=is_fp4(spec.model.format))


def inspect_hf(uri: str, token: str | None) -> CheckpointInfo:
    """config.json, hf_quant_config.json and safetensors headers over HTTP; never the weights."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError, HfHubHTTPError

    parsed = ModelURI.parse(uri)
    repo, revision = parsed.repo, parsed.revision or None
    try:
        cfg_path = hf_hub_download(repo, "config.json", revision=revision, token=token)
        config = json.loads(Path(cfg_path).read_text())
        try:
            hq = json.loads(Path(hf_hub_download(repo, "hf_quant_config.json", revision=revision, token=token)).read_text())
        except EntryNotFoundError:
            hq = None
        meta = HfApi(token=token).get_safetensors_metadata(repo, revision=revision)
    except json.JSONDecodeError as e:
        raise InspectionFailed("MalformedConfig", f"{uri}: config.json is not valid JSON: {e}", retry=False) from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        reason = {401: "Unauthorized", 403: "Forbidden", 404: "NotFound"}.get(status, "HubError")
        raise InspectionFailed(reason, f"{uri}: {e}", retry=status not in (401, 403, 404)) from None
    except Exception as e:  # network errors, gated repos without token, ...
        raise InspectionFailed("HubError", f"{uri}: {type(e).__name__}: {e}") from None
    tensors = [TensorMeta(name, t.dtype, tuple(t.shape), int(t.data_offsets[1]) - int(t.data_offsets[0]))
               for fm in meta.files_metadata.values() for name, t in fm.tensors.items()]
    info = classify(config, hq, tensors, where=uri)
    info.numFiles = len(meta.files_metadata)
    return info


def inspect_spec(spec: MoEDeploymentSpec, *, local_models_dir: str | None = None,
                 hf_token: Callable[[], str | None] | None = None,
                 pvc_job: Callable[[str], dict[str, Any] | None] | None = None) -> CheckpointInfo:
    """Inspect (or skip inspecting) the checkpoint of a spec. Cached per uri."""
    if spec.model.format != "auto":
        return from_explicit_format(spec)
    uri = spec.model.uri
    key = cache_key(uri)
    if key in _cache:
        return _cache[key]
    scheme = uri.split("://", 1)[0]  # the CRD's pattern admits only hf, pvc and file
    started = time.monotonic()
    try:
        if scheme == "file":
            path = resolve_local(uri, local_models_dir)
            if not path.exists() and pvc_job is not None:
                info = _from_job(pvc_job, uri)
            else:
                info = inspect_dir(path)
        elif scheme == "hf":
            info = inspect_hf(uri, hf_token() if hf_token else None)
        elif scheme == "pvc":
            if pvc_job is None:
                raise InspectionFailed("NoInspector", f"{uri}: pvc:// needs an inspection Job and none can run here")
            info = _from_job(pvc_job, uri)
        else:
            raise InspectionFailed("UnsupportedURI", f"unsupported model uri scheme {scheme!r}", retry=False)
    except InspectionError as e:
        raise InspectionFailed("Unreadable", str(e), retry=True) from None
    finally:
        INSPECTION_SECONDS.labels(scheme).observe(time.monotonic() - started)
    _cache[key] = info
    log.info("inspected %s: %s %s (%s)", uri, info.architecture, info.format, info.formatSource)
    return info


def _from_job(pvc_job: Callable[[str], dict[str, Any] | None], uri: str) -> CheckpointInfo:
    result = pvc_job(uri)
    if result is None:
        raise InspectionPending(f"inspection Job for {uri} still running")
    if "error" in result:
        raise InspectionFailed("Unreadable", f"{uri}: {result['error']}")
    return CheckpointInfo.model_validate(result)


COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
FOLLOW_RESOLVE_SECONDS = 300.0  # revisionPolicy follow: how long a resolved sha is trusted before asking again
_resolved: dict[str, tuple[float, str]] = {}  # uri -> (monotonic time, sha), for follow


def resolve_revision(uri: str, token: str | None) -> str:
    """The hub's commit sha for hf://org/name[@branch-or-tag] (one model_info call)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError

    parsed = ModelURI.parse(uri)
    try:
        sha = HfApi(token=token).model_info(parsed.repo, revision=parsed.revision or None).sha
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        reason = {401: "Unauthorized", 403: "Forbidden", 404: "NotFound"}.get(status, "HubError")
        raise InspectionFailed(reason, f"{uri}: resolving the revision: {e}", retry=status not in (401, 403, 404)) from None
    except Exception as e:  # network errors
        raise InspectionFailed("HubError", f"{uri}: resolving the revision: {type(e).__name__}: {e}") from None
    if not sha or not COMMIT_SHA.match(sha):
        raise InspectionFailed("HubError", f"{uri}: the hub answered no commit sha ({sha!r})")
    return sha


@dataclass(frozen=True)
class Pinned:
    uri: str  # hf://org/name@<sha>: what inspection, the cache and the pods use
    revision: str  # the sha
    how: str


def pin(spec: MoEDeploymentSpec, status: dict[str, Any], token: Callable[[], str | None] | None = None,
        now: Callable[[], float] = time.monotonic) -> Pinned | None:
    """hf:// only (None otherwise): the commit this MoEDeployment serves.

    A sha in the uri is used as is. Else, revisionPolicy pin: the sha in status while status says it
    was resolved for this very model.uri (a new upload changes nothing; a spec change re-resolves);
    follow: re-resolved every FOLLOW_RESOLVE_SECONDS, so a new upload rolls the pods. A hub that
    cannot be reached keeps the pinned sha (the first resolution needs the hub)."""
    uri = spec.model.uri
    parsed = ModelURI.parse(uri)
    if parsed.scheme != "hf":
        return None
    base = f"hf://{parsed.repo}"
    if parsed.revision and COMMIT_SHA.match(parsed.revision):
        return Pinned(uri, parsed.revision, "commit sha in model.uri")
    known = status.get("revision") if status.get("revisionUri") == uri else None
    if known and spec.model.revisionPolicy == "pin":
        return Pinned(f"{base}@{known}", known, f"pinned at first use ({parsed.revision or 'main'})")
    cached = _resolved.get(uri)
    if cached and spec.model.revisionPolicy == "follow" and now() - cached[0] < FOLLOW_RESOLVE_SECONDS:
        return Pinned(f"{base}@{cached[1]}", cached[1], f"following {parsed.revision or 'main'}")
    try:
        sha = resolve_revision(uri, token() if token else None)
    except InspectionFailed:
        if known:  # follow, hub down: keep serving what was pinned
            log.warning("%s: hub unreachable, keeping revision %s", uri, known)
            return Pinned(f"{base}@{known}", known, "hub unreachable: kept the pinned revision")
        raise
    _resolved[uri] = (now(), sha)
    how = f"following {parsed.revision or 'main'}" if spec.model.revisionPolicy == "follow" else \
        f"resolved {parsed.revision or 'main'} at first use"
    return Pinned(f"{base}@{sha}", sha, how)


def cached(uri: str, status: dict[str, Any] | None = None,
           now: Callable[[], float] = time.monotonic) -> tuple[str, CheckpointInfo] | None:
    """(the uri inspected, what it found) for the revision `uri` would be served at, from earlier
    inspections only, without any I/O (the admission webhook): the uri as is (file://, pvc://, a sha
    in an hf:// uri); for hf:// at a branch, the sha this object's status pinned for this very uri,
    else the sha the operator resolved for it less than FOLLOW_RESOLVE_SECONDS ago (another
    MoEDeployment of the model). None when no inspection of that revision ran in this process."""
    candidates = []
    parsed = ModelURI.parse(uri)
    if parsed.scheme == "hf" and not (parsed.revision and COMMIT_SHA.match(parsed.revision)):
        base = f"hf://{parsed.repo}"
        if status and status.get("revisionUri") == uri and status.get("revision"):
            candidates.append(f"{base}@{status['revision']}")
        if (hit := _resolved.get(uri)) and now() - hit[0] < FOLLOW_RESOLVE_SECONDS:
            candidates.append(f"{base}@{hit[1]}")
    candidates.append(uri)
    for u in candidates:
        if (info := _cache.get(cache_key(u))) is not None:
            return u, info
    return None


def forget(uri: str) -> None:
    _cache.pop(cache_key(uri), None)
