"""Checkpoint inspection per `model.uri` (I/O edge): file://, hf:// (headers over HTTP), pvc:// (a Job).

Results are cached by who may read them (issue 27 item 7): file:// by uri (admin-allowed host
paths), hf:// by (repo, revision) and the token's access (facts read with a token are served only
to callers with that token; facts read without one to anyone), pvc:// by (namespace, claim UID,
path). Hub calls run on a bounded pool of their own with a timeout per request and a deadline per
inspection (issue 27 item 6): a reconcile waits HUB_WAIT_SECONDS, then reports `Inspecting` and
goes on, so a stalled hub never holds a reconcile thread. Failures raise `InspectionFailed` with a
reason and a message naming the cause; the handler turns that into `CheckpointInspected=False`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moe_core.formats import is_fp4
from moe_core.checkpoint import CheckpointInfo, InspectionError, TensorMeta, classify, inspect_dir

from . import hub_deadline
from .api import MoEDeploymentSpec
from .io_pool import Background, DeadlineExceeded, Pending
from .metrics import INSPECTION_SECONDS
from .model_uri import ModelURI

log = logging.getLogger("moe_operator.inspection")


class InspectionFailed(Exception):
    def __init__(self, reason: str, message: str, retry: bool = True):
        self.reason, self.message, self.retry = reason, message, retry
        super().__init__(message)


class InspectionPending(Exception):
    """The inspection Job is still running; try again shortly."""


HUB_TIMEOUT_SECONDS = float(os.environ.get("MOE_HUB_TIMEOUT_SECONDS", "10"))  # one hub request
HUB_DEADLINE_SECONDS = float(os.environ.get("MOE_HUB_DEADLINE_SECONDS", "60"))  # one inspection, retries included
HUB_WAIT_SECONDS = 1.0  # how long a reconcile waits for a fast hub before reporting Inspecting
HUB = Background(workers=int(os.environ.get("MOE_HUB_WORKERS", "4")), name="moe-hub")

_cache: dict[Any, CheckpointInfo] = {}
_resolved: dict[Any, tuple[float, str]] = {}  # (uri, access) -> (monotonic time, sha), for follow


def access(token: str | None) -> str:
    """Who may read what a hub call returned: '' for anyone (no token), else the token's digest."""
    return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""


def cache_key(uri: str, access: str = "", scope: tuple[str, str] | None = None) -> Any:
    """file:// and public hf:// facts by uri (the revision is part of an hf:// uri); hf:// read
    with a token by (uri, token access); pvc:// by (namespace, claim UID, path): a namespace with
    another claim of the same name, or none, never gets them."""
    if uri.startswith("pvc://"):
        if scope is None:
            raise ValueError("a pvc:// cache key needs the (namespace, claim UID) scope")
        return ("pvc", scope[0], scope[1], ModelURI.parse(uri).path)
    return (uri, access) if access else uri


def _hf_lookup(uri: str, acc: str) -> CheckpointInfo | None:
    return _cache.get(cache_key(uri, acc)) or (_cache.get(cache_key(uri)) if acc else None)


def reset() -> None:
    """Forget every inspection and resolution (tests)."""
    _cache.clear()
    _resolved.clear()
    _failed.clear()
    HUB._entries.clear()


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
        t = HUB_TIMEOUT_SECONDS
        cfg_path = hf_hub_download(repo, "config.json", revision=revision, token=token, etag_timeout=t)
        config = json.loads(Path(cfg_path).read_text())
        try:
            hq = json.loads(Path(hf_hub_download(repo, "hf_quant_config.json", revision=revision, token=token,
                                                 etag_timeout=t)).read_text())
        except EntryNotFoundError:
            hq = None
        meta = HfApi(token=token).get_safetensors_metadata(repo, revision=revision, timeout=t)
    except json.JSONDecodeError as e:
        raise InspectionFailed("MalformedConfig", f"{uri}: config.json is not valid JSON: {e}", retry=False) from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        reason = {401: "Unauthorized", 403: "Forbidden", 404: "NotFound"}.get(status, "HubError")
        raise InspectionFailed(reason, f"{uri}: {e}", retry=status not in (401, 403, 404)) from None
    except hub_deadline.HubDeadline as e:
        raise InspectionFailed("HubTimeout", f"{uri}: reading the headers: {e} ({HUB_DEADLINE_SECONDS:g} s)") from None
    except Exception as e:  # network errors, gated repos without token, ...
        raise InspectionFailed("HubError", f"{uri}: {type(e).__name__}: {e}") from None
    tensors = [TensorMeta(name, t.dtype, tuple(t.shape), int(t.data_offsets[1]) - int(t.data_offsets[0]))
               for fm in meta.files_metadata.values() for name, t in fm.tensors.items()]
    info = classify(config, hq, tensors, where=uri)
    info.numFiles = len(meta.files_metadata)
    return info


