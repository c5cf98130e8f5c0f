"""A local stand-in for the Hugging Face Hub's HTTP API, for the online download path:
`HF_ENDPOINT=http://127.0.0.1:PORT` makes huggingface_hub talk to it. It answers the routes
`HfApi.repo_info` / `list_repo_tree` and `hf_hub_download` use:

    GET  /api/models/{org}/{name}[/revision/{rev}]       repo info (the commit `sha`)
    GET  /api/models/{org}/{name}/tree/{rev}[/{path}]    the file listing (recursive)
    HEAD /{org}/{name}/resolve/{rev}/{path}              commit, etag, size
    GET  /{org}/{name}/resolve/{rev}/{path}              the bytes

and errors as the Hub sends them (`X-Error-Code`: RepoNotFound, GatedRepo, RevisionNotFound,
EntryNotFound). Every request is recorded (method, path, Authorization header).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tests.hub_cache import LFS_SUFFIXES


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch / tag -> commit
    gated: bool = False

    def add(self, commit: str, files: dict[str, bytes | Path], refs: tuple[str, ...] = ("main",)) -> None:
        self.commits[commit] = {p: c if isinstance(c, bytes) else Path(c).read_bytes() for p, c in files.items()}
        for ref in refs:
            self.refs[ref] = commit

    def commit_of(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.refs.get(rev)


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


def _oid(path: str, data: bytes) -> str:
    """The etag the Hub sends: sha256 of an LFS file, the git blob id otherwise."""
    return hashlib.sha256(data).hexdigest() if path.endswith(LFS_SUFFIXES) else _git_oid(data)


class FakeHub:
    """The server, on a free port, in a daemon thread; `with FakeHub(repos) as hub: hub.url`."""

    def __init__(self, repos: dict[str, FakeRepo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- routes -------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
            repo = self._repo(h, repo_id)
            if repo is None:
                return
            if not rest or rest[0] == "revision":
                return self._info(h, repo_id, repo, rest[1] if len(rest) > 1 else "main", body)
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(h, repo, rest[1], "/".join(rest[2:]), body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id = "/".join(parts[:2])
            repo = self._repo(h, repo_id)
            if repo is None:
                return
            return self._file(h, repo, parts[3], "/".join(parts[4:]), body)
        self._send(h, 404, b"{}", body)

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str) -> FakeRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._send(h, 401, b'{"error": "Repository Not Found"}', True, {"X-Error-Code": "RepoNotFound"})
        elif repo.gated and not h.headers.get("Authorization"):
            self._send(h, 401, b'{"error": "gated"}', True,
                       {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this repo is restricted."})
        else:
            return repo
        return None

    def _commit(self, h: BaseHTTPRequestHandler, repo: FakeRepo, rev: str) -> str | None:
        commit = repo.commit_of(rev)
        if commit is None:
            self._send(h, 404, b'{"error": "Invalid rev id"}', True, {"X-Error-Code": "RevisionNotFound"})
        return commit

    def _info(self, h, repo_id: str, repo: FakeRepo, rev: str, body: bool) -> None:
        commit = self._commit(h, repo, rev)
        if commit is None:
            return
        info = {"_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                "gated": repo.gated, "disabled": False, "tags": [], "downloads": 0, "likes": 0,
                "siblings": [{"rfilename": p} for p in sorted(repo.commits[commit])]}
        self._send(h, 200, json.dumps(info).encode(), body)

    def _tree(self, h, repo: FakeRepo, rev: str, under: str, body: bool) -> None:
        commit = self._commit(h, repo, rev)
        if commit is None:
            return
        entries = []
        for p, data in sorted(repo.commits[commit].items()):
            if under and not p.startswith(under.rstrip("/") + "/"):
                continue
            entry = {"type": "file", "oid": _git_oid(data), "size": len(data), "path": p}
            if p.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        self._send(h, 200, json.dumps(entries).encode(), body)

    def _file(self, h, repo: FakeRepo, rev: str, path: str, body: bool) -> None:
        commit = self._commit(h, repo, rev)
        if commit is None:
            return
        data = repo.commits[commit].get(path)
        if data is None:
            self._send(h, 404, b'{"error": "Entry not found"}', True, {"X-Error-Code": "EntryNotFound"})
            return
        headers = {"X-Repo-Commit": commit, "ETag": f'"{_oid(path, data)}"'}
        if path.endswith(LFS_SUFFIXES):
            headers |= {"X-Linked-Etag": f'"{_oid(path, data)}"', "X-Linked-Size": str(len(data))}
        self._send(h, 200, data, body, headers)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, body: bool,
              headers: dict[str, str] | None = None) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Content-Type", "application/json" if data[:1] in (b"{", b"[") else "application/octet-stream")
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)
