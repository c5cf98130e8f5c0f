"""A Hugging Face Hub cache written by hand, exactly as huggingface_hub lays it out, for tests
that must not touch the network:

    <cache>/models--org--name/blobs/<sha>                 the file contents (sha256 for LFS
                                                          files: weights, GGUF; git sha1 else)
    <cache>/models--org--name/snapshots/<commit>/<path>   relative symlinks to the blobs
    <cache>/models--org--name/refs/<ref>                  the commit hash (no newline)
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def commit_hash(label: str) -> str:
    """A 40-hex commit hash (what the Hub's commits look like) derived from `label`."""
    return hashlib.sha1(label.encode()).hexdigest()


def _blob_name(path: Path, repo_path: str) -> str:
    h = hashlib.sha256() if repo_path.endswith(LFS_SUFFIXES) else hashlib.sha1()
    if not repo_path.endswith(LFS_SUFFIXES):  # git's blob id: sha1("blob <size>\0" + data)
        h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def add_revision(cache: Path, repo_id: str, commit: str, files: dict[str, Path | bytes],
                 refs: tuple[str, ...] = ("main",)) -> Path:
    """Store `files` (repo path -> a file to copy, hard-linked when possible, or its bytes) as
    the snapshot of `commit` and point `refs` at it; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for repo_path, content in files.items():
        if isinstance(content, bytes):
            tmp = repo / "blobs" / "incoming"
            tmp.write_bytes(content)
            content = tmp
        blob = repo / "blobs" / _blob_name(Path(content), repo_path)
        if not blob.exists():
            if content.parent == repo / "blobs":
                content.rename(blob)
            else:
                try:
                    os.link(content, blob)  # a GGUF of 100 MB need not be copied
                except OSError:
                    shutil.copyfile(content, blob)
        elif content.name == "incoming":
            content.unlink()
        link = snapshot / repo_path
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        ref_file = repo / "refs" / ref
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        ref_file.write_text(commit)
    return snapshot


def add_folder(cache: Path, repo_id: str, commit: str, folder: Path,
               refs: tuple[str, ...] = ("main",)) -> Path:
    """A checkpoint folder's files (recursively) as the snapshot of `commit`."""
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    return add_revision(cache, repo_id, commit, files, refs)
