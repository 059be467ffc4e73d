"""A local Hugging Face hub: a real HTTP server (stdlib, in a thread) speaking the part of the hub's API
that ``huggingface_hub.snapshot_download`` / ``hf_hub_download`` / ``HfApi.model_info`` use, over repos made
of local dirs. Tests point ``HF_ENDPOINT`` at it and count what the real client asked for.

Routes (as huggingface_hub 0.x-2.x call them):

- ``GET /api/models/{repo}[/revision/{rev}]``: ``{"id", "sha", "siblings": [{"rfilename"}]}``;
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: ``[{"type", "path", "size", "oid", "lfs"?}]`` (always the
  recursive listing snapshot_download asks for, in one page: no ``Link`` header);
- ``HEAD|GET /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``, ``ETag`` (the LFS sha256 for
  ``*.safetensors``, else the git blob id), ``Content-Length``, ``Range: bytes=N-`` → 206. No ``X-Xet-*``
  header, so the client downloads over plain HTTP.

Errors carry the hub's ``X-Error-Code``: ``RepoNotFound`` (404, or 401 for a private repo asked without its
token), ``GatedRepo`` (403 on files of a gated repo without its token), ``RevisionNotFound``,
``EntryNotFound``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth")


@dataclass
class _File:
    path: Path
    size: int
    blob: str  # git blob sha1
    sha256: str | None  # LFS files only

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob


@dataclass
class Repo:
    commits: dict[str, dict[str, _File]]  # commit sha → repo path → file
    refs: dict[str, str]  # branch/tag → commit
    access: str = "public"  # public | private (401 without token) | gated (403 on files without token)
    token: str | None = None


def _scan(root: Path) -> dict[str, _File]:
    files = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        sha256 = hashlib.sha256(data).hexdigest() if p.name.endswith(LFS_SUFFIXES) else None
        files[p.relative_to(root).as_posix()] = _File(p, len(data), blob, sha256)
    return files


def _commit_id(files: dict[str, _File]) -> str:
    return hashlib.sha1(json.dumps(sorted((k, f.blob) for k, f in files.items())).encode()).hexdigest()


@dataclass
class LocalHub:
    delay_s: float = 0.0  # per file GET: lets concurrent clients overlap in tests
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, bool]] = field(default_factory=list)  # (method, path, sent a token)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    def add_repo(
        self,
        repo_id: str,
        *dirs: str | Path,
        tags: dict[str, int] | None = None,
        access: str = "public",
        token: str | None = None,
    ) -> list[str]:
        """One commit per dir (in order; ``main`` is the last); ``tags`` name a commit by its index.
        Returns the commit ids."""
        commits = {}
        for d in dirs:
            files = _scan(Path(d))
            commits[_commit_id(files)] = files
        ids = list(commits)
        refs = {"main": ids[-1], **{t: ids[i] for t, i in (tags or {}).items()}}
        self.repos[repo_id] = Repo(commits, refs, access, token)
        return ids

    # ------------------------------------------------------------------ the server
    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self.endpoint

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # ------------------------------------------------------------------ what clients asked for
    def log(self, method: str, path: str, token: bool) -> None:
        with self._lock:
            self.requests.append((method, path, token))

    def file_gets(self, repo_id: str) -> Counter:
        """GETs of each file of ``repo_id`` (by repo path)."""
        prefix = f"/{repo_id}/resolve/"
        with self._lock:
            return Counter(
                p[len(prefix) :].split("/", 1)[1]
                for m, p, _ in self.requests
                if m == "GET" and p.startswith(prefix)
            )

    def api_calls(self) -> list[str]:
        with self._lock:
            return [p for _, p, _ in self.requests if p.startswith("/api/")]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()


class _Handler(BaseHTTPRequestHandler):
    hub: LocalHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # the test output is the request log, not stderr
        pass

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    # ------------------------------------------------------------------ helpers
    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, length: int | None = None
    ) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, obj, headers: dict[str, str] | None = None) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(
            status,
            body,
            {
                "Content-Type": "application/json",
                "X-Error-Code": code,
                "X-Error-Message": message,
                **(headers or {}),
            },
        )

    def _authorised(self, repo: Repo) -> bool:
        return repo.token is not None and self.headers.get("Authorization") == f"Bearer {repo.token}"

    def _split_repo(self, rest: str, marker: str) -> tuple[str, str] | None:
        """``org/name{marker}tail`` → (repo id, tail); the repo id is one or two segments."""
        if marker not in rest:
            return None
        repo_id, tail = rest.split(marker, 1)
        return repo_id, tail

    def _commit(self, repo: Repo, rev: str) -> str | None:
        rev = unquote(rev)
        if rev in repo.commits:
            return rev
        return repo.refs.get(rev)

    # ------------------------------------------------------------------ routes
    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        path = url.path
        self.hub.log(method, path, "Authorization" in self.headers)
        if path.startswith("/api/models/"):
            return self._api(path[len("/api/models/") :])
        parts = self._split_repo(path.lstrip("/"), "/resolve/")
        if parts is None:
            return self._error(404, "RepoNotFound", "not a hub route")
        repo_id, tail = parts
        rev, _, filename = tail.partition("/")
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.access != "public" and not self._authorised(repo):
            if repo.access == "private":
                return self._error(401, "RepoNotFound", "Invalid username or password.")
            return self._error(
                403, "GatedRepo", "Access to model is restricted and you are not in the authorized list."
            )
        commit = self._commit(repo, rev)
        if commit is None:
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        f = repo.commits[commit].get(unquote(filename))
        if f is None:
            return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit})
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{f.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if method == "HEAD":
            return self._send(200, headers=headers, length=f.size)
        if self.hub.delay_s:
            time.sleep(self.hub.delay_s)
        data = f.path.read_bytes()
        start = 0
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
            start = int(rng[6:].split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{f.size - 1}/{f.size}"
            return self._send(206, data[start:], headers)
        return self._send(200, data, headers)

    def _api(self, rest: str) -> None:
        tree = self._split_repo(rest, "/tree/")
        if tree is not None:
            repo_id, tail = tree
            rev, _, sub = tail.partition("/")
        else:
            info = self._split_repo(rest, "/revision/")
            repo_id, rev, sub = (info[0], info[1], "") if info else (rest.rstrip("/"), "main", "")
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.access == "private" and not self._authorised(repo):
            return self._error(401, "RepoNotFound", "Invalid username or password.")
        commit = self._commit(repo, rev)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        files = repo.commits[commit]
        if tree is None:
            return self._json(
                {
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": commit,
                    "private": repo.access == "private",
                    "gated": "manual" if repo.access == "gated" else False,
                    "siblings": [{"rfilename": k} for k in files],
                }
            )
        sub = unquote(sub).strip("/")
        entries, dirs = [], set()
        for k, f in files.items():
            if sub and not k.startswith(sub + "/"):
                continue
            parent = k.rsplit("/", 1)[0] if "/" in k else ""
            while parent and parent != sub:
                dirs.add(parent)
                parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
            e = {"type": "file", "path": k, "size": f.size, "oid": f.blob}
            if f.sha256:
                e["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            entries.append(e)
        entries += [
            {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()}
            for d in sorted(dirs)
        ]
        return self._json(entries)
