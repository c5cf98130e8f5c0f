"""Greedy output of the engine on SmolLM2 equals transformers' `generate` token for token.

transformers' side is stored (tests/references.py); the chat test computes it live every run,
the Llama family's check that the store has not drifted from transformers."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from tests.integration.prompts import CHAT, PROMPTS
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

MAX_NEW = 48


def hf_greedy(model, input_ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([input_ids]), attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
            max_new_tokens=max_new, do_sample=False, pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(input_ids):].tolist()


def hf_greedy_reference(name: str, request, gguf: str, prompts: list[list[int]], max_new: int,
                        live: bool = False) -> list[list[int]]:
    """transformers' greedy continuations of `prompts` on SmolLM2 (the GGUF at `gguf`), stored."""
    return reference(name, lambda: [hf_greedy(request.getfixturevalue("hf_smollm2"), p, max_new) for p in prompts],
                     sources=[gguf], inputs={"prompts": prompts, "max_new": max_new}, live=live)


def test_greedy_matches_transformers(smollm2_llm, smollm2_gguf, request):
    tok = smollm2_llm.get_tokenizer()
    chat_text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    prompt_ids.append(tok.encode(chat_text, add_special_tokens=False))
    assert max(len(p) for p in prompt_ids) > 300, "one prompt must be over 300 tokens"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = smollm2_llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                                use_tqdm=False)
    refs = hf_greedy_reference("engine_parity.greedy", request, smollm2_gguf, prompt_ids, MAX_NEW)
    mismatches = []
    for ids, out, ref in zip(prompt_ids, outs, refs):
        ours = out.outputs[0].token_ids
        if ours != ref:
            mismatches.append((tok.decode(ids[-20:]), ours, ref))
    assert not mismatches, f"{len(mismatches)}/{len(prompt_ids)} differ: {mismatches}"


def test_chat_api_matches_transformers(smollm2_llm, smollm2_gguf, request):
    tok = smollm2_llm.get_tokenizer()
    out = smollm2_llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                           use_tqdm=False)[0]
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert out.prompt_token_ids == list(ids)
    ref = hf_greedy_reference("engine_parity.chat", request, smollm2_gguf, [list(ids)], MAX_NEW, live=True)
    assert out.outputs[0].token_ids == ref[0]
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
