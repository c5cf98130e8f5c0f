"""Logits parity with transformers (float32) for tiny random Llama / Qwen2 / Mistral checkpoints,
run through the real loader, ModelRunner, paged KV cache and attention backend.

Scenarios: one-step batched prefill of sequences of different lengths; chunked prefill on top of
cached context, then decodes batched with another sequence's prefill; prefix-cache hits and
copy-on-write forks. Block ids are shuffled (non-contiguous) and block sizes vary.

transformers' logits (and its `generate`) are stored references (tests/references.py), keyed
by each checkpoint's bytes and the sequences (our greedy tokens among them); the Llama family's
live check is test_tiny_models'.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig
from tests.integration.model_fixtures import (
    TINY_VOCAB,
    ToyBlocks,
    logits_reference,
    make_hf_model,
    save_checkpoint,
    step_plan,
    table_step,
    tiny_config,
)

from pagedllm.core.step_plan import SequenceStep
from pagedllm.layers.rotary import compute_inv_freq
from pagedllm.model import LlamaForCausalLM, get_model_class, load_model
from pagedllm.worker import CacheEngine, ModelRunner
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

ATOL = 1e-4
NUM_BLOCKS = 160

CASES = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-llama3rope-bias": (
        "llama",
        dict(
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama-linearrope-headdim32": (
        "llama",
        dict(head_dim=32, tie_word_embeddings=True, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}),
    ),
    "qwen2-qkvbias": ("qwen2", dict()),
    "qwen2-sliding-layer1": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1, tie_word_embeddings=True)),
    "mistral-sliding7": ("mistral", dict(sliding_window=7)),
}


class Case:
    def __init__(self, name, hf_model, model, config, path):
        self.name, self.hf, self.model, self.config, self.path = name, hf_model, model, config, path

    def logits(self, what: str, sequences: list[list[int]]) -> list[torch.Tensor]:
        """transformers' logits of `sequences` on this checkpoint, stored as `model_parity.<case>.<what>`."""
        return logits_reference(f"model_parity.{self.name}.{what}", self.path, self.hf, sequences)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    arch, overrides = CASES[request.param]
    config = tiny_config(arch, **overrides)
    hf_model = make_hf_model(config, seed=len(request.param))
    path = save_checkpoint(hf_model, tmp_path_factory.mktemp(request.param))
    model = load_model(str(path), None, config, torch.float32, torch.device("cpu"))
    return Case(request.param, hf_model, model, config, path)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TINY_VOCAB) for _ in range(n)]


def _runner(case: Case, block_size: int) -> ModelRunner:
    return ModelRunner(case.model, case.config, NUM_BLOCKS, block_size, torch.float32, "cpu")


def test_model_class_and_rope_match_transformers(case: Case) -> None:
    assert get_model_class(case.config) is LlamaForCausalLM
    inv_freq, scaling = compute_inv_freq(case.config)
    hf_rotary = case.hf.model.rotary_emb
    assert torch.equal(inv_freq, hf_rotary.inv_freq)
    assert scaling == hf_rotary.attention_scaling


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_full_prefill_batch(case: Case, block_size: int) -> None:
    rng = random.Random(block_size)
    prompts = [_tokens(rng, n) for n in (7, 1, 40, 23, 16)]
    blocks = ToyBlocks(NUM_BLOCKS, block_size, seed=block_size)
    scheduled = [
        table_step(10 + i, p, 0, blocks.ensure(10 + i, len(p)), sample=True, all_logits=True)
        for i, p in enumerate(prompts)
    ]
    out = _runner(case, block_size).execute_model(step_plan(scheduled))

    assert out.sample_logits.shape == (len(prompts), TINY_VOCAB)
    assert out.sample_logits.dtype == torch.float32
    refs = case.logits(f"prefill-bs{block_size}", prompts)
    for i, p in enumerate(prompts):
        ref = refs[i]
        ours = out.all_logits[10 + i]
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.sample_logits[i], ref[-1], atol=ATOL, rtol=0)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


class _Stream:
    """One sequence driven through the runner; records our logits row at every fed position."""

    def __init__(self, seq_id: int, prompt: list[int]) -> None:
        self.seq_id, self.tokens, self.prompt_len = seq_id, list(prompt), len(prompt)
        self.computed = 0
        self.rows: dict[int, torch.Tensor] = {}

    def schedule(self, blocks: ToyBlocks, max_tokens: int) -> SequenceStep:
        n = min(max_tokens, len(self.tokens) - self.computed)
        start = self.computed
        return table_step(self.seq_id, self.tokens[start : start + n],
            start,
            blocks.ensure(self.seq_id, start + n),
            sample=start + n == len(self.tokens),
            all_logits=True,
        )


