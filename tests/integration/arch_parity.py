"""The checks every architecture passes (issue 15), shared by the per-architecture test files.

`build_tiny(config, path)` saves a tiny random checkpoint with transformers' own class
(`from_config` + `save_pretrained`) and a word-level tokenizer of the config's vocabulary;
`check_engine_greedy` runs 4 prompts x 32 greedy tokens through the whole engine (`LLM`) in a
given mode (one-shot prefill, chunked prefill, preemption by recompute / swap) and compares
with transformers' `generate`, token for token; `prefill_logits_max_abs` reports our logits'
largest difference from transformers' on prompt + continuation. With `PAGEDLLM_PARITY_REPORT`
set to a path, every check appends one JSON line there (the closing note's parity table).

transformers' side is stored (tests/references.py): `greedy_reference` / `logits_reference`,
keyed by the checkpoint folder's bytes and the prompts, under `<ref>.greedy`, `<ref>.logits`,
`<ref>.prefix-hit` where `<ref>` names the checkpoint (`module.checkpoint`, the fixture's fourth
item): every engine mode of a checkpoint compares with the one stored greedy reference. A
caller passes `live=True` on one check per model family (see each test module's docstring).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch

from pagedllm.core.kv_cache_groups import hybrid_kv_cache_groups
from tests.integration.model_fixtures import (HFModel, ToyBlocks, hf_model_of, logits_reference, sources_of,
                                              step_plan, table_step)
from tests.references import reference

MAX_TOKENS = 32
# Longer than the tests' sliding windows (8-16) and than one 16-token chunk.
PROMPT_LENGTHS = (5, 19, 37, 53)
BLOCK_SIZE = 8
# Engine modes: LLM keyword arguments. "preempt-*": each request fits alone (53 + 32 tokens =
# 11 blocks of 8), the four together (32 blocks) do not fit in 14.
MODES: dict[str, dict[str, Any]] = {
    "whole-prefill": dict(num_kv_blocks=256, enable_chunked_prefill=False),
    "chunked-prefill": dict(num_kv_blocks=256, enable_chunked_prefill=True, max_num_batched_tokens=16),
    "preempt-recompute": dict(num_kv_blocks=14, preemption_mode="recompute"),
    "preempt-swap": dict(num_kv_blocks=14, preemption_mode="swap", swap_space=0.01),
}


def tiny_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level fast tokenizer `t0 .. t{V-1}` (ids 0-2 are <pad>, <bos>, <eos>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(path)


@torch.no_grad()
def build_tiny(config, path: Path, seed: int = 0, std: float = 0.2):
    """Save a random checkpoint of `config` made by transformers (float32, eager attention) and
    a tokenizer; returns the transformers model. Matrices are drawn with `std` so that greedy
    choices are not near-ties; 1-d weights (norms, biases) are perturbed so loading them is
    tested."""
    from transformers import AutoModelForCausalLM

    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    for name, p in model.named_parameters():
        if p.dim() > 1:
            p.normal_(0.0, std)
        else:
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, config.vocab_size)
    return model


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])
    # No EOS on either side (the engine runs with ignore_eos): neither stopping at it nor
    # masking it (min_new_tokens would mask it on this side only).
    hf_model.generation_config.eos_token_id = None
    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return out[0, len(prompt):].tolist()


def record(arch: str, check: str, ok: bool, **extra: Any) -> None:
    """Append one row of the parity table to `$PAGEDLLM_PARITY_REPORT` (when set)."""
    target = os.environ.get("PAGEDLLM_PARITY_REPORT")
    if target:
        with open(target, "a") as f:
            f.write(json.dumps({"arch": arch, "check": check, "ok": ok} | extra) + "\n")


def greedy_reference(name: str, sources, hf: HFModel, prompts: list[list[int]], max_tokens: int = MAX_TOKENS,
                     live: bool = False, inputs: dict | None = None) -> list[list[int]]:
    """transformers' greedy continuations (`hf_greedy`) of `prompts`, stored as `name`, keyed by
    `sources` (the checkpoint `hf` was saved to or loaded from) and the prompts; `inputs`:
    whatever else the output depends on (a change made to the model after loading)."""
    return reference(name, lambda: [hf_greedy(hf_model_of(hf), p, max_tokens) for p in prompts],
                     sources=sources_of(sources), live=live,
                     inputs={"prompts": prompts, "max_tokens": max_tokens} | (inputs or {}))


def check_engine_greedy(arch: str, path: Path, hf_model, mode: str, ref: str, max_tokens: int = MAX_TOKENS,
                        live: bool = False, source=None, **llm_kwargs: Any) -> list[list[int]]:
    """Greedy output of the whole engine in `mode` equals transformers' `generate` on every
    prompt: the stored reference `<ref>.greedy` of the checkpoint (`source`, default `path`:
    the folder, or the sources, transformers' model was saved to), shared by every mode; `max_tokens` below
    MAX_TOKENS compares that many (slow paths: Triton's interpreter). `hf_model` may be a
    `LazyModel` (its config at hand, the model built only to compute the reference)."""
    from pagedllm import LLM, SamplingParams

    config = hf_model.config
    prompts = tiny_prompts(config.vocab_size)
    kwargs = dict(block_size=BLOCK_SIZE, enable_prefix_caching=False) | MODES[mode] | llm_kwargs
    groups = hybrid_kv_cache_groups(config, kwargs.get("disable_hybrid_kv_cache_manager", False))
    if groups is not None:  # a block holds `slots` layers, not all: the same bytes of cache
        kwargs["num_kv_blocks"] = -(-kwargs["num_kv_blocks"] * groups.num_layers // groups.slots)
        if mode.startswith("preempt") and all(g.is_sliding for g in groups.groups):
            # Windows only: 14 blocks hold all four decoding at once. Prefill in chunks of 16
            # and give the pool the longest one's peak alone, so that they do not.
            kwargs |= dict(enable_chunked_prefill=True, max_num_batched_tokens=16)
            kwargs["num_kv_blocks"] = groups.peak_blocks(max(PROMPT_LENGTHS) + MAX_TOKENS, BLOCK_SIZE, 16) + 1
    llm = LLM(str(path), **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        stats = llm.kv_cache_stats()
    finally:
        llm.shutdown()
    ours = [o.outputs[0].token_ids for o in outs]
    references = greedy_reference(f"{ref}.greedy", path if source is None else source, hf_model, prompts, live=live)
    theirs = [r[:max_tokens] for r in references]
    ok = ours == theirs
    record(arch, mode, ok, preemptions=stats.num_preemptions)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"{arch} [{mode}] prompt {i} ({len(prompts[i])} tokens): ours {a} != transformers {b}"
    assert len({t for seq in ours for t in seq}) > 3, f"{arch}: degenerate output {ours}"
    if mode.startswith("preempt"):
        assert stats.num_preemptions > 0, f"{arch} [{mode}]: no preemption happened"
        if mode == "preempt-swap":
            assert stats.num_swapped_out > 0
    assert stats.used_blocks == 0
    if groups is not None:  # its sliding layers kept only their window (docs/hybrid_kv_cache.md)
        assert stats.num_kv_cache_groups == len(groups.groups) and stats.sliding_blocks_freed > 0, stats
    return ours


def check_prefix_hits_greedy(arch: str, path: Path, hf_model, ref: str, live: bool = False, **llm_kwargs: Any) -> None:
    """The same prompts twice with prefix caching, the second time grown by 5 generated tokens:
    the second pass hits (with a sliding window: in every group, each window's blocks only)
    and still equals transformers' `generate` on the longer prompts (stored as
    `<ref>.prefix-hit`, keyed by those prompts: our first pass's tokens are part of them)."""
    from pagedllm import LLM, SamplingParams

    prompts = tiny_prompts(hf_model.config.vocab_size)
    llm = LLM(str(path), block_size=BLOCK_SIZE, enable_prefix_caching=True, num_kv_blocks=512, **llm_kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        longer = [p + o.outputs[0].token_ids[:5] for p, o in zip(prompts, first)]
        second = llm.generate([{"prompt_token_ids": p} for p in longer], params, use_tqdm=False)
        stats = llm.kv_cache_stats()
    finally:
        llm.shutdown()
    ours = [o.outputs[0].token_ids for o in second]
    theirs = greedy_reference(f"{ref}.prefix-hit", path, hf_model, longer, live=live)
    record(arch, "prefix-hit", ours == theirs, hit_tokens=stats.prefix_cache_hits)
    assert stats.prefix_cache_hits > 0, stats
    groups = hybrid_kv_cache_groups(hf_model.config, llm_kwargs.get("disable_hybrid_kv_cache_manager", False))
    assert stats.num_kv_cache_groups == (1 if groups is None else len(groups.groups)), stats
    for p, a, b in zip(longer, ours, theirs):
        assert a == b, f"{arch} [prefix-hit] {len(p)} tokens: ours {a} != transformers {b}"


@torch.no_grad()
def our_prefill_logits(path: Path, config, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Our float32 logits `[len, vocab]` of each sequence: one batched prefill over shuffled
    blocks, through the real loader and ModelRunner."""
    from pagedllm.model import load_model
    from pagedllm.worker import ModelRunner

    model = load_model(str(path), None, config, torch.float32, torch.device("cpu"))
    blocks = ToyBlocks(256, BLOCK_SIZE, seed=1)
    scheduled = [table_step(i, s, 0, blocks.ensure(i, len(s)), all_logits=True)
                 for i, s in enumerate(sequences)]
    out = ModelRunner(model, config, 256, BLOCK_SIZE, torch.float32, "cpu").execute_model(step_plan(scheduled))
    return [out.all_logits[i] for i in range(len(sequences))]


@torch.no_grad()
def prefill_logits_max_abs(arch: str, path: Path, hf_model, sequences: list[list[int]], ref: str,
                           atol: float = 1e-4) -> float:
    """`our_prefill_logits` vs transformers' logits (stored as `<ref>.logits`); asserts `atol`,
    records and returns the max."""
    ours = our_prefill_logits(path, hf_model.config, sequences)
    worst = 0.0
    for logits, theirs in zip(ours, logits_reference(f"{ref}.logits", path, hf_model, sequences)):
        worst = max(worst, float((logits - theirs).abs().max()))
    record(arch, "logits", worst <= atol, max_abs=worst)
    assert worst <= atol, f"{arch}: logits differ from transformers by {worst:.3g} (> {atol})"
    return worst


def reference_prefix(request, checkpoint: str) -> str:
    """`module.checkpoint`: the stored references' names of a tiny checkpoint (`<prefix>.greedy`,
    `.logits`, `.prefix-hit`), `module` the test module's name without `test_`."""
    return f"{request.module.__name__.rsplit('.', 1)[-1].removeprefix('test_')}.{checkpoint}"


class LazyModel:
    """A transformers model's config at hand, the model itself loaded (once) only when called,
    i.e. only when a reference is computed: for references of a checkpoint that the test does
    not otherwise need transformers' model of."""

    def __init__(self, config, load) -> None:
        self.config, self._load, self._model = config, load, None

    def __call__(self):
        if self._model is None:
            self._model = self._load()
        return self._model


def tiny_checkpoint_fixture(configs: dict[str, dict[str, Any]], make_config):
    """A module-scoped pytest fixture over `configs` (name -> `make_config` keyword arguments):
    `(name, path, transformers model, reference prefix)` of each tiny checkpoint (the prefix:
    `reference_prefix`)."""
    import pytest

    @pytest.fixture(scope="module", params=list(configs))
    def tiny(request, tmp_path_factory):
        path = tmp_path_factory.mktemp(request.param)
        hf = build_tiny(make_config(**configs[request.param]), path, seed=len(request.param))
        return request.param, path, hf, reference_prefix(request, request.param)

    return tiny


def parity_table(report_path: str) -> str:
    """The markdown table (architecture x check) of a `$PAGEDLLM_PARITY_REPORT` file."""
    rows: dict[str, dict[str, str]] = {}
    checks: list[str] = []
    with open(report_path) as f:
        for line in f:
            r = json.loads(line)
            if r["check"] not in checks:
                checks.append(r["check"])
            cell = "equal" if r["ok"] else "DIFFERS"
            if r["check"] == "logits":
                cell = f"{r['max_abs']:.2g}" + ("" if r["ok"] else " (over)")
            elif r.get("preemptions"):
                cell += f" ({r['preemptions']} preemptions)"
            rows.setdefault(r["arch"], {})[r["check"]] = cell
    head = "| architecture | " + " | ".join(c if c != "logits" else "logits max-abs" for c in checks) + " |"
    lines = [head, "|" + "---|" * (len(checks) + 1)]
    for arch, cells in rows.items():
        lines.append(f"| {arch} | " + " | ".join(cells.get(c, "-") for c in checks) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m tests.integration.arch_parity REPORT.jsonl
    import sys

    print(parity_table(sys.argv[1]))
