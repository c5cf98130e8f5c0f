"""Tiny Llama checkpoints with LoRA adapters made by peft itself (the reference), for the LoRA
integration and server tests; peft's (and transformers') outputs on them as stored references
(`lora_reference`, tests/references.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.integration.model_fixtures import checkpoint_sources, float32_lists, save_tiny_llama
from tests.references import reference
from tests.smollm2 import hf_tokenizer

# name -> peft LoraConfig keywords: random A and B (init_lora_weights=False), so every adapter
# changes the output; ranks, scalings (rsLoRA) and target sets differ.
ADAPTERS = {
    "all7": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]),
    "qv_rs": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp16": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"]),
}


@dataclass
class TinyLoRA:
    base: Path  # the base checkpoint folder (with the SmolLM2 tokenizer)
    adapters: dict[str, Path]  # name -> PEFT folder
    hf_base: object  # transformers' float32 model of `base`


def tokenizer(smollm2_gguf: str):
    return hf_tokenizer(smollm2_gguf)


def make_tiny_lora(root: Path, smollm2_gguf: str) -> TinyLoRA:
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    base = root / "base"
    model = save_tiny_llama(base, smollm2_gguf)
    adapters = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        fresh = tf.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = get_peft_model(fresh, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kw))
        with torch.no_grad():  # B large enough that each adapter visibly changes greedy output
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.3)
        adapters[name] = root / name
        peft_model.save_pretrained(adapters[name])
    return TinyLoRA(base, adapters, model)


def peft_model(tiny: TinyLoRA, name: str):
    """peft's PeftModel of adapter `name` over a fresh copy of the base (float32, eval)."""
    import transformers as tf
    from peft import PeftModel

    base = tf.LlamaForCausalLM.from_pretrained(tiny.base, dtype=torch.float32)
    return PeftModel.from_pretrained(base, tiny.adapters[name]).eval()


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The float32 model's argmax continuation, EOS not special (the engine runs with ignore_eos)."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@torch.no_grad()
def prompt_logprobs(model, prompt_ids: list[int]) -> torch.Tensor:
    """log p(prompt[i] | prompt[:i]) for i >= 1, float32."""
    logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1))[:, 0]


def adapter_sources(folder: Path) -> list:
    """An adapter folder as a reference's sources: its weights and its config, less the base
    folder's path (another one each run) and with `target_modules` in a fixed order."""
    return checkpoint_sources(folder)


def lora_reference(name: str, tiny: TinyLoRA, adapter: str | None, prompts: list[list[int]], max_tokens: int,
                   logprobs: bool = False, live: bool = False) -> dict:
    """peft's PeftModel of `adapter` (None: transformers' base model) on `prompts`, stored as
    `name`: {"greedy": tokens per prompt} and, with `logprobs`, {"prompt_logprobs": per prompt}."""
    def compute():
        model = tiny.hf_base if adapter is None else peft_model(tiny, adapter)
        out = {"greedy": [greedy(model, p, max_tokens) for p in prompts]}
        if logprobs:
            out["prompt_logprobs"] = [float32_lists(prompt_logprobs(model, p)) for p in prompts]
        return out

    sources = [tiny.base] + ([] if adapter is None else adapter_sources(tiny.adapters[adapter]))
    return reference(name, compute, sources=sources, live=live,
                     libs=("transformers",) if adapter is None else ("transformers", "peft"),
                     inputs={"adapter": adapter, "prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs})
