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

Exit statuses: 0 ready; 1 the download failed (the cause is the last line and the termination
message); 3 usage.
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
                if attempt == attempts - 1 or getattr(getattr(e, "response", None), "status_code", 500) in (401, 403, 404):
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
    with (source / rel).open("rb") as src, part.open("ab" if have else "wb") as out:
        src.seek(have)
        while chunk := src.read(1 << 22):
            out.write(chunk)
    if part.stat().st_size != size:
        raise OSError(f"{rel}: copied {part.stat().st_size} bytes, the source has {size} (did it change?)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, dest)


def local_listing(source: Path, patterns) -> dict[str, int]:
    """The files of a model directory the engines read (as for a download), with their sizes."""
    out = {}
    for p in sorted(source.rglob("*")):
        rel = p.relative_to(source).as_posix()
        if p.is_file() and not rel.startswith((PARTIAL + "/", ".")) and rel != READY_MARKER and wanted(rel, patterns):
            out[rel] = p.stat().st_size
    return out


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
        else:
            tree = [f for f in HfApi().list_repo_tree(args.repo, revision=args.revision, recursive=True)
                    if isinstance(f, RepoFile) and wanted(f.path, patterns)]
            files = {f.path: int(f.size or 0) for f in tree}
            digests = {f.path: expected_digest(f) for f in tree}
    except Exception as e:  # noqa: BLE001 - the cause goes to the operator's condition
        return _finish(args, {"error": f"listing {what}: {type(e).__name__}: {e}"}, 1)
    total = sum(files.values())
    if not any(wanted(p, ("*.safetensors",)) for p in files):
        return _finish(args, {"error": f"{what} has no *.safetensors files among {len(files)} "
                                       f"matching {' '.join(patterns)}"}, 1)
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
        return _finish(args, {"error": f"{verb} of {what} failed: {type(e).__name__}: {e}",
                              "bytesDone": bytes_on_disk(root, files), "bytesTotal": total}, 1)
    short = {rel: (root / rel).stat().st_size if (root / rel).is_file() else None
             for rel, size in files.items() if not (root / rel).is_file() or (root / rel).stat().st_size != size}
    if short:
        return _finish(args, {"error": f"incomplete download: {len(short)} files missing or of the wrong size "
                                       f"({', '.join(sorted(short)[:5])})", "bytesTotal": total}, 1)
    result = {"repo": args.repo or args.revision, "revision": args.revision, "bytesDone": total, "bytesTotal": total,
              "files": len(files), "finishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = root / (READY_MARKER + ".tmp")
    tmp.write_text(json.dumps(result, sort_keys=True))
    os.replace(tmp, root / READY_MARKER)  # atomic: a reader sees no marker or a whole one
    return _finish(args, {**result, "ready": True}, 0)
