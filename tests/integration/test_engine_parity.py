"""Greedy output of the engine on SmolLM2 equals transformers' `generate` token for token."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from tests.integration.prompts import CHAT, PROMPTS

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

MAX_NEW = 48


def hf_greedy(model, input_ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([input_ids]), attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
            max_new_tokens=max_new, do_sample=False, pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(input_ids):].tolist()


def test_greedy_matches_transformers(smollm2_llm, hf_smollm2):
    tok = smollm2_llm.get_tokenizer()
    chat_text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    prompt_ids.append(tok.encode(chat_text, add_special_tokens=False))
    assert max(len(p) for p in prompt_ids) > 300, "one prompt must be over 300 tokens"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = smollm2_llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                                use_tqdm=False)
    mismatches = []
    for ids, out in zip(prompt_ids, outs):
        ours = out.outputs[0].token_ids
        ref = hf_greedy(hf_smollm2, ids, MAX_NEW)
        if ours != ref:
            mismatches.append((tok.decode(ids[-20:]), ours, ref))
    assert not mismatches, f"{len(mismatches)}/{len(prompt_ids)} differ: {mismatches}"


def test_chat_api_matches_transformers(smollm2_llm, hf_smollm2):
    tok = smollm2_llm.get_tokenizer()
    out = smollm2_llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                           use_tqdm=False)[0]
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert out.prompt_token_ids == list(ids)
    assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, list(ids), MAX_NEW)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
