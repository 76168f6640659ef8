"""A local HTTP server that speaks the part of the Hugging Face hub API huggingface_hub uses to
resolve revisions, list a repo, read safetensors headers and download files (HF_ENDPOINT=its URL).

Routes (as huggingface_hub 2.x calls them):
  GET  /api/models/{org}/{name}[/revision/{rev}]          repo info with the commit sha and siblings
  GET  /api/models/{org}/{name}/tree/{rev}[/{path}]       file listing (recursive)
  HEAD|GET /{org}/{name}/resolve/{rev}/{path}             a file (ETag, X-Repo-Commit, Range -> 206)
Repos hold commits; `upload` makes a new commit and moves `main` to it. A gated repo answers 401
without the token. `fail_after` cuts a GET off after that many bytes once (to test resuming).
As the hub does, *.safetensors files are LFS: the tree lists their sha256 (`lfs.oid`, the git blob
id of the pointer as `oid`) and resolve answers it as the ETag and X-Linked-Etag; other files list
their git blob id. `corrupt` makes resolve serve other bytes of the same length than the listing's;
`status_for` makes resolve answer a path with an error status (404 of a listed file, a 503).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    return path.endswith(".safetensors")


def lfs_pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


def tree_entry(path: str, data: bytes) -> dict:
    if not is_lfs(path):
        return {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": path}
    pointer = lfs_pointer(data)
    return {"type": "file", "oid": git_blob_id(pointer), "size": len(data), "path": path,
            "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)}}


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None  # gated: this bearer token is required


class Hub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.fail_after: dict[str, int] = {}  # path -> bytes to send before dropping the connection (once)
        self.throttle: float | None = None  # bytes per second for file bodies (None: as fast as it goes)
        self.corrupted: dict[tuple[str, str, str], bytes] = {}  # (repo, sha, path) -> what resolve serves instead
        self.status_for: dict[str, int] = {}  # resolve URL path -> the error status it answers instead
        self._server: ThreadingHTTPServer | None = None
        self._n = 0

    # -- content ----------------------------------------------------------------------------
    def upload(self, repo: str, files: dict[str, bytes], token: str | None = None) -> str:
        """A new commit of `repo` with these files (replacing the previous ones); main moves to it."""
        r = self.repos.setdefault(repo, Repo())
        if token is not None:
            r.token = token
        self._n += 1
        sha = hashlib.sha1(f"{repo}:{self._n}".encode() + b"".join(sorted(files.values()))).hexdigest()
        r.commits[sha] = dict(files)
        r.refs["main"] = sha
        return sha

    def corrupt(self, repo: str, sha: str, path: str) -> None:
        """Serve `path` of that commit with one byte changed (its listing keeps the true sha256)."""
        data = bytearray(self.repos[repo].commits[sha][path])
        data[len(data) // 2] ^= 0xFF
        self.corrupted[(repo, sha, path)] = bytes(data)

    # -- server -----------------------------------------------------------------------------
    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    # -- handling ---------------------------------------------------------------------------
    def _send(self, h: BaseHTTPRequestHandler, code: int, body: bytes = b"", headers: dict | None = None,
              head: bool = False, cut: int | None = None) -> None:
        h.send_response(code)
        for k, v in (headers or {}).items():
            h.send_header(k, str(v))
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if head:
            return
        if cut is not None:
            h.wfile.write(body[:cut])
            h.wfile.flush()
            h.close_connection = True
            try:
                h.connection.shutdown(2)
            except OSError:
                pass
            return
        if self.throttle and len(body) > 65536:
            import time
            for i in range(0, len(body), 65536):
                try:
                    h.wfile.write(body[i:i + 65536])
                    h.wfile.flush()
                except OSError:
                    return
                time.sleep(65536 / self.throttle)
            return
        h.wfile.write(body)

    def _error(self, h, code: int, error_code: str, msg: str, head: bool) -> None:
        self._send(h, code, json.dumps({"error": msg}).encode(),
                   {"Content-Type": "application/json", "X-Error-Code": error_code, "X-Error-Message": msg}, head)

    def _repo(self, h, org: str, name: str, rev: str | None, head: bool) -> tuple[Repo, str, str] | None:
        repo_id = f"{org}/{name}"
        r = self.repos.get(repo_id)
        if r is None:
            self._error(h, 404, "RepoNotFound", f"Repository not found: {repo_id}", head)
            return None
        if r.token and h.headers.get("Authorization") != f"Bearer {r.token}":
            self._error(h, 401, "GatedRepo", f"Access to model {repo_id} is restricted", head)
            return None
        rev = unquote(rev or "main")
        sha = r.refs.get(rev) or (rev if rev in r.commits else None)
        if sha is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            return None
        return r, repo_id, sha

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = urlparse(h.path).path
        self.requests.append((h.command, path, h.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+)/([^/]+)(?:/revision/([^/]+))?", path)
        if m:
            found = self._repo(h, m[1], m[2], m[3], head)
            if found:
                r, repo_id, sha = found
                info = {"_id": sha, "id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "gated": bool(r.token),
                        "siblings": [{"rfilename": f} for f in sorted(r.commits[sha])], "tags": [], "downloads": 0,
                        "likes": 0, "lastModified": "2026-01-01T00:00:00.000Z"}
                self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
            return
        m = re.fullmatch(r"/api/models/([^/]+)/([^/]+)/tree/([^/]+)(/.*)?", path)
        if m:
            found = self._repo(h, m[1], m[2], m[3], head)
            if found:
                r, _, sha = found
                prefix = (m[4] or "").strip("/")
                entries = [tree_entry(f, b) for f, b in sorted(r.commits[sha].items())
                           if not prefix or f.startswith(prefix + "/")]
                self._send(h, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head)
            return
        m = re.fullmatch(r"/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            found = self._repo(h, m[1], m[2], m[3], head)
            if not found:
                return
            r, repo_id, sha = found
            fname = unquote(m[4])
            data = r.commits[sha].get(fname)
            if path in self.status_for:
                code = self.status_for[path]
                self._error(h, code, "EntryNotFound" if code == 404 else "ServerError", f"{fname}: HTTP {code}", head)
                return
            if data is None:
                self._error(h, 404, "EntryNotFound", f"{fname} does not exist", head)
                return
            headers = {"ETag": f'"{git_blob_id(data)}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if is_lfs(fname):
                digest = hashlib.sha256(data).hexdigest()
                headers.update({"ETag": f'"{digest}"', "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": len(data)})
            data = self.corrupted.get((repo_id, sha, fname), data)
            code, body = 200, data
            rng = h.headers.get("Range")
            if rng and (rm := re.fullmatch(r"bytes=(\d+)-(\d*)", rng)):
                start = int(rm[1])
                end = int(rm[2]) if rm[2] else len(data) - 1
                end = min(end, len(data) - 1)
                body = data[start:end + 1]
                code = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            cut = None
            if not head and path in self.fail_after:
                cut = self.fail_after.pop(path)
            self._send(h, code, body, headers, head, cut)
            return
        self._error(h, 404, "NotFound", f"no route {path}", head)