def _run_step(runner: ModelRunner, blocks: ToyBlocks, plan: list[tuple[_Stream, int]], copies=()) -> None:
    scheduled = [stream.schedule(blocks, n) for stream, n in plan]
    out = runner.execute_model(step_plan(scheduled, list(copies)))
    sample_row = 0
    for (stream, _), s in zip(plan, scheduled):
        for j, row in enumerate(out.all_logits[stream.seq_id]):
            stream.rows[s.start_pos + j] = row
        stream.computed += len(s.token_ids)
        if s.sample:
            logits = out.sample_logits[sample_row]
            sample_row += 1
            assert torch.equal(logits, out.all_logits[stream.seq_id][-1])
            stream.tokens.append(int(logits.argmax()))
    assert sample_row == out.sample_logits.shape[0]


def _fed(stream: _Stream) -> list[int]:
    return stream.tokens[:-1]  # the last sampled token has not been fed yet


def _check_against_hf(stream: _Stream, ref: torch.Tensor) -> float:
    """Our logits at every fed position vs transformers' (`ref`) on the whole sequence; greedy tokens."""
    fed = _fed(stream)
    assert sorted(stream.rows) == list(range(len(fed)))
    ours = torch.stack([stream.rows[p] for p in range(len(fed))])
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    generated = stream.tokens[stream.prompt_len :]
    assert generated == ref[stream.prompt_len - 1 :].argmax(-1).tolist()
    return float((ours - ref).abs().max())


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_chunked_prefill_then_decode_mixed_with_prefill(case: Case, block_size: int) -> None:
    rng = random.Random(100 + block_size)
    runner = _runner(case, block_size)
    blocks = ToyBlocks(NUM_BLOCKS, block_size, seed=7 * block_size)
    a = _Stream(1, _tokens(rng, 22))  # chunks 5,5,5,5,2
    b = _Stream(2, _tokens(rng, 16))  # chunks 5,5,5,1 (a one-token chunk takes the decode path)
    c = _Stream(3, _tokens(rng, 11))  # joins later as a whole prefill next to decodes

    while a.computed < a.prompt_len or b.computed < b.prompt_len:
        plan = [(s, 5) for s in (b, a) if s.computed < s.prompt_len]
        _run_step(runner, blocks, plan)
    for step in range(6):
        plan = [(a, 1), (b, 1)]
        if step == 1:
            plan = [(c, 64)] + plan  # prefill listed before the decodes: runner must reorder
        elif step > 1:
            plan = [(a, 1), (c, 1), (b, 1)]
        _run_step(runner, blocks, plan)

    for stream, ref in zip((a, b, c), case.logits(f"chunked-bs{block_size}", [_fed(s) for s in (a, b, c)])):
        _check_against_hf(stream, ref)
    # transformers' own greedy generation agrees token for token.
    prompt, max_new = a.tokens[: a.prompt_len], len(a.tokens) - a.prompt_len

    @torch.no_grad()
    def generate():
        gen_config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        return case.hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, a.prompt_len, dtype=torch.long),
                                generation_config=gen_config)[0].tolist()

    hf_out = reference(f"model_parity.{case.name}.chunked-bs{block_size}.generate", generate, sources=[case.path],
                       inputs={"prompt": prompt, "max_new_tokens": max_new})
    assert hf_out == a.tokens


def test_prefix_hit_and_copy_on_write_fork(case: Case) -> None:
    block_size = 8
    rng = random.Random(5)
    runner = _runner(case, block_size)
    blocks = ToyBlocks(NUM_BLOCKS, block_size, seed=3)
    a = _Stream(1, _tokens(rng, 20))  # 2 full blocks + 4 tokens
    _run_step(runner, blocks, [(a, 64)])

    # Prefix-cache hit: b's first 16 tokens are a's, found in a's two full blocks.
    b = _Stream(2, a.tokens[:16] + _tokens(rng, 6))
    blocks.share(1, 2, 2)
    b.computed = 16
    # Fork: c continues a's sequence in a's blocks; its partial last block is copied on write.
    c = _Stream(3, list(a.tokens))
    c.computed = a.computed
    c.rows = dict(a.rows)
    blocks.share(1, 3, 3)
    copy = blocks.replace_last(3)
    c.tokens[-1] = (a.tokens[-1] + 1) % TINY_VOCAB  # a different "sample" for the fork

    _run_step(runner, blocks, [(b, 64), (a, 1), (c, 1)], copies=[copy])
    for _ in range(3):
        _run_step(runner, blocks, [(c, 1), (b, 1), (a, 1)])

    b_rows = {p: r for p, r in b.rows.items()}
    b.rows = {p: a.rows[p] for p in range(16)} | b_rows  # the shared prefix was computed by a
    ref_a, ref_b, ref_c = case.logits("prefix-fork", [_fed(a), _fed(b), c.tokens[:-1]])
    for stream, ref in ((a, ref_a), (b, ref_b)):
        _check_against_hf(stream, ref)
    ours_c = torch.stack([c.rows[p] for p in range(len(c.tokens) - 1)])
    torch.testing.assert_close(ours_c, ref_c, atol=ATOL, rtol=0)


