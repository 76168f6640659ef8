"""`moe-operator download-model`: fill a model cache directory with one hub commit (the model cache
Job runs it on the cache PVC), or with a copy of a local directory (--from: a pvc:// model copied to
the cache PVC of a faster storage class; same resumable .part files, progress lines and marker).

The commit's file list from the hub (huggingface_hub list_repo_tree), then each file through the hub's
resolve URL into --dir, resumable across runs (a file cut off midway continues from its .part with a
Range request), each file checked against the hub's listing before it takes its name (an LFS file's
sha256, the same as the X-Linked-Etag of its resolve URL; other files their git blob id; a mismatch
fails the run naming the file), only the files the engines read (--allow, default ALLOW_PATTERNS), the token from
HF_TOKEN (the Job sets it from model.tokenSecretRef). Progress is
one JSON line per --interval seconds on stdout ({"bytesDone", "bytesTotal", "files"}; the operator
reads the last one from the pod's log). When every file is there at the size the hub lists, it
writes the ready marker (READY_MARKER, JSON with the revision; pods' init check greps it) and the
same JSON to --termination-log. A marker of the same revision already there: nothing to do.

Exit statuses: 0 ready; 1 the download failed and another run may succeed (network, the hub's 5xx,
a full disk; the cause is the last line and the termination message); 3 usage; and the permanent
failures, which another run of the same commit cannot fix (the fill Job's podFailurePolicy fails the
Job at once on them instead of retrying): 4 EXIT_CHECKSUM a file's content is not what the hub's
listing says (sha256 / git blob id); 5 EXIT_REFUSED the hub refused (401/403: the token is missing
or has no access) or has no such repo, revision or listed file (404), or the commit has no
*.safetensors files; 6 EXIT_UNREADABLE a file of the --from directory cannot be read by this
process (the copy Job runs as a non-root uid; the message names the file and the fix).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

READY_MARKER = ".moe-ready"
EXIT_FAILED, EXIT_USAGE = 1, 3
EXIT_CHECKSUM, EXIT_REFUSED, EXIT_UNREADABLE = 4, 5, 6
PERMANENT_EXIT_CODES = (EXIT_CHECKSUM, EXIT_REFUSED, EXIT_UNREADABLE)
# What sglang / vLLM / the bundled runtime read: configs, tokenizers, chat templates, weights
# (safetensors only), remote code. Not *.bin/*.pth/*.gguf duplicates or original/ folders.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--repo", help="org/name on the hub (HF_ENDPOINT for a mirror)")
    src.add_argument("--from", dest="source", metavar="DIR",
                     help="copy this directory instead (a pvc:// model's claim, mounted read-only)")
    p.add_argument("--revision", required=True, help="the commit sha (status.revision); with --from, the model uri")
    p.add_argument("--dir", required=True, help="the cache directory (the PVC's mount)")
    p.add_argument("--allow", action="append", default=None, help=f"glob of files to fetch (default {' '.join(ALLOW_PATTERNS)})")
    p.add_argument("--termination-log", default=None, help="write the final JSON here too (/dev/termination-log)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between progress lines")


def wanted(path: str, patterns) -> bool:
    return not path.startswith("original/") and any(fnmatch.fnmatch(path, pat) for pat in patterns)


PARTIAL = ".partial"  # <dir>/.partial/<file>.part: what a killed run had fetched, continued by the next


def bytes_on_disk(root: Path, files: dict[str, int]) -> int:
    """Finished files count their size, partial ones what is written so far."""
    done = 0
    for rel, size in files.items():
        p, part = root / rel, root / PARTIAL / (rel + ".part")
        if p.is_file():
            done += min(p.stat().st_size, size)
        elif part.is_file():
            done += min(part.stat().st_size, size)
    return done


class ChecksumMismatch(Exception):
    """A downloaded file is not the one the hub lists (its sha256, or its git blob id)."""


class Unreadable(Exception):
    """A file or folder of the --from directory this process cannot read."""


def http_status(e: BaseException | None) -> int | None:
    """The HTTP status a hub error carries (huggingface_hub's HfHubHTTPError and httpx's
    HTTPStatusError have the response), looked for along the exception's causes; None: no answer."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(code, int):
            return code
        e = e.__cause__ or e.__context__
    return None


