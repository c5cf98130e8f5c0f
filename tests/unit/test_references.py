"""The stored references (tests/references.py): written in write mode, read by default, a
missing or stale one fails saying what changed and how to regenerate it, a live check compares
with a tolerance for floats only."""

from __future__ import annotations

import pytest

from tests import references
from tests.references import content_hash, reference


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(references, "STORE", tmp_path / "references")
    monkeypatch.delenv(references.MODE_ENV, raising=False)
    return tmp_path


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "config.json").write_text("{}")
    return folder


def _write(monkeypatch, name, value, **kw):
    monkeypatch.setenv(references.MODE_ENV, "write")
    assert reference(name, lambda: value, **kw) == value
    monkeypatch.delenv(references.MODE_ENV)


def test_written_then_read_without_computing(store, checkpoint, monkeypatch):
    _write(monkeypatch, "m.case", [[1, 2, 3]], sources=[checkpoint], inputs={"prompt": [5, 6]})
    assert reference("m.case", lambda: pytest.fail("computed in stored mode"), sources=[checkpoint],
                     inputs={"prompt": [5, 6]}) == [[1, 2, 3]]


def test_missing_reference_fails_with_the_regeneration_command(store):
    with pytest.raises(pytest.fail.Exception, match="no stored reference 'm.none'.*scripts/make_references.py"):
        reference("m.none", lambda: 1)


@pytest.mark.parametrize("change", ["inputs", "sources"])
def test_stale_key_fails_naming_what_changed(store, checkpoint, monkeypatch, change):
    _write(monkeypatch, "m.case", [1], sources=[checkpoint], inputs={"max_tokens": 4})
    inputs = {"max_tokens": 5} if change == "inputs" else {"max_tokens": 4}
    if change == "sources":
        (checkpoint / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(pytest.fail.Exception, match=f"stale \\(its {change} changed\\).*make_references"):
        reference("m.case", lambda: [1], sources=[checkpoint], inputs=inputs)


def test_a_library_version_change_is_stale(store, monkeypatch):
    _write(monkeypatch, "m.case", [1])
    monkeypatch.setattr(references, "library_version", lambda name: "0.0-other")
    with pytest.raises(pytest.fail.Exception, match="its versions changed.*0.0-other"):
        reference("m.case", lambda: [1])


def test_live_check_compares_ids_exactly_and_floats_within_tolerance(store, monkeypatch):
    _write(monkeypatch, "m.ids", {"ids": [1, 2], "logprob": -1.25})
    assert reference("m.ids", lambda: {"ids": [1, 2], "logprob": -1.25 + 1e-6}, live=True)["ids"] == [1, 2]
    with pytest.raises(AssertionError, match=r"value\['ids'\]\[1\]: 3 != 2.*drifted"):
        reference("m.ids", lambda: {"ids": [1, 3], "logprob": -1.25}, live=True)
    with pytest.raises(AssertionError, match=r"value\['logprob'\]"):
        reference("m.ids", lambda: {"ids": [1, 2], "logprob": -1.3}, live=True)


def test_live_mode_recomputes_every_reference(store, monkeypatch):
    _write(monkeypatch, "m.case", [7])
    monkeypatch.setenv(references.MODE_ENV, "live")
    with pytest.raises(AssertionError, match="drifted"):
        reference("m.case", lambda: [8])


def test_tensors_are_stored_as_lists(store, monkeypatch):
    import torch

    _write(monkeypatch, "m.tensor", [0.5, 1.5], inputs={"ids": torch.tensor([1, 2])})
    assert reference("m.tensor", lambda: None, inputs={"ids": [1, 2]}) == [0.5, 1.5]


def test_content_hash_ignores_where_a_folder_is(tmp_path, checkpoint):
    other = tmp_path / "elsewhere"
    other.mkdir()
    for f in checkpoint.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    assert content_hash(other) == content_hash(checkpoint)
    (other / "config.json").write_text('{"x": 1}')
    assert content_hash(other) != content_hash(checkpoint)


def test_bad_mode_and_name_are_refused(store, monkeypatch):
    with pytest.raises(ValueError, match="plain file name"):
        reference("a/b", lambda: 1)
    monkeypatch.setenv(references.MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="PAGEDLLM_REFERENCES='sometimes'"):
        reference("m.case", lambda: 1)


def test_float_arrays_are_stored_packed_and_read_back_exactly(store, monkeypatch):
    import json

    import torch

    logits = torch.randn(3, 40)  # float32: stored as 4 bytes a value
    wide = [x / 3 for x in range(70)]  # not float32-exact: stored as float64
    value = {"logits": logits, "wide": wide, "ids": list(range(100)), "ragged": [[0.5, 1.5], [2.5]]}
    monkeypatch.setenv(references.MODE_ENV, "write")
    written = reference("m.packed", lambda: value)
    monkeypatch.delenv(references.MODE_ENV)
    raw = json.loads((references.STORE / "m.packed.json").read_text())["value"]
    assert raw["logits"]["__packed__"] == "float32" and raw["wide"]["__packed__"] == "float64"
    assert raw["ids"] == list(range(100)) and raw["ragged"] == [[0.5, 1.5], [2.5]]  # ints and ragged: plain JSON
    got = reference("m.packed", lambda: None)
    assert got == written  # a write run's test sees what a stored run's sees
    assert got["logits"] == logits.tolist() and got["wide"] == wide
    assert got["ids"] == list(range(100)) and got["ragged"] == [[0.5, 1.5], [2.5]]


def test_a_machine_made_source_that_differs_is_computed_live(store, checkpoint, monkeypatch):
    """A quantizer's output on another CPU: other bytes, so this machine's reference is computed;
    other inputs are still stale."""
    _write(monkeypatch, "m.quantized", [1, 2], sources=[checkpoint], inputs={"n": 2})
    (checkpoint / "model.safetensors").write_bytes(b"rounded otherwise")
    assert reference("m.quantized", lambda: [1, 3], sources=[checkpoint], inputs={"n": 2}, machine_made=True) == [1, 3]
    with pytest.raises(pytest.fail.Exception, match="stale"):
        reference("m.quantized", lambda: [1, 3], sources=[checkpoint], inputs={"n": 2})
    with pytest.raises(pytest.fail.Exception, match="its sources and inputs changed"):
        reference("m.quantized", lambda: [1, 3], sources=[checkpoint], inputs={"n": 3}, machine_made=True)
