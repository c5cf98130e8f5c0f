"""pagedllm/envs.py: every environment knob declared once, parsed with clear errors, documented in
docs/environment.md (generated), and read nowhere else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedllm import envs

ROOT = Path(__file__).resolve().parents[2]


def test_docs_table_is_generated_from_the_declarations():
    assert (ROOT / "docs" / "environment.md").read_text() == envs.table_markdown(), \
        "regenerate it: python -m pagedllm.envs > docs/environment.md"


def test_no_other_module_reads_the_environment():
    """Only envs.py reads knobs; what else touches os.environ is not a knob (a child process's
    copy of the environment, the parent-to-worker secret, the devices a CUDA error names)."""
    allowed = {"envs.py", "executor/multiproc.py", "executor/worker_proc.py"}
    readers = {str(p.relative_to(ROOT / "pagedllm")) for p in (ROOT / "pagedllm").rglob("*.py")
               if re.search(r"os\.environ|os\.getenv|getenv\(", p.read_text())}
    assert readers <= allowed, readers - allowed
    for name in envs.KNOBS:  # and those few never read a declared knob
        for rel in allowed - {"envs.py"}:
            assert f'"{name}"' not in (ROOT / "pagedllm" / rel).read_text(), (name, rel)


def test_values_are_parsed_with_their_defaults(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_DECODE_STEP", raising=False)
    assert envs.PAGEDLLM_DECODE_STEP is True
    for raw, value in (("0", False), ("", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("PAGEDLLM_DECODE_STEP", raw)
        assert envs.PAGEDLLM_DECODE_STEP is value
    monkeypatch.setenv("TRITON_INTERPRET", "on")
    assert envs.TRITON_INTERPRET is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert envs.TRITON_INTERPRET is False
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", "~/somewhere")
    assert envs.PAGEDLLM_CACHE_DIR == Path.home() / "somewhere"
    monkeypatch.setenv("PAGEDLLM_KERNEL_CHOICE", "")
    assert envs.PAGEDLLM_KERNEL_CHOICE == "measure"
    monkeypatch.setenv("PAGEDLLM_TP_TIMEOUT_S", "2.5")
    assert envs.PAGEDLLM_TP_TIMEOUT_S == 2.5


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("PAGEDLLM_KERNEL_CHOICE", "fastest", r"PAGEDLLM_KERNEL_CHOICE must be one of \['measure', 'kernel', 'torch'\], "
                                          r"got 'fastest'"),
    ("PAGEDLLM_KERNEL_CHOICE_BUDGET", "-1", "PAGEDLLM_KERNEL_CHOICE_BUDGET must be a number of seconds >= 0, got '-1'"),
    ("PAGEDLLM_TP_TIMEOUT_S", "soon", "PAGEDLLM_TP_TIMEOUT_S must be a positive number, got 'soon'"),
    ("PAGEDLLM_RAY_CPUS_PER_RANK", "0", "PAGEDLLM_RAY_CPUS_PER_RANK must be a positive number, got '0'"),
    ("PAGEDLLM_RAY_REPLICA_STRATEGY", "ANY", "PAGEDLLM_RAY_REPLICA_STRATEGY must be one of"),
])
def test_bad_values_are_refused_by_name(monkeypatch, name, raw, message):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=message):
        getattr(envs, name)


def test_unknown_names_are_not_knobs():
    with pytest.raises(AttributeError):
        envs.PAGEDLLM_NO_SUCH_KNOB  # noqa: B018
    with pytest.raises(KeyError):
        envs.is_set("PAGEDLLM_NO_SUCH_KNOB")
