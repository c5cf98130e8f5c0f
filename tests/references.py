"""Stored reference outputs: what transformers, peft and sentence-transformers compute for the
parity tests (token ids, logprobs, logits, embeddings), kept in `tests/references/` so that a run
compares against them instead of recomputing them (the references are deterministic: float32,
greedy, fixed seeds, pinned library versions).

Each reference is stored under a name with a key: the SHA-256 of the content of its sources (the
checkpoint's bytes, tokenizer included), of its inputs (prompts, parameters) and of the versions
of the libraries that compute it. A test calls `reference(name, compute, sources=..., inputs=...)`:

- by default the stored value is returned; a missing or stale one fails the test, saying what
  changed and the command that regenerates it (`scripts/make_references.py`);
- with `PAGEDLLM_REFERENCES=write` the value is computed and stored (what that script sets);
- with `live=True` (one check per model family and per reference library), or with
  `PAGEDLLM_REFERENCES=live` for every reference, the value is computed every run and must equal
  the stored one, so that the store cannot drift from its source unseen.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

STORE = Path(__file__).resolve().parent / "references"
MODE_ENV = "PAGEDLLM_REFERENCES"
MODES = ("stored", "write", "live")
# Libraries whose version keys every reference (torch computes all of them).
ALWAYS = ("torch",)


def mode() -> str:
    value = os.environ.get(MODE_ENV, "stored") or "stored"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def regenerate_command(test_file: str | None) -> str:
    target = f" {test_file}" if test_file else ""
    return f".venv/bin/python scripts/make_references.py{target}"


@functools.cache
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def content_hash(source: str | os.PathLike | bytes) -> str:
    """SHA-256 of a file's bytes, of a folder's files (relative names and bytes, sorted), or of
    bytes. Path names outside the folder do not count: a checkpoint saved anew in another
    temporary folder with the same bytes has the same hash."""
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest()
    path = Path(source)
    if path.is_file():
        st = path.stat()
        return _file_digest(str(path), st.st_size, st.st_mtime_ns)
    if not path.is_dir():
        raise FileNotFoundError(f"reference source {path} does not exist")
    h = hashlib.sha256()
    for child in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(child.relative_to(path)).encode() + b"\0" + content_hash(child).encode() + b"\n")
    return h.hexdigest()


@functools.cache
def library_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def _canonical(value: Any) -> Any:
    """JSON-able form of inputs and values: tensors and numpy arrays as nested lists."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


# Float arrays of at least this many values are stored packed (see `_pack`): JSON spells a float
# in about 20 characters, the packed form in 5.3 (float32) or 10.7 (float64).
PACK_MIN_VALUES = 64


def _shape(value: Any) -> list[int] | None:
    """The shape of a rectangular nested list of numbers with at least one float, else None."""
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [len(value)] if any(isinstance(v, float) for v in value) else None
    inner = [_shape(v) for v in value]
    if inner[0] is None or any(s != inner[0] for s in inner):
        return None
    return [len(value), *inner[0]]


def _pack(value: Any) -> Any:
    """The stored form of a value: float arrays as little-endian bytes in base64 (float32 when
    every value is one exactly, as logits and embeddings are), the rest as JSON."""
    import base64

    import numpy as np

    if isinstance(value, dict):
        return {k: _pack(v) for k, v in value.items()}
    shape = _shape(value)
    if shape is not None and int(np.prod(shape)) >= PACK_MIN_VALUES:
        wide = np.asarray(value, dtype="<f8")
        narrow = wide.astype("<f4")
        dtype, data = ("float32", narrow) if np.array_equal(narrow.astype("<f8"), wide, equal_nan=True) \
            else ("float64", wide)
        return {"__packed__": dtype, "shape": shape, "data": base64.b64encode(data.tobytes()).decode()}
    if isinstance(value, list):
        return [_pack(v) for v in value]
    return value


def _unpack(value: Any) -> Any:
    import base64

    import numpy as np

    if isinstance(value, dict):
        if "__packed__" in value:
            data = np.frombuffer(base64.b64decode(value["data"]), dtype="<f4" if value["__packed__"] == "float32" else "<f8")
            return data.astype(np.float64).reshape(value["shape"]).tolist()
        return {k: _unpack(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unpack(v) for v in value]
    return value


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(_canonical(value), sort_keys=True).encode()).hexdigest()


def _calling_test_file() -> str | None:
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.split("::", 1)[0] or None


def _path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"reference name {name!r}: give a plain file name (module.case)")
    return STORE / f"{name}.json"


def reference(name: str, compute: Callable[[], Any], *, sources: Iterable[str | os.PathLike | bytes] = (),
              inputs: Any = None, libs: Iterable[str] = ("transformers",), live: bool = False,
              tolerance: float = 1e-4, machine_made: bool = False) -> Any:
    """The reference value `name` (JSON: lists, numbers, strings), computed by `compute()` only
    when writing or checking live; see the module's docstring for the modes and the key.

    `machine_made`: the sources are computed on the machine by float arithmetic whose rounding
    depends on the CPU's vector instruction set (a quantizer's calibration: another CPU writes
    other bytes, a checkpoint of its own). Where only the sources differ from the stored key,
    the reference of this machine's checkpoint is computed live instead of failing as stale."""
    parts = {
        "sources": sorted(content_hash(s) for s in sources),
        "inputs": _digest(inputs),
        "versions": {lib: library_version(lib) for lib in sorted(set(ALWAYS) | set(libs))},
    }
    key = _digest(parts)
    path = _path(name)
    stored = json.loads(path.read_text()) if path.exists() else None
    if stored is not None:
        stored["value"] = _unpack(stored["value"])
    how = mode()
    if how == "write":
        packed = _pack(_canonical(compute()))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "parts": parts, "value": packed}, sort_keys=True) + "\n")
        return _unpack(packed)  # what a stored-mode run reads: the same types either way
    command = regenerate_command(_calling_test_file())
    if stored is None:
        pytest.fail(f"no stored reference {name!r} ({path.relative_to(STORE.parent.parent)}); "
                    f"compute it with: {command}", pytrace=False)
    if stored["key"] != key:
        changed = [part for part in ("sources", "inputs", "versions") if stored["parts"].get(part) != parts[part]]
        if machine_made and changed == ["sources"]:
            return _canonical(compute())
        detail = f"; versions stored {stored['parts'].get('versions')}, now {parts['versions']}" \
            if "versions" in changed else ""
        pytest.fail(f"stored reference {name!r} is stale (its {' and '.join(changed)} changed{detail}); "
                    f"regenerate it with: {command}", pytrace=False)
    if live or how == "live":
        value = _canonical(compute())
        where = _first_difference(value, stored["value"], tolerance)
        assert where is None, (
            f"reference {name!r} computed live differs from the stored one at {where}: the store has "
            f"drifted from its source; regenerate it with: {command}")
        return value
    return stored["value"]


def _first_difference(a: Any, b: Any, tolerance: float, at: str = "value") -> str | None:
    """Where `a` and `b` differ: ids and strings exactly, floats within `tolerance` (relative to
    the larger magnitude, at least absolute): float32 sums on another CPU round differently."""
    if isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
            return f"{at}: {a!r} != {b!r}"
        return None if abs(a - b) <= tolerance * max(1.0, abs(a), abs(b)) else f"{at}: {a!r} != {b!r}"
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{at}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, tolerance, f"{at}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{at}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            found = _first_difference(a[k], b[k], tolerance, f"{at}[{k!r}]")
            if found:
                return found
        return None
    return None if a == b else f"{at}: {a!r} != {b!r}"
