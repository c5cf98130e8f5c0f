"""Helpers for the model-side integration tests: tiny random transformers checkpoints, step plans
(`ModelRunner.execute_model`'s contract, core/step_plan.py) that rewrite whole block tables, a
toy block allocator that hands out shuffled, non-contiguous block ids, and transformers' logits
as stored references (`logits_reference`, tests/references.py)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Union

import torch

from pagedllm.core.step_plan import SequenceStep, StepPlan
from tests.references import reference
from tests.smollm2 import hf_tokenizer

# transformers' model, or a zero-argument callable that builds it: called only when a reference
# is computed (written, or checked live), so that a run on the stored references never builds it.
HFModel = Union[torch.nn.Module, Callable[[], torch.nn.Module]]

TINY_VOCAB = 256


def table_step(seq_id: int, token_ids: list[int], start_pos: int, block_table: list[int], sample: bool = True,
               all_logits: bool = False) -> SequenceStep:
    """A sequence's part of a step that rewrites its whole block table (a delta from block 0)."""
    return SequenceStep(seq_id, list(token_ids), start_pos, 0, list(block_table), sample, all_logits)


def step_plan(steps: list[SequenceStep], block_copies: list[tuple[int, int]] = ()) -> StepPlan:
    return StepPlan(steps, sum(len(s.token_ids) for s in steps), list(block_copies))


class ToyBlocks:
    """Per-sequence block tables drawn from a shuffled pool, so block ids are non-contiguous."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow `seq_id`'s table to cover `num_tokens` positions; returns a copy of the table."""
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return list(table)

    def share(self, src_seq: int, dst_seq: int, num_blocks: int) -> None:
        """`dst_seq` starts with the first `num_blocks` blocks of `src_seq` (prefix hit / fork)."""
        self.tables[dst_seq] = list(self.tables[src_seq][:num_blocks])

    def replace_last(self, seq_id: int) -> tuple[int, int]:
        """Copy-on-write: give `seq_id` a fresh last block; returns the (src, dst) copy."""
        table = self.tables[seq_id]
        new = self.free.pop()
        src, table[-1] = table[-1], new
        return src, new


def tiny_config(arch: str, **overrides: Any):
    """A small transformers config of the given family (2 layers, hidden 64, GQA 4/2)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # peaked enough that greedy choices are not near-ties
        tie_word_embeddings=False,
    )
    common.update(overrides)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    return cls(**common)


def make_hf_model(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # Norm weights are initialised to ones; perturb them so that loading them is tested.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def save_checkpoint(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits `[len, vocab]` for one unpadded sequence."""
    return model(torch.tensor([token_ids])).logits[0].float()


def hf_model_of(hf: HFModel) -> torch.nn.Module:
    return hf if isinstance(hf, torch.nn.Module) else hf()


def float32_lists(t: torch.Tensor) -> Any:
    """`t`'s float32 values as nested Python floats, exactly: tests/references.py stores such
    arrays packed, 4 bytes a value."""
    return t.float().tolist()


# JSON fields that name the folder a tool read its input from (a temporary folder each run):
# `pagedllm quantize` writes transformers' `_name_or_path`, peft its base model's path.
LOCAL_PATH_FIELDS = ("_name_or_path", "base_model_name_or_path")


def checkpoint_sources(folder: str | os.PathLike) -> list:
    """A folder written by a tool that records where its input was (`pagedllm quantize`, peft's
    `save_pretrained`), as a reference's sources: its files, JSON ones without
    `LOCAL_PATH_FIELDS` and with peft's `target_modules` (a set, saved in hash order) sorted;
    no README.md (peft's model card, naming the base's folder)."""
    root = Path(folder)
    out: list = []
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name == "README.md":
            continue
        if p.suffix != ".json":
            out.append(p)
            continue
        data = json.loads(p.read_text())
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in LOCAL_PATH_FIELDS}
            if isinstance(data.get("target_modules"), list):
                data["target_modules"] = sorted(data["target_modules"])
        out.append(str(p.relative_to(root)).encode() + b"\0" + json.dumps(data, sort_keys=True).encode())
    return out


def sources_of(sources: str | os.PathLike | bytes | Iterable) -> list:
    return [sources] if isinstance(sources, (str, os.PathLike, bytes)) else list(sources)


def logits_reference(name: str, sources, hf: HFModel, sequences: list[list[int]], *, live: bool = False,
                     inputs: dict | None = None) -> list[torch.Tensor]:
    """transformers' float32 logits `[len, vocab]` (`hf_logits`) of each of `sequences`, stored as
    `name`, keyed by `sources` (the checkpoint `hf` was saved to or loaded from: folder or
    files) and the sequences (`inputs`: whatever else the model depends on, e.g. a change made
    to it after loading)."""
    value = reference(name, lambda: [float32_lists(hf_logits(hf_model_of(hf), s)) for s in sequences],
                      sources=sources_of(sources), inputs={"sequences": sequences} | (inputs or {}), live=live)
    return [torch.tensor(v, dtype=torch.float32) for v in value]


def save_tiny_llama(path: Path, smollm2_gguf: str):
    """A tiny random Llama (SmolLM2's tokenizer, hidden 64, 2 layers, GQA 4/2, weights N(0, 0.2))
    saved with its tokenizer to `path`; transformers' float32 model."""
    import transformers as tf

    tok = hf_tokenizer(smollm2_gguf)
    config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                            tie_word_embeddings=False)
    torch.manual_seed(1234)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model

