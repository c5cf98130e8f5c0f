"""The offline API on SmolLM2: prompt forms, sampling features, stops, rejections, stats."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_prompt_forms_and_order(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    prompts = ["The sky is", "Paris is the capital of"]
    by_text = smollm2_llm.generate(prompts, GREEDY, use_tqdm=False)
    by_ids = smollm2_llm.generate([{"prompt_token_ids": tok.encode(p)} for p in prompts], GREEDY,
                                  use_tqdm=False)
    single = smollm2_llm.generate(prompts[1], GREEDY, use_tqdm=False)
    assert [o.prompt for o in by_text] == prompts
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    assert single[0].outputs[0].text == by_text[1].outputs[0].text
    out = by_text[0]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 24
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert out.metrics.num_prompt_tokens == len(out.prompt_token_ids)
    assert out.metrics.first_token_time >= out.metrics.arrival_time


def test_per_prompt_params_and_mismatch(smollm2_llm):
    outs = smollm2_llm.generate(["a", "b"], [SamplingParams(max_tokens=3, ignore_eos=True),
                                             SamplingParams(max_tokens=5, ignore_eos=True)],
                                use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        smollm2_llm.generate(["a", "b", "c"], [SamplingParams()] * 2, use_tqdm=False)


def test_stop_string_spanning_tokens(smollm2_llm):
    ref = smollm2_llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    tok = smollm2_llm.get_tokenizer()
    pieces = [tok.decode(ref.token_ids[: i + 1]) for i in range(len(ref.token_ids))]
    # a stop string made of the end of token 5 and the start of token 6
    cut = len(pieces[4])
    stop = ref.text[cut - 2: cut + 2]
    assert len(stop) == 4 and stop.strip()
    out = smollm2_llm.generate("Once upon a time",
                               SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    first = ref.text.find(stop)
    assert out.text == ref.text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    incl = smollm2_llm.generate("Once upon a time",
                                SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                               include_stop_str_in_output=True),
                                use_tqdm=False)[0].outputs[0]
    assert incl.text == ref.text[: first + len(stop)]


def test_stop_token_ids_and_min_tokens(smollm2_llm):
    ref = smollm2_llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = ref.token_ids[3]
    first = ref.token_ids.index(stop_id)
    out = smollm2_llm.generate("Once upon a time",
                               SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
                               use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    later = smollm2_llm.generate("Once upon a time",
                                 SamplingParams(temperature=0.0, max_tokens=24, min_tokens=first + 2,
                                                stop_token_ids=[stop_id]),
                                 use_tqdm=False)[0].outputs[0]
    assert len(later.token_ids) >= first + 2
    assert stop_id not in later.token_ids[: first + 2 - 1] or later.token_ids[-1] == stop_id


def test_seeded_sampling_reproducible_in_any_batch(smollm2_llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=20, seed=7,
                            ignore_eos=True)
    alone = smollm2_llm.generate("My favourite animal is", params, use_tqdm=False)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 5
    batch = smollm2_llm.generate(["Tell me a story"] * 5 + ["My favourite animal is"],
                                 others + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=20, seed=8,
                           ignore_eos=True)
    other_seed = smollm2_llm.generate("My favourite animal is", other, use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_parallel_samples(smollm2_llm):
    greedy = smollm2_llm.generate("The weather today", SamplingParams(
        n=4, temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in greedy.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    p = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=3, ignore_eos=True)
    a = smollm2_llm.generate("The weather today", p, use_tqdm=False)[0]
    b = smollm2_llm.generate("The weather today", p, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    assert smollm2_llm.kv_cache_stats().used_blocks == 0


def test_logprobs(smollm2_llm):
    out = smollm2_llm.generate("The sky is", SamplingParams(
        temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    for tid, pos in zip(c.token_ids, c.logprobs):
        assert tid in pos and 3 <= len(pos) <= 4
        assert all(lp.logprob <= 0 for lp in pos.values())
        assert pos[tid].logprob == max(lp.logprob for lp in pos.values())  # greedy = top-1
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in
                                                     zip(c.token_ids, c.logprobs)), abs=1e-4)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tid, pos in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tid in pos and len(pos) >= 2


def test_multibyte_text(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    outs = smollm2_llm.generate(["Emoji: 😀🎉🚀 and Chinese 你好世界,", "日本語のテキスト:"],
                                SamplingParams(temperature=0.8, seed=1, max_tokens=24,
                                               ignore_eos=True), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        # A character cut off by max_tokens is left out rather than shown as U+FFFD.
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True).rstrip("\ufffd")
        assert "\ufffd" not in c.text


def test_rejections_leave_engine_clean(smollm2_llm):
    engine = smollm2_llm.llm_engine
    long_prompt = "word " * 2100
    with pytest.raises(ValueError, match=r"maximum context length is 2048 tokens.*\d+ in the "
                                         r"messages, 16 in the completion"):
        smollm2_llm.generate(long_prompt, SamplingParams(max_tokens=16), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="empty"):
        smollm2_llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        smollm2_llm.generate({"prompt_token_ids": [1, 10**7]}, use_tqdm=False)
    # A batch with one bad request is rejected whole, and nothing stays queued.
    with pytest.raises(ValueError):
        smollm2_llm.generate(["fine", long_prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert smollm2_llm.generate("ok", SamplingParams(max_tokens=2, ignore_eos=True),
                                use_tqdm=False)[0].finished
    assert smollm2_llm.kv_cache_stats().used_blocks == 0


def test_request_larger_than_pool_is_rejected(smollm2_gguf):
    from pagedllm import LLM

    llm = LLM(smollm2_gguf, num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match=r"needs 5 KV cache blocks .* pool has 4 blocks"):
        llm.generate({"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=10), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1] * 40}, SamplingParams(max_tokens=10,
                                                                      ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10


def test_abort_frees_blocks(smollm2_llm):
    engine = smollm2_llm.llm_engine
    engine.add_request("abort-me", "Count to one hundred:", SamplingParams(max_tokens=200,
                                                                           ignore_eos=True))
    engine.add_request("keep-me", "Hello", SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert smollm2_llm.kv_cache_stats().used_blocks > 0
    engine.abort_request("abort-me")
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["keep-me"]
    assert smollm2_llm.kv_cache_stats().used_blocks == 0


def test_kv_cache_stats(smollm2_llm):
    smollm2_llm.llm_engine.reset_kv_cache_peak()
    smollm2_llm.generate(["a b c d e f g h"] * 4, SamplingParams(max_tokens=40, ignore_eos=True),
                         use_tqdm=False)
    s = smollm2_llm.kv_cache_stats()
    assert s.used_blocks == 0 and s.tokens_stored == 0
    assert s.peak_used_blocks > 0 and s.peak_tokens_stored > 0
    assert 0.0 <= s.waste_at_peak < 1.0
    assert s.peak_tokens_stored <= s.peak_used_blocks * s.block_size


def test_out_of_vocab_ids_in_params_are_rejected(smollm2_llm):
    with pytest.raises(ValueError, match="out-of-vocab"):
        smollm2_llm.generate("hi", SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}),
                             use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        smollm2_llm.generate("hi", SamplingParams(max_tokens=2, stop_token_ids=[10**6]),
                             use_tqdm=False)
    assert smollm2_llm.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True),
                                use_tqdm=False)[0].finished