def inspect_spec(spec: MoEDeploymentSpec, *, local_models_dir: str | None = None, hub: bool = False,
                 hf_token: Callable[[], str | None] | None = None,
                 pvc_job: Callable[[str], dict[str, Any] | None] | None = None,
                 pvc_scope: Callable[[str], tuple[str, str] | None] | None = None) -> CheckpointInfo:
    """Inspect (or skip inspecting) the checkpoint of a spec, cached by who may read it.

    hf:// asks the hub only with `hub=True` (the reconcile; the admission webhook never does: it
    gets cached facts or InspectionPending), in the background: InspectionPending while it runs.
    pvc:// needs `pvc_scope(claim)` -> (namespace, claim UID), None when the claim is missing."""
    if spec.model.format != "auto":
        return from_explicit_format(spec)
    uri = spec.model.uri
    scheme = uri.split("://", 1)[0]  # the CRD's pattern admits only hf, pvc and file
    if scheme == "hf":
        return _inspect_hf_cached(uri, hub, hf_token)
    if scheme == "pvc":
        if pvc_job is None or pvc_scope is None:
            raise InspectionFailed("NoInspector", f"{uri}: pvc:// needs an inspection Job and none can run here")
        claim = ModelURI.parse(uri).claim
        scope = pvc_scope(claim)
        if scope is None:
            raise InspectionFailed("NotFound", f"{uri}: PersistentVolumeClaim {claim!r} not found in the namespace")
        key = cache_key(uri, scope=scope)
    elif scheme == "file":
        key = cache_key(uri)
    else:
        raise InspectionFailed("UnsupportedURI", f"unsupported model uri scheme {scheme!r}", retry=False)
    if key in _cache:
        return _cache[key]
    started = time.monotonic()
    try:
        if scheme == "file":
            path = resolve_local(uri, local_models_dir)
            info = _from_job(pvc_job, uri) if not path.exists() and pvc_job is not None else inspect_dir(path)
        else:
            info = _from_job(pvc_job, uri)
    except InspectionError as e:
        raise InspectionFailed("Unreadable", str(e), retry=True) from None
    finally:
        INSPECTION_SECONDS.labels(scheme).observe(time.monotonic() - started)
    _cache[key] = info
    log.info("inspected %s: %s %s (%s)", uri, info.architecture, info.format, info.formatSource)
    return info


# A failed hub call is kept for its retry delay (issue 32 item 7): reconciles in between (other
# events, other objects of the same model) get the same failure without asking the hub again.
FAILED_HOLD_SECONDS = {True: 30.0, False: 300.0}  # retryable, permanent (401/403/404, bad config)
_failed: dict[Any, tuple[float, InspectionFailed]] = {}


def _hub_call(key: Any, fn: Callable[[], Any], uri: str, what: str) -> Any:
    """`fn` on the hub pool: its result if it ends within HUB_WAIT_SECONDS, else InspectionPending
    (InspectionFailed HubTimeout past HUB_DEADLINE_SECONDS); a failure is answered from memory for
    FAILED_HOLD_SECONDS."""
    held = _failed.get(key)
    if held is not None and time.monotonic() < held[0]:
        raise held[1]
    try:
        return HUB.run(key, fn, wait=HUB_WAIT_SECONDS, deadline=HUB_DEADLINE_SECONDS)
    except Pending as e:
        raise InspectionPending(f"{uri}: {what} at the hub, {e}") from None
    except DeadlineExceeded as e:
        failed = InspectionFailed("HubTimeout", f"{uri}: {what}: the hub gave {e}")
        _failed[key] = (time.monotonic() + FAILED_HOLD_SECONDS[True], failed)
        raise failed from None
    except InspectionFailed as e:
        _failed[key] = (time.monotonic() + FAILED_HOLD_SECONDS[e.retry], e)
        raise


