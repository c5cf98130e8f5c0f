"""Tensor parallelism through the whole engine (`LLM(..., tensor_parallel_size=N)`, gloo on CPU):
greedy output equal to one rank token for token on tiny random Llama / Mistral / Qwen2
checkpoints (KV heads split, and replicated when fewer than N; an uneven vocabulary split), the
default SmolLM2 GGUF at N=3, a GPTQ checkpoint at N=2, preemption (recompute and swap) and abort
at N=2; start-up errors (heads that do not divide, a group split, a worker that fails to start,
with its traceback); a worker killed mid-run is a clear error, not a hang; no worker outlives
its engine or the engine's process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.server.fault_hooks.sitecustomize import WORKER_FAULT_ENV as FAULT_ENV
from tests.server.fault_hooks.sitecustomize import inject_worker_fault
from tests.smollm2 import hf_tokenizer

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

PROMPTS = ["Hello there, how are", "The quick brown fox", "1, 2, 3, 4,",
           "A much longer prompt that spans more than one block of eight tokens, and then some more words."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(map(_running, pids)):
        time.sleep(0.1)
    return [p for p in pids if _running(p)]


@contextmanager
def tp_llm(model: str, n: int, **kwargs):
    """An engine of `n` ranks; on exit its workers must be gone and this process (rank 0)
    must have its cores back."""
    cores = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    llm = LLM(model, tensor_parallel_size=n, **kwargs)
    executor = llm.llm_engine.core.executor
    pids = list(executor.worker_pids)
    assert len(pids) == n - 1 and all(map(_running, pids))
    try:
        yield llm
    finally:
        executor.shutdown()
        assert _wait_gone(pids, 10) == []
        assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == threads


def greedy(llm, prompts=PROMPTS, params=GREEDY) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def _tokenizer(smollm2_gguf):
    return hf_tokenizer(smollm2_gguf)


def _save_tiny(path, kind: str, tokenizer, **overrides):
    import transformers as tf

    cfg = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
    cfg.update(overrides)
    config_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                             "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                             "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[kind]
    torch.manual_seed(1234)
    model = model_cls(config_cls(**cfg)).eval()
    with torch.no_grad():  # spread enough that greedy choices are not near-ties
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


TINY = {
    # KV heads fewer than ranks (replicated), an untied head over an uneven vocabulary split
    # (49153 rows: 24577 + 24576), sliding-window attention
    "mistral": dict(num_key_value_heads=1, sliding_window=16, extra_vocab=1),
    # tied embeddings, q/k/v biases, one KV head replicated on every rank
    "qwen2": dict(num_attention_heads=6, num_key_value_heads=1, hidden_size=96, intermediate_size=192,
                  tie_word_embeddings=True, rope_theta=1_000_000.0),
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return _tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    made = {}

    def get(kind):
        if kind not in made:
            overrides = dict(TINY.get(kind, {}))
            extra = overrides.pop("extra_vocab", 0)
            if extra:
                overrides["vocab_size"] = len(tokenizer) + extra
            made[kind] = _save_tiny(tmp_path_factory.mktemp(kind), kind, tokenizer, **overrides)
        return made[kind]
    return get


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy output of one rank, per checkpoint (computed once)."""
    done = {}

    def get(kind):
        if kind not in done:
            done[kind] = greedy(LLM(tiny(kind), kv_cache_space=0.05, block_size=8))
        return done[kind]
    return get


@pytest.mark.parametrize("kind,n", [("mistral", 2), ("qwen2", 3), ("qwen2", 2)])
def test_tiny_models_greedy_equal_to_one_rank(tiny, reference, kind, n):
    with tp_llm(tiny(kind), n, kv_cache_space=0.05, block_size=8) as llm:
        assert greedy(llm) == reference(kind)
        # rank 0 holds its shard and its KV heads only
        attn = llm.llm_engine.model.model.layers[0].self_attn
        cfg = llm.llm_engine.hf_config
        assert attn.num_heads == cfg.num_attention_heads // n
        assert attn.num_kv_heads == max(1, cfg.num_key_value_heads // n)
        assert llm.llm_engine.model_runner.kv_caches[0].shape[3] == attn.num_kv_heads
        embed = llm.llm_engine.model.model.embed_tokens
        assert embed.weight.shape[0] == -(-cfg.vocab_size // n)
    assert len({t for out in reference(kind) for t in out[0]}) > 5  # not degenerate


# ---- one Llama engine of 2 ranks (KV heads split) with a tiny pool: preemption, abort ---------

POOL = dict(num_kv_blocks=14, block_size=8, swap_space=0.01, enable_prefix_caching=False)
GROUPS = SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="class")
def llama_pair(tiny):
    """Both engines live for TestLlamaTwoRanks only: a process runs one tensor-parallel engine
    at a time."""
    path = tiny("llama")
    one = LLM(path, **POOL)
    with tp_llm(path, 2, **POOL) as two:
        with pytest.raises(RuntimeError, match="already runs a tensor-parallel engine"):
            LLM(path, tensor_parallel_size=2, **POOL)
        yield one, two


class TestLlamaTwoRanks:

    def test_preemption_by_recompute_and_swap_equal_to_one_rank(self, llama_pair):
        one, two = llama_pair
        prompts = PROMPTS * 2
        singles, groups = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), GROUPS
        assert greedy(two, prompts, singles) == greedy(one, prompts, singles)
        assert greedy(two, PROMPTS, groups) == greedy(one, PROMPTS, groups)
        stats = two.kv_cache_stats()
        assert stats.num_preemptions > 0 and stats.num_swapped_out > 0  # both kinds happened
        assert stats.num_swapped_in == stats.num_swapped_out and stats.used_blocks == 0
        two.llm_engine.kv_cache_manager.check_invariants([])

    def test_abort_mid_run_with_two_ranks(self, llama_pair):
        one, two = llama_pair
        expected = greedy(one, PROMPTS[:3])
        engine = two.llm_engine
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"r{i}", prompt, GREEDY)
        finished = {}
        for _ in range(3):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        engine.abort_request("r1")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert sorted(finished) == ["r0", "r2"]
        assert [finished["r0"].outputs[0].token_ids, finished["r2"].outputs[0].token_ids] == \
            [expected[0][0], expected[2][0]]
        assert two.kv_cache_stats().used_blocks == 0


