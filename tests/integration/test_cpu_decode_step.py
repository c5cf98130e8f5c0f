"""The C decode step (worker/cpu_decode_step.py, kernels/decode_step.c) gives the eager step's
logits to the bit, for every kind of projection it calls (float panels, int_gemm exact and int8,
GGUF blocks of mixed types), biases, sliding windows and KV cache types, at 1, 3 and 20 rows
(20: the exact kernels' panel path with scratch), for each family it describes (Llama, Qwen2,
Mistral, Qwen3's q/k norms, Gemma 2 / 3's four norms, GELU-tanh, soft caps and rotary tables,
and a hybrid KV cache's groups through a whole engine); and it steps aside, leaving the eager
model, wherever it does not apply."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.model import load_model
from pagedllm.worker import ModelRunner
from pagedllm.worker.cpu_decode_step import CpuDecodeStep, unsupported_reason
from tests.integration.model_fixtures import (
    TINY_VOCAB,
    ToyBlocks,
    make_hf_model,
    save_checkpoint,
    step_plan,
    table_step,
    tiny_config,
)

pytestmark = pytest.mark.slow  # loads models: not in the quick `not slow` tier

NUM_BLOCKS = 96
BLOCK_SIZE = 8
TINY = {
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2-qkvbias": ("qwen2", dict()),
    "mistral-sliding5": ("mistral", dict(sliding_window=5)),
    "qwen3": ("qwen3", dict()),
    # as tests/integration/test_arch_gemma.py's: windows, soft caps, local / global rope
    "gemma2": ("gemma2", dict(sliding_window=5, attn_logit_softcapping=3.0, final_logit_softcapping=0.5)),
    "gemma3": ("gemma3", dict(sliding_window=5, sliding_window_pattern=3, rope_local_base_freq=100.0,
                              rope_scaling={"rope_type": "linear", "factor": 2.0})),
}


def _tiny_config(arch: str, **overrides):
    if not arch.startswith("gemma"):
        return tiny_config(arch, **overrides)
    from transformers import Gemma2Config, Gemma3TextConfig

    cls = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
    return cls(**dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                      max_position_embeddings=512) | overrides)


def _decode_logits(model, config, batch: int, steps: int, c_step: bool, seed: int = 0,
                   kv_cache_dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], ModelRunner]:
    """Prefill `batch` random prompts (eager), then `steps` greedy decode steps of all of them;
    each decode step's sampled logits."""
    runner = ModelRunner(model, config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu",
                         kv_cache_dtype=kv_cache_dtype, cpu_decode_step=c_step)
    rng = random.Random(seed)
    vocab = min(config.vocab_size, TINY_VOCAB)
    blocks = ToyBlocks(NUM_BLOCKS, BLOCK_SIZE, seed=seed)
    tokens = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 12))] for _ in range(batch)]
    out = runner.execute_model(step_plan([
        table_step(i, t, 0, blocks.ensure(i, len(t))) for i, t in enumerate(tokens)]))
    logits = []
    for _ in range(steps):
        for t, row in zip(tokens, out.sample_logits):
            t.append(int(row.argmax()))
        out = runner.execute_model(step_plan([
            table_step(i, t[-1:], len(t) - 1, blocks.ensure(i, len(t))) for i, t in enumerate(tokens)]))
        logits.append(out.sample_logits.clone())
    return logits, runner


def _assert_same_as_eager(model, config, batch: int, steps: int = 6, **kw) -> None:
    ours, runner = _decode_logits(model, config, batch, steps, c_step=True, **kw)
    eager, eager_runner = _decode_logits(model, config, batch, steps, c_step=False, **kw)
    assert runner.cpu_decode_step is not None and eager_runner.cpu_decode_step is None
    assert runner.cpu_decode_step.steps == steps  # every decode step ran in C
    for a, b in zip(ours, eager, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request, tmp_path_factory):
    arch, overrides = TINY[request.param]
    config = _tiny_config(arch, **overrides)
    path = save_checkpoint(make_hf_model(config, seed=3), tmp_path_factory.mktemp(request.param))
    # At these toy sizes torch's op may win a bucket (the step then stays eager): ask for the kernels.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_KERNEL_CHOICE", "kernel")
        return load_model(str(path), None, config, torch.float32, torch.device("cpu")), config


@pytest.mark.parametrize("batch", [1, 3, 20])
def test_float_models_equal_eager(tiny, batch):
    _assert_same_as_eager(*tiny, batch)


@pytest.mark.parametrize("kv", [torch.int8, torch.bfloat16])
def test_kv_cache_types_equal_eager(tiny, kv):
    _assert_same_as_eager(*tiny, 3, kv_cache_dtype=kv)


@pytest.fixture(scope="module", params=["auto", "int8"])
def default_model(request, smollm2_gguf, shared_llm):
    """The default model (the run's shared engine for "auto"; its runners here get their own caches)."""
    if request.param == "auto":
        llm = shared_llm(model=smollm2_gguf, kv_cache_space=1.0, max_model_len=2048)
    else:
        llm = shared_llm(model=smollm2_gguf, kv_cache_space=0.05, quant_compute="int8")
    return llm.llm_engine.model, llm.llm_engine.hf_config