def exit_code(e: BaseException) -> int:
    """The exit status of a failed run: a permanent cause (PERMANENT_EXIT_CODES) or EXIT_FAILED."""
    if isinstance(e, ChecksumMismatch):
        return EXIT_CHECKSUM
    if isinstance(e, Unreadable):
        return EXIT_UNREADABLE
    if http_status(e) in (401, 403, 404):
        return EXIT_REFUSED
    return EXIT_FAILED


def expected_digest(f) -> tuple[str, str] | None:
    """What the hub's tree says a file hashes to: an LFS file's sha256 (lfs.oid, the same as its
    X-Linked-Etag), else the git blob id (oid: sha1 of "blob <size>\\0" + the bytes); None when the
    listing gives neither (a mirror that does not)."""
    lfs = getattr(f, "lfs", None)
    sha256 = getattr(lfs, "sha256", None) if lfs is not None else None
    if sha256:
        return "sha256", str(sha256).lower()
    if getattr(f, "blob_id", None):
        return "git-sha1", str(f.blob_id).lower()
    return None


def _hasher(kind: str, size: int):
    if kind == "sha256":
        return hashlib.sha256()
    h = hashlib.sha1()
    h.update(b"blob %d\0" % size)
    return h


def _hash_file(kind: str, size: int, path: Path):
    h = _hasher(kind, size)
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h