def _inspect_hf_cached(uri: str, hub: bool, hf_token: Callable[[], str | None] | None) -> CheckpointInfo:
    token = hf_token() if hf_token else None
    acc = access(token)
    if (info := _hf_lookup(uri, acc)) is not None:
        return info
    if not hub:
        raise InspectionPending(f"{uri}: not inspected yet (only the reconcile asks the hub)")

    def work() -> CheckpointInfo:  # on the hub pool; the result lands in the cache even if nobody waits
        started = time.monotonic()
        try:
            with hub_deadline.within(HUB_DEADLINE_SECONDS):
                got = inspect_hf(uri, token)
        finally:
            INSPECTION_SECONDS.labels("hf").observe(time.monotonic() - started)
        _cache[cache_key(uri, acc)] = got
        log.info("inspected %s: %s %s (%s)", uri, got.architecture, got.format, got.formatSource)
        return got

    return _hub_call(("inspect", uri, acc), work, uri, "reading the headers")


def _from_job(pvc_job: Callable[[str], dict[str, Any] | None], uri: str) -> CheckpointInfo:
    result = pvc_job(uri)
    if result is None:
        raise InspectionPending(f"inspection Job for {uri} still running")
    if "error" in result:
        raise InspectionFailed("Unreadable", f"{uri}: {result['error']}")
    return CheckpointInfo.model_validate(result)


COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
FOLLOW_RESOLVE_SECONDS = 300.0  # revisionPolicy follow: how long a resolved sha is trusted before asking again


def resolve_revision(uri: str, token: str | None) -> str:
    """The hub's commit sha for hf://org/name[@branch-or-tag] (one model_info call)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError

    parsed = ModelURI.parse(uri)
    try:
        sha = HfApi(token=token).model_info(parsed.repo, revision=parsed.revision or None,
                                            timeout=HUB_TIMEOUT_SECONDS).sha
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        reason = {401: "Unauthorized", 403: "Forbidden", 404: "NotFound"}.get(status, "HubError")
        raise InspectionFailed(reason, f"{uri}: resolving the revision: {e}", retry=status not in (401, 403, 404)) from None
    except hub_deadline.HubDeadline as e:
        raise InspectionFailed("HubTimeout", f"{uri}: resolving the revision: {e} ({HUB_DEADLINE_SECONDS:g} s)") from None
    except Exception as e:  # network errors, timeouts
        raise InspectionFailed("HubError", f"{uri}: resolving the revision: {type(e).__name__}: {e}") from None
    if not sha or not COMMIT_SHA.match(sha):
        raise InspectionFailed("HubError", f"{uri}: the hub answered no commit sha ({sha!r})")
    return sha


def _resolve_key(uri: str, acc: str) -> Any:
    return (uri, acc) if acc else uri


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
    tok = token() if token else None
    rkey = _resolve_key(uri, access(tok))
    cached = _resolved.get(rkey)
    if cached and spec.model.revisionPolicy == "follow" and now() - cached[0] < FOLLOW_RESOLVE_SECONDS:
        return Pinned(f"{base}@{cached[1]}", cached[1], f"following {parsed.revision or 'main'}")
    asked = now()

    def work() -> str:  # on the hub pool
        with hub_deadline.within(HUB_DEADLINE_SECONDS):
            got = resolve_revision(uri, tok)
        _resolved[rkey] = (asked, got)
        return got

    try:
        sha = _hub_call(("resolve", rkey), work, uri, "resolving the revision")
    except (InspectionFailed, InspectionPending):
        if known:  # follow, hub down or slow: keep serving what was pinned
            log.warning("%s: hub unreachable, keeping revision %s", uri, known)
            return Pinned(f"{base}@{known}", known, "hub unreachable: kept the pinned revision")
        raise
    _resolved[rkey] = (now(), sha)
    how = f"following {parsed.revision or 'main'}" if spec.model.revisionPolicy == "follow" else \
        f"resolved {parsed.revision or 'main'} at first use"
    return Pinned(f"{base}@{sha}", sha, how)


def cached(uri: str, status: dict[str, Any] | None = None,
           now: Callable[[], float] = time.monotonic) -> tuple[str, CheckpointInfo] | None:
    """(the uri inspected, what it found) for the revision `uri` would be served at, from earlier
    inspections only, without any I/O (the admission webhook): the uri as is (file://, pvc://, a sha
    in an hf:// uri); for hf:// at a branch, the sha this object's status pinned for this very uri,
    else the sha the operator resolved for it less than FOLLOW_RESOLVE_SECONDS ago (another
    MoEDeployment of the model). Only facts anyone may read: hf:// inspected without a token (a
    tenant's token-read facts stay with that token), never pvc:// (scoped by namespace and claim).
    None when no such inspection of that revision ran in this process."""
    if uri.startswith("pvc://"):
        return None
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