@pytest.mark.parametrize("batch", [1, 20])
def test_default_model_equals_eager(default_model, batch):
    """SmolLM2's Q4_1 file: every projection through int_gemm.c (exact, or int8 activations)."""
    model, config = default_model
    _assert_same_as_eager(model, config, batch, steps=4)


def test_gguf_blocks_of_mixed_types_equal_eager(smollm2_kquant_gguf):
    """Q5_0 / Q5_1 / Q8_0 parts of fused q/k/v and gate/up, Q4_K / Q6_K down: gguf_gemm.c parts."""
    from pagedllm import LLM

    llm = LLM(smollm2_kquant_gguf, kv_cache_space=0.05)
    model = llm.llm_engine.model
    assert len(model.model.layers[0].self_attn.qkv_proj.gguf_weights) == 3
    _assert_same_as_eager(model, llm.llm_engine.hf_config, 3, steps=3)


def test_steps_aside_where_it_does_not_apply(tiny, monkeypatch):
    model, config = tiny
    runner = ModelRunner(model, config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    step = runner.cpu_decode_step
    assert step is not None
    ids = torch.tensor([5, 6])
    tables = torch.tensor([[0, 1], [2, 3]])
    lens = torch.tensor([3, 4])
    # a slot outside the cache: the kernel refuses, the step returns None (the eager step then
    # raises the precise error)
    bad = step.run(ids, torch.tensor([2, 3]), _metadata(torch.tensor([2, NUM_BLOCKS * BLOCK_SIZE]), tables, lens))
    assert bad is None
    with pytest.raises(ValueError, match="slot"):
        runner.model(ids, torch.tensor([2, 3]), runner.kv_caches, _metadata(torch.tensor([2, NUM_BLOCKS * BLOCK_SIZE]),
                                                                             tables, lens))
    assert step.run(ids, torch.tensor([2, 3]), _metadata(torch.tensor([2, 27]), tables, lens)) is not None
    # a bucket where torch's op is kept for one projection: no plan, eager
    layer = model.model.layers[1].mlp.down_proj
    monkeypatch.setattr(layer, "prepared", layer.prepared._replace(paths=("torch",) * 5))
    step._plans.clear()
    assert step.run(ids, torch.tensor([2, 3]), _metadata(torch.tensor([2, 27]), tables, lens)) is None
    # switched off, or asked for eager
    monkeypatch.setenv("PAGEDLLM_DECODE_STEP", "0")
    assert "PAGEDLLM_DECODE_STEP=0" in unsupported_reason(model, runner.kv_caches)
    assert CpuDecodeStep.create(model, runner.kv_caches, BLOCK_SIZE) is None
    monkeypatch.delenv("PAGEDLLM_DECODE_STEP")
    assert ModelRunner(model, config, 8, BLOCK_SIZE, torch.float32, "cpu", cpu_decode_step=False).cpu_decode_step is None


def test_other_architectures_are_named(tmp_path):
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, shared_expert_intermediate_size=64)
    model = load_model(str(save_checkpoint(make_hf_model(config), tmp_path)), None, config, torch.float32,
                       torch.device("cpu"))
    runner = ModelRunner(model, config, 8, BLOCK_SIZE, torch.float32, "cpu")
    assert runner.cpu_decode_step is None
    assert "is not a dense gated MLP (a mixture of experts runs eager)" in unsupported_reason(model, runner.kv_caches)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_hybrid_kv_cache_groups_equal_eager(arch, tmp_path, monkeypatch):
    """Through a whole engine: Gemma's sliding layers in their own KV cache groups (each group's
    block tables), windows shorter than the sequences, decode steps in C; the same tokens and
    logprobs as the engine with the step switched off."""
    from pagedllm import LLM, SamplingParams

    from tests.integration.arch_parity import build_tiny

    _, overrides = TINY[arch]
    build_tiny(_tiny_config(arch, **overrides), tmp_path, seed=5)
    path = tmp_path
    monkeypatch.setenv("PAGEDLLM_KERNEL_CHOICE", "kernel")

    def run(step: str):
        monkeypatch.setenv("PAGEDLLM_DECODE_STEP", step)
        llm = LLM(model=str(path), kv_cache_space=0.01, max_model_len=256, block_size=8)
        try:
            runner = llm.llm_engine.model_runner
            assert runner.kv_cache_groups is not None and len(runner.kv_cache_groups.groups) > 1  # hybrid
            prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 90 for j in range(5 + 7 * i)]} for i in range(3)]
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True),
                                use_tqdm=False)
            steps = runner.cpu_decode_step.steps if runner.cpu_decode_step is not None else 0
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], steps
        finally:
            llm.shutdown()

    ours, steps = run("1")
    eager, eager_steps = run("0")
    assert steps > 0 and eager_steps == 0
    assert ours == eager


def _metadata(slots, tables, lens):
    from pagedllm.layers.attention import AttentionMetadata

    return AttentionMetadata(slot_mapping=slots, block_size=BLOCK_SIZE, num_decode_tokens=len(slots),
                             decode_block_tables=tables, decode_context_lens=lens)
