"""Model resolution errors and the cached GGUF-derived config."""

from __future__ import annotations

import pytest

from pagedllm.model_source import load_hf_config, resolve_model

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def test_resolve_errors(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="neither a Hugging Face model folder, a .gguf file, nor a Hub model id"):
        resolve_model(str(tmp_path / "missing"))


def test_gguf_config_is_cached(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    src = resolve_model(smollm2_gguf)
    first = load_hf_config(src)
    cached = list((tmp_path / "configs").iterdir())
    assert len(cached) == 1 and (cached[0] / "config.json").exists()
    second = load_hf_config(src)
    a, b = first.to_dict(), second.to_dict()
    a.pop("_name_or_path"), b.pop("_name_or_path")
    assert a == b and b["num_hidden_layers"] == 30 and b["num_key_value_heads"] == 3