def fetch_file(repo: str, revision: str, rel: str, size: int, root: Path, attempts: int = 5,
               digest: tuple[str, str] | None = None) -> None:
    """One file of the commit through the hub's resolve URL (huggingface_hub's URL, headers with
    HF_TOKEN, session), appended to its .part from where it stopped (Range), checked against
    `digest` (hashed while it streams; a resumed part is hashed from disk first) and renamed when
    whole and right: a file under its final name is always verified. A mismatch deletes the part and
    raises ChecksumMismatch naming the file (the Job's retry downloads it again).
    huggingface_hub >= 2 downloads every run into a fresh temporary file (no resume across
    processes), so a Job restarted after a node loss would start a 700 GB model over; this does not."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    dest, part = root / rel, root / PARTIAL / (rel + ".part")
    if dest.is_file() and dest.stat().st_size == size:
        return
    part.parent.mkdir(parents=True, exist_ok=True)
    url = hf_hub_url(repo, rel, revision=revision)
    h, hashed = None, -1  # the hash of the part's first `hashed` bytes (-1: none yet)
    for attempt in range(attempts):
        have = part.stat().st_size if part.is_file() else 0
        if have > size:
            part.unlink()
            have = 0
        if have < size:
            headers = build_hf_headers()
            if have:
                headers["Range"] = f"bytes={have}-"
            try:
                with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=60) as r:
                    hf_raise_for_status(r)
                    mode = "ab" if have and r.status_code == 206 else "wb"  # 200: the server ignored Range
                    if digest and mode == "wb":
                        h, hashed = _hasher(digest[0], size), 0
                    elif digest and hashed != have:  # resuming a part this process did not hash
                        h, hashed = _hash_file(digest[0], size, part), have
                    with part.open(mode) as f:
                        for chunk in r.iter_bytes(1 << 20):
                            f.write(chunk)
                            if h is not None:
                                h.update(chunk)
                                hashed += len(chunk)
            except Exception as e:  # noqa: BLE001 - network trouble: continue from what arrived
                if attempt == attempts - 1 or http_status(e) in (401, 403, 404):  # refused: no retry helps
                    raise
                time.sleep(min(2 ** attempt, 30))
                continue
        if part.stat().st_size == size:
            if digest:
                if h is None or hashed != size:  # a part finished by an earlier run
                    h = _hash_file(digest[0], size, part)
                got = h.hexdigest()
                if got != digest[1]:
                    part.unlink()
                    raise ChecksumMismatch(f"{rel}: {digest[0]} {got} of the {size} bytes downloaded is not the "
                                           f"hub's {digest[1]} for {repo}@{revision}; the file was deleted")
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, dest)
            return
    raise OSError(f"{rel}: {part.stat().st_size if part.is_file() else 0} of {size} bytes after {attempts} attempts")


def copy_file(source: Path, rel: str, size: int, root: Path) -> None:
    """One file of a local directory (a pvc:// model) into the cache: appended to its .part from
    where an earlier run stopped, renamed when whole (the same resumable layout as a download)."""
    dest, part = root / rel, root / PARTIAL / (rel + ".part")
    if dest.is_file() and dest.stat().st_size == size:
        return
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.is_file() else 0
    if have > size:
        part.unlink()
        have = 0
    try:
        src_file = (source / rel).open("rb")
    except PermissionError as e:
        raise Unreadable(unreadable_message(source, rel, "file", e)) from None
    with src_file as src, part.open("ab" if have else "wb") as out:
        src.seek(have)
        while chunk := src.read(1 << 22):
            out.write(chunk)
    if part.stat().st_size != size:
        raise OSError(f"{rel}: copied {part.stat().st_size} bytes, the source has {size} (did it change?)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, dest)


RUN_AS = 65532  # the uid and gid the fill Job runs as (security.RUNTIME_UID; not imported: this runs in the Job)


def _who() -> str:
    return f"uid {os.getuid()} gid {os.getgid()}" + (f" (groups {','.join(map(str, os.getgroups()))})"
                                                      if os.getgroups() else "")


def unreadable_message(source: Path, rel: str, what: str, err: OSError | None) -> str:
    """Why a file (or folder) of the copy cannot be read, with its owner and mode, and the fix."""
    p = source / rel if rel else source
    cause = f": {err.strerror or err}" if err is not None else ""
    need = "r-x (list and enter)" if what == "folder" else "r (read)"
    group_bits = 0o050 if what == "folder" else 0o040
    group_hint = ""
    try:
        st = p.stat()
        owner = f"owner uid {st.st_uid} gid {st.st_gid} mode {st.st_mode & 0o7777:04o}"
        if st.st_mode & group_bits == group_bits and st.st_gid not in (os.getgid(), *os.getgroups()):
            group_hint = (f"; its group {st.st_gid} may read it: the chart value modelCache.copySupplementalGroups: "
                          f"[{st.st_gid}] lets the copy Job read it as a member of that group")
    except OSError as e:
        owner = f"stat: {e.strerror or e}"
    return (f"{what} {rel or '.'} of {source} cannot be read by this copy ({_who()}{cause}; {owner}). "
            f"The copy Job runs as non-root uid {RUN_AS} and mounts the source claim read-only, which keeps the "
            f"files' owners and modes (fsGroup does not change a read-only volume), so every file needs {need} "
            f"for others or for a group of the Job. Fix it on the source volume, e.g. chmod -R a+rX <model dir> "
            f"(or chgrp -R {RUN_AS} <model dir> && chmod -R g+rX <model dir>){group_hint}, then delete the failed fill Job "
            f"(the operator creates it again); or leave model.cache.enabled unset for this pvc:// model: the "
            f"engine pods then read the claim directly (sglang and vLLM pods run as root; the bundled runtime's as "
            f"uid {RUN_AS}, which needs the same modes)")


def local_listing(source: Path, patterns) -> dict[str, int]:
    """The files of a model directory the engines read (as for a download), with their sizes.
    A folder this process cannot list raises Unreadable (rglob would skip it silently, and the copy
    would be marked ready without its files)."""
    out = {}
    errors: list[OSError] = []
    try:
        if not source.is_dir():  # missing: "no *.safetensors files" says so
            return out
    except PermissionError as e:  # a folder above it cannot be entered
        raise Unreadable(unreadable_message(source, "", "folder", e)) from None
    if not os.access(source, os.R_OK | os.X_OK):
        raise Unreadable(unreadable_message(source, "", "folder", None))
    for top, dirs, names in os.walk(source, onerror=errors.append):
        if errors:
            break
        base = Path(top)
        dirs.sort()
        for d in list(dirs):
            rel = (base / d).relative_to(source).as_posix()
            if rel.startswith((PARTIAL, ".")):  # not the model's (.git, .snapshot, a copy's own parts)
                dirs.remove(d)
            elif not os.access(base / d, os.R_OK | os.X_OK):  # without x its files look like no files
                raise Unreadable(unreadable_message(source, rel, "folder", None))
        for n in names:
            p = base / n
            rel = p.relative_to(source).as_posix()
            if p.is_file() and not rel.startswith((PARTIAL + "/", ".")) and rel != READY_MARKER and wanted(rel, patterns):
                out[rel] = p.stat().st_size
    if errors:
        e = errors[0]
        rel = Path(e.filename).relative_to(source).as_posix() if e.filename and str(e.filename).startswith(str(source)) else ""
        raise Unreadable(unreadable_message(source, "" if rel == "." else rel, "folder", e))
    return dict(sorted(out.items()))


def first_unreadable(source: Path, files) -> str | None:
    """Open every file of the copy before copying any (a copy of 700 GB should not fail at its last
    file); the first that cannot be opened, as unreadable_message(), else None."""
    for rel in files:
        try:
            with (source / rel).open("rb"):
                pass
        except OSError as e:
            return unreadable_message(source, rel, "file", e)
    return None


def read_marker(root: Path) -> dict | None:
    try:
        return json.loads((root / READY_MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _finish(args, result: dict, code: int) -> int:
    line = json.dumps(result, sort_keys=True)
    print(line, flush=True)
    if args.termination_log:
        try:
            Path(args.termination_log).write_text(line)
        except OSError as e:
            print(f"cannot write {args.termination_log}: {e}", file=sys.stderr)
    return code


def _failed(args, error: str, code: int, **extra) -> int:
    """A failed run's JSON: the error, the exit code, and `permanent` when another run cannot help."""
    result = {"error": error, "exitCode": code, **extra}
    if code in PERMANENT_EXIT_CODES:
        result["permanent"] = True
    return _finish(args, result, code)


def run(args: argparse.Namespace) -> int:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    root = Path(args.dir)
    patterns = tuple(args.allow or ALLOW_PATTERNS)
    marker = read_marker(root)
    if marker and marker.get("revision") == args.revision:
        return _finish(args, {**marker, "ready": True, "already": True}, 0)
    source = Path(args.source) if args.source else None
    what = str(source) if source else f"{args.repo}@{args.revision}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if source is not None:
            files, digests = local_listing(source, patterns), {}
            if bad := first_unreadable(source, files):
                raise Unreadable(bad)
        else:
            tree = [f for f in HfApi().list_repo_tree(args.repo, revision=args.revision, recursive=True)
                    if isinstance(f, RepoFile) and wanted(f.path, patterns)]
            files = {f.path: int(f.size or 0) for f in tree}
            digests = {f.path: expected_digest(f) for f in tree}
    except Exception as e:  # noqa: BLE001 - the cause goes to the operator's condition
        return _failed(args, f"listing {what}: {type(e).__name__}: {e}", exit_code(e))
    total = sum(files.values())
    if not any(wanted(p, ("*.safetensors",)) for p in files):
        return _failed(args, f"{what} has no *.safetensors files among {len(files)} matching {' '.join(patterns)}",
                       EXIT_REFUSED)
    failure: list[BaseException] = []

    def fetch() -> None:
        try:
            for rel in sorted(files, key=lambda r: files[r]):  # small files (configs) first
                if source is not None:
                    copy_file(source, rel, files[rel], root)
                else:
                    fetch_file(args.repo, args.revision, rel, files[rel], root, digest=digests[rel])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failure.append(e)

    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    while True:
        t.join(args.interval)
        print(json.dumps({"bytesDone": bytes_on_disk(root, files), "bytesTotal": total, "files": len(files)}), flush=True)
        if not t.is_alive():
            break
    if failure:
        e = failure[0]
        verb = "copy" if source is not None else "download"
        return _failed(args, f"{verb} of {what} failed: {type(e).__name__}: {e}", exit_code(e),
                       bytesDone=bytes_on_disk(root, files), bytesTotal=total)
    short = {rel: (root / rel).stat().st_size if (root / rel).is_file() else None
             for rel, size in files.items() if not (root / rel).is_file() or (root / rel).stat().st_size != size}
    if short:
        return _failed(args, f"incomplete download: {len(short)} files missing or of the wrong size "
                             f"({', '.join(sorted(short)[:5])})", EXIT_FAILED, bytesTotal=total)
    result = {"repo": args.repo or args.revision, "revision": args.revision, "bytesDone": total, "bytesTotal": total,
              "files": len(files), "finishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = root / (READY_MARKER + ".tmp")
    tmp.write_text(json.dumps(result, sort_keys=True))
    os.replace(tmp, root / READY_MARKER)  # atomic: a reader sees no marker or a whole one
    return _finish(args, {**result, "ready": True}, 0)