def test_empty_and_logits_free_steps(case: Case) -> None:
    runner = _runner(case, 16)
    out = runner.execute_model(step_plan([]))
    assert out.sample_logits.shape == (0, TINY_VOCAB) and out.all_logits == {}
    blocks = ToyBlocks(NUM_BLOCKS, 16)
    s = table_step(1, list(range(10)), 0, blocks.ensure(1, 10), sample=False)
    out = runner.execute_model(step_plan([s]))
    assert out.sample_logits.shape == (0, TINY_VOCAB)
    # The returned logits are ordinary tensors: the sampler may modify them in place.
    s = table_step(1, [3], 10, blocks.ensure(1, 11), sample=True)
    out = runner.execute_model(step_plan([s]))
    out.sample_logits.div_(0.7)


def test_missing_and_unexpected_weights_raise(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    config = tiny_config("llama")
    path = save_checkpoint(make_hf_model(config), tmp_path / "full")
    state = load_file(str(path / "model.safetensors"))
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file({k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.1\.mlp\.gate_up_proj\.weight\[shard 1\]"):
        load_model(str(broken), None, config, torch.float32, "cpu")
    extra = tmp_path / "extra"
    extra.mkdir()
    save_file(state | {"model.layers.0.self_attn.rogue.weight": torch.zeros(2)}, str(extra / "model.safetensors"))
    with pytest.raises(ValueError, match="Unexpected weight 'model.layers.0.self_attn.rogue.weight'"):
        load_model(str(extra), None, config, torch.float32, "cpu")


def test_sharded_checkpoint_loads(tmp_path) -> None:
    config = tiny_config("mistral", sliding_window=None)
    hf_model = make_hf_model(config, seed=3)
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_model(str(tmp_path), None, config, torch.float32, "cpu")
    runner = ModelRunner(model, config, 16, 16, torch.float32, "cpu")
    prompt = list(range(5, 35))
    out = runner.execute_model(
        step_plan([table_step(0, prompt, 0, [3, 9], all_logits=True)])
    )
    ref = logits_reference("model_parity.sharded", tmp_path, hf_model, [prompt])[0]
    torch.testing.assert_close(out.all_logits[0], ref, atol=ATOL, rtol=0)


def test_cache_engine_layout_and_copy_blocks() -> None:
    engine = CacheEngine(num_layers=3, num_kv_heads=2, head_dim=4, num_blocks=6, block_size=8, dtype=torch.float32, device="cpu")
    assert len(engine.kv_caches) == 3
    for k, v in engine.kv_caches:
        assert k.shape == v.shape == (6, 8, 2, 4)
    assert CacheEngine.bytes_per_block(3, 2, 4, 8, torch.float32) == 2 * 3 * 8 * 2 * 4 * 4
    assert CacheEngine.bytes_per_block(30, 3, 64, 16, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    for layer, (k, v) in enumerate(engine.kv_caches):
        for b in range(6):
            k[b].fill_(100 * layer + b)
            v[b].fill_(-(100 * layer + b))
    engine.copy_blocks([(1, 4), (4, 5)])  # sources are read before any destination is written
    for layer, (k, v) in enumerate(engine.kv_caches):
        assert torch.all(k[4] == 100 * layer + 1) and torch.all(v[4] == -(100 * layer + 1))
        assert torch.all(k[5] == 100 * layer + 4) and torch.all(v[5] == -(100 * layer + 4))
        assert torch.all(k[1] == 100 * layer + 1)


def test_bfloat16_model_and_cache(tmp_path) -> None:
    """Half-precision weights and KV cache run the same paths; logits come back float32."""
    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1)
    hf_model = make_hf_model(config, seed=2)
    path = save_checkpoint(hf_model, tmp_path)
    model = load_model(str(path), None, config, torch.bfloat16, "cpu")
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    runner = ModelRunner(model, config, 16, 8, torch.bfloat16, "cpu")
    prompt = list(range(3, 30))
    first = table_step(0, prompt[:20], 0, [4, 0, 9, 2], sample=False, all_logits=True)
    out = runner.execute_model(step_plan([first]))
    rest = table_step(0, prompt[20:], 20, [4, 0, 9, 2], all_logits=True)
    out2 = runner.execute_model(step_plan([rest]))
    ours = torch.cat([out.all_logits[0], out2.all_logits[0]])
    assert ours.dtype == torch.float32 and out2.sample_logits.dtype == torch.float32
    ref = logits_reference("model_parity.bfloat16", path, hf_model, [prompt])[0]
    torch.testing.assert_close(ours, ref, atol=0.1, rtol=0.05)
