"""The online path: huggingface_hub's real download code against a local stand-in for the Hub
(tests/hub_endpoint.py, `HF_ENDPOINT=http://127.0.0.1:PORT`). huggingface_hub reads its
environment once, at import, so each case runs in a fresh interpreter with `HF_HUB_OFFLINE=0`;
what it downloaded is then loaded offline here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.model_source import resolve_model
from tests.hub_cache import add_revision, commit_hash
from tests.hub_endpoint import FakeHub, FakeRepo
from tests.integration.arch_parity import build_tiny
from tests.integration.test_hub_models import _greedy, _tiny_config

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

MAIN, V1, GG = commit_hash("online main"), commit_hash("online v1"), commit_hash("online gguf")

_RESOLVE = r"""
import json, os, sys
from pagedllm.model_source import resolve_model
for model, kwargs in json.loads(sys.argv[1]):
    try:
        s = resolve_model(model, **kwargs)
        files = sorted(os.path.relpath(os.path.join(r, f), s.path) for r, _, fs in os.walk(s.path) for f in fs)
        print(json.dumps({"path": s.path, "gguf_file": s.gguf_file, "revision": s.revision, "files": files}))
    except ValueError as e:
        print(json.dumps({"error": str(e)}))
"""


def _resolve_online(endpoint: str, home: Path, cases: list[tuple[str, dict]],
                    token: str | None = None) -> list[dict]:
    """resolve_model of each case in a fresh interpreter talking to `endpoint`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    env |= {"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(home),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    if token is not None:
        env["HF_TOKEN"] = token
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("online")
    build_tiny(_tiny_config(), root / "a", seed=0)
    build_tiny(_tiny_config(), root / "b", seed=1)
    return {"a": root / "a", "b": root / "b"}


@pytest.fixture(scope="module")
def hub(folders):
    tiny = FakeRepo()
    files_a = {p.name: p for p in folders["a"].iterdir()}
    # The shard index names model.safetensors only: the other copy and the pickles are left alone.
    index = json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors"}})
    extras = {"README.md": b"# tiny", "pytorch_model.bin": b"pickle", "consolidated.safetensors": b"copy",
              "model.safetensors.index.json": index.encode()}
    tiny.add(MAIN, files_a | extras)
    tiny.add(V1, {p.name: p for p in folders["b"].iterdir()}, refs=("v1",))
    gguf = FakeRepo()
    gguf.add(GG, {"m-Q4_K_M.gguf": b"GGUF-q4", "m-Q8_0.gguf": b"GGUF-q8", "README.md": b"x"})
    gated = FakeRepo(gated=True)
    gated.add(GG, {"m-Q4_0.gguf": b"GGUF-gated"})
    with FakeHub({"org/tiny": tiny, "org/gg": gguf, "org/gated": gated}) as server:
        yield server


@pytest.fixture(autouse=True)
def offline_here(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_download_then_load_offline(hub, folders, tmp_path):
    """snapshot_download fetches what pagedllm needs (config, tokenizer, the index's shards) and
    records the refs: the cache then loads offline, each revision with its own weights."""
    home = tmp_path / "home"
    main, v1 = _resolve_online(hub.url, home, [("org/tiny", {}), ("org/tiny", {"revision": "v1"})])
    assert main["revision"] == MAIN and v1["revision"] == V1, (main, v1)
    assert main["files"] == ["config.json", "generation_config.json", "model.safetensors",
                             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    fetched = {path for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path}
    for never in ("README.md", "pytorch_model.bin", "consolidated.safetensors"):
        assert not any(p.endswith("/" + never) for p in fetched), never
    cache = str(home / "hub")
    assert (home / "hub" / "models--org--tiny" / "refs" / "v1").read_text() == V1
    assert _greedy("org/tiny", download_dir=cache)[0] == _greedy(str(folders["a"]))[0]
    assert _greedy("org/tiny", revision="v1", download_dir=cache)[0] == _greedy(str(folders["b"]))[0]


def test_gguf_tag_downloads_one_file(hub, tmp_path):
    home = tmp_path / "home"
    (got,) = _resolve_online(hub.url, home, [("org/gg:q4_k_m", {})])
    assert (got["gguf_file"], got["files"]) == ("m-Q4_K_M.gguf", ["m-Q4_K_M.gguf"]), got
    assert not any(p.endswith("m-Q8_0.gguf") for m, p, _ in hub.requests if m == "GET")
    cache = str(home / "hub")
    assert resolve_model("org/gg:Q4_K_M", download_dir=cache).gguf_file == "m-Q4_K_M.gguf"
    # Offline, the cached listing knows the repo's other GGUF, which was never downloaded.
    with pytest.raises(ValueError, match=r"Model 'org/gg' \(revision 'main'\) is only partly in the "
                                         r"Hugging Face cache .*m-Q8_0.gguf"):
        resolve_model("org/gg:Q8_0", download_dir=cache)


def test_hub_errors_and_token(hub, tmp_path):
    gated, absent, bad_revision, bad_tag = _resolve_online(hub.url, tmp_path / "h1", [
        ("org/gated", {}), ("org/absent", {}), ("org/tiny", {"revision": "v9"}), ("org/gg:Q2_K", {})])
    assert "is a gated repository on the Hugging Face Hub" in gated["error"]
    assert "set HF_TOKEN" in gated["error"]
    assert absent["error"].startswith(f"Model 'org/absent' (revision 'main'): no such repository on the "
                                      f"Hugging Face Hub ({hub.url})")
    assert bad_revision["error"] == "Model 'org/tiny' (revision 'v9'): the repository has no revision 'v9' " \
                                    "(a branch, tag or commit hash)."
    assert bad_tag["error"] == "org/gg: no GGUF file matches the quantization tag 'Q2_K'. " \
                               "The repo's GGUF files: m-Q4_K_M.gguf, m-Q8_0.gguf."
    hub.requests.clear()
    (ok,) = _resolve_online(hub.url, tmp_path / "h2", [("org/gated", {})], token="hf_test_token")
    assert ok.get("gguf_file") == "m-Q4_0.gguf", ok
    auth = {a for _, p, a in hub.requests if p.startswith(("/api/models/org/gated", "/org/gated/"))}
    assert auth == {"Bearer hf_test_token"}


def test_unreachable_hub_falls_back_on_the_cache(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    home = tmp_path / "home"
    add_revision(home / "hub", "org/cached", MAIN, {"config.json": b"{}", "model.safetensors": b"w"})
    t0 = time.monotonic()
    cached, absent = _resolve_online(closed, home, [("org/cached", {}), ("org/absent", {})])
    # No tree listing is attempted once the Hub is known unreachable (each retries for 23 s).
    assert time.monotonic() - t0 < 15
    assert cached.get("revision") == MAIN, cached
    assert absent["error"].startswith(f"Model 'org/absent' (revision 'main') is not in the Hugging Face cache "
                                      f"(looked in {home / 'hub' / 'models--org--absent'}")
    assert f"the Hub ({closed}) could not be reached" in absent["error"]