# ---- the default model and a quantized checkpoint ---------------------------------------------

def test_smollm2_three_ranks_equal_one(smollm2_gguf, smollm2_llm):
    """The default GGUF (9 heads, 3 KV heads: one each; Q8_0 blocks cut along their rows and
    whole blocks of 32 inputs) at N=3."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = PROMPTS + ["The capital of France is"]
    expected = greedy(smollm2_llm, prompts, params)
    with tp_llm(smollm2_gguf, 3, kv_cache_space=1.0, max_model_len=2048) as llm:
        assert greedy(llm, prompts, params) == expected
        model = llm.llm_engine.model
        assert model.model.embed_tokens.int_weight is not None  # kept packed, 16384 rows of 49152
        assert model.model.embed_tokens.vocab_rows == 16384
        assert model.model.layers[0].mlp.down_proj.input_size == 512


def test_gptq_two_ranks_equal_one(tiny, tmp_path):
    from pagedllm.quantization.algorithms.checkpoint_writer import quantize_model

    folder = str(quantize_model(tiny("llama"), str(tmp_path / "gptq"), fmt="gptq", bits=4, group_size=32))
    expected = greedy(LLM(folder, kv_cache_space=0.05, block_size=8))
    with tp_llm(folder, 2, kv_cache_space=0.05, block_size=8) as llm:
        assert greedy(llm) == expected
        down = llm.llm_engine.model.model.layers[0].mlp.down_proj
        assert down.int_weight.in_features == 64  # its half of the 128 input rows, still packed
    # group_size 64: the attention output's 64 rows would split into shards of 32
    wide = str(quantize_model(tiny("llama"), str(tmp_path / "gptq64"), fmt="gptq", bits=4, group_size=64))
    with pytest.raises(ValueError, match="o_proj: tensor parallelism would split a quantization group"):
        LLM(wide, tensor_parallel_size=2, kv_cache_space=0.05)


# ---- start-up and run-time failures ------------------------------------------------------------

def _children() -> set[int]:
    """Live descendants of this process (from /proc)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent_of[int(entry)] = int(fields[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parent_of.items() if parent in frontier} - found
        found |= frontier
    return found


def test_heads_that_do_not_divide_fail_before_any_worker_starts(tiny):
    before = _children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's 4 attention heads "
                                         r"\(2 KV heads\); it must be one of \[1, 2, 4\]"):
        LLM(tiny("llama"), tensor_parallel_size=3, kv_cache_space=0.05)
    assert _children() == before


def test_a_worker_that_fails_to_start_shows_its_traceback(tiny, monkeypatch):
    from pagedllm.executor.multiproc import WorkerFailure

    before = _children()
    inject_worker_fault(monkeypatch, "1:load")
    with pytest.raises(WorkerFailure) as info:
        LLM(tiny("llama"), tensor_parallel_size=2, kv_cache_space=0.05)
    text = str(info.value)
    assert "tensor-parallel worker rank 1" in text and "exited with code 1" in text
    assert "Traceback (most recent call last)" in text and "worker_proc.py" in text
    assert f"InjectedFault: fault injected by {FAULT_ENV}=1:load" in text
    assert _wait_gone(list(_children() - before), 10) == []


def test_a_worker_killed_mid_run_is_a_clear_error(tiny):
    with tp_llm(tiny("llama"), 2, kv_cache_space=0.05, block_size=8) as llm:
        greedy(llm, PROMPTS[:1])
        (pid,) = llm.llm_engine.core.executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {pid}, exited with code -9\)"):
            greedy(llm, PROMPTS[:2])
        assert time.monotonic() - t0 < 10  # no hang on the dead rank's collective
        with pytest.raises(RuntimeError, match="worker rank 1"):  # and it stays failed
            greedy(llm, PROMPTS[:1])


_ORPHAN_SCRIPT = textwrap.dedent("""
    import gc, os, signal, sys
    from pagedllm import LLM
    llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_space=0.05)
    pids = llm.llm_engine.core.executor.worker_pids
    del llm
    gc.collect()  # the engine is gone: its executor's finalizer stops the workers
    print("after close, running:", [p for p in pids if os.path.exists(f"/proc/{p}")], flush=True)
    llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_space=0.05)
    print("killed", *llm.llm_engine.core.executor.worker_pids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up at all: the workers must notice
""")


def test_no_worker_outlives_its_engine_or_its_process(tiny):
    proc = subprocess.run([sys.executable, "-c", _ORPHAN_SCRIPT, tiny("llama")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "after close, running: []"  # stopped and reaped by the engine's finalizer
    killed = [int(p) for p in lines[1].split()[1:]]
    assert len(killed) == 1 and _wait_gone(killed, 10) == []
