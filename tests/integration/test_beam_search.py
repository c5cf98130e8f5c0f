"""Beam search on SmolLM2 equals transformers' `generate(num_beams=...)`, and its beams share
KV blocks (fork, copy-on-write, dropped beams freed).

transformers' beams are stored (tests/references.py); the Llama family's live check is
test_engine_parity.py::test_chat_api_matches_transformers."""

from __future__ import annotations

import pytest
import torch

from pagedllm import BeamSearchParams, SamplingParams
from tests.integration.prompts import PROMPTS
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

WIDTH, MAX_TOKENS = 4, 20
# (length_penalty, early_stopping) for prompt i: SETTINGS[i % 4].
SETTINGS = [(1.0, False), (0.6, True), (2.0, "never"), (1.0, True)]


def hf_beams(hf_model, prompt_ids, eos_ids, length_penalty, early_stopping):
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        seqs = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=WIDTH,
            num_return_sequences=WIDTH, max_new_tokens=MAX_TOKENS, length_penalty=length_penalty,
            early_stopping=early_stopping, eos_token_id=eos_ids, pad_token_id=eos_ids[0],
        )
    beams = []
    for row in seqs[:, len(prompt_ids):].tolist():  # finished beams are padded with EOS
        beams.append(row[: row.index(eos_ids[0]) + 1] if eos_ids[0] in row else row)
    return beams


def test_beam_search_equals_transformers(smollm2_llm, smollm2_gguf, request):
    eos = sorted(smollm2_llm.llm_engine.eos_token_ids)
    ours: dict[int, list[list[int]]] = {}
    for k, (lp, es) in enumerate(SETTINGS):
        idx = list(range(k, len(PROMPTS), len(SETTINGS)))
        params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, length_penalty=lp,
                                  early_stopping=es)
        outs = smollm2_llm.beam_search([PROMPTS[i] for i in idx], params, use_tqdm=False)
        for i, out in zip(idx, outs):
            assert len(out.outputs) == WIDTH and out.finished
            ours[i] = [c.token_ids for c in out.outputs]
            ours[-1 - i] = out.prompt_token_ids
    prompt_ids = [ours[-1 - i] for i in range(len(PROMPTS))]
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(len(PROMPTS))]
    refs = reference(
        "beam_search.beams",
        lambda: [hf_beams(request.getfixturevalue("hf_smollm2"), ids, eos, lp, es)
                 for ids, (lp, es) in zip(prompt_ids, settings)],
        sources=[smollm2_gguf], libs=("transformers", "gguf"),
        inputs={"prompts": prompt_ids, "eos": eos, "settings": settings, "width": WIDTH, "max_tokens": MAX_TOKENS})
    best_equal = all_equal = 0
    for i, ref in enumerate(refs):
        best_equal += ours[i][0] == ref[0]
        all_equal += ours[i] == ref
    assert best_equal >= 7, (best_equal, all_equal)
    assert all_equal >= 6, (best_equal, all_equal)
    assert smollm2_llm.kv_cache_stats().used_blocks == 0


def test_beams_share_blocks_and_free_them(smollm2_llm):
    assert smollm2_llm.reset_prefix_cache()
    smollm2_llm.llm_engine.reset_kv_cache_peak()
    out = smollm2_llm.beam_search(PROMPTS[-1], BeamSearchParams(beam_width=4, max_tokens=24,
                                                                ignore_eos=True),
                                  use_tqdm=False)[0]
    stats = smollm2_llm.kv_cache_stats()
    prompt_blocks = len(out.prompt_token_ids) // 16  # 32 full blocks, shared by every beam
    assert stats.peak_shared_blocks >= prompt_blocks
    # Unshared, 4 beams of 524 + 24 tokens would hold 4 * 35 blocks.
    assert stats.peak_used_blocks <= prompt_blocks + 4 * 3 < 4 * 35
    assert stats.used_blocks == 0 and stats.shared_blocks == 0
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for c in out.outputs)
    scores = [c.cumulative_logprob / 24 for c in out.outputs]
    assert scores == sorted(scores, reverse=True)


def test_use_beam_search_in_sampling_params_equals_beam_search(smollm2_llm):
    via_sampling = smollm2_llm.generate(
        PROMPTS[:3], SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=12),
        use_tqdm=False)
    via_beam = smollm2_llm.beam_search(PROMPTS[:3], BeamSearchParams(beam_width=3, max_tokens=12),
                                       use_tqdm=False)
    for a, b in zip(via_sampling, via_beam):
        assert [(c.token_ids, c.text, c.finish_reason) for c in a.outputs] == [
            (c.token_ids, c.text, c.finish_reason) for c in b.outputs]
    eos_ended = [c for o in via_beam for c in o.outputs if c.finish_reason == "stop"]
    assert all(c.stop_reason is None for c in eos_ended)  # EOS: no stop_reason, no EOS text


def test_beam_search_rejections(smollm2_llm):
    with pytest.raises(ValueError, match="top_k is not supported with beam search"):
        smollm2_llm.generate("hi", SamplingParams(n=2, use_beam_search=True, top_k=5),
                             use_tqdm=False)
    with pytest.raises(ValueError, match="Beam search with width 16 needs up to"):
        smollm2_llm.beam_search("hi", BeamSearchParams(beam_width=16, max_tokens=2000),
                                use_tqdm=False)
    with pytest.raises(ValueError, match="early_stopping must be"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    assert smollm2_llm.kv_cache_stats().used_blocks == 0


def test_abort_mid_search_frees_every_beam(smollm2_llm):
    engine = smollm2_llm.llm_engine
    engine.add_request("beam-abort", PROMPTS[-1], BeamSearchParams(beam_width=4, max_tokens=30))
    for _ in range(4):  # prefill, then a few beam steps: 4 beams sharing the prompt's blocks
        assert engine.step() == []  # a beam search reports only when it is done
    running = engine.requests["beam-abort"].seqs
    assert len(running) == 4 and engine.kv_cache_manager.num_shared_blocks >= 32
    engine.abort_request("beam-abort")
    assert not engine.has_unfinished_requests() and all(s.is_finished for s in running)
    assert smollm2_llm.kv_cache_stats().used_blocks == 0
    engine.kv_cache_manager.check_invariants([])
