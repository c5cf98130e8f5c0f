"""The offline LLM's side of issue 14's request fields: priority scheduling
(`LLM.generate(..., priority=[...])`), generation_config.json defaults (vLLM's
`generation_config` engine arg: auto / vllm / a folder) and the `max_logprobs` limit. A tiny
random Llama checkpoint with SmolLM2's tokenizer: real engine, no big model."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from tests.integration.test_tiny_models import _save_tiny, _tokenizer

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

GEN_CONFIG = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.01,
              "repetition_penalty": 1.1, "max_new_tokens": 3}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_gguf):
    path = tmp_path_factory.mktemp("tiny-llama")
    _save_tiny("llama", path, _tokenizer(smollm2_gguf))
    cfg = json.loads((path / "generation_config.json").read_text())
    cfg.update(GEN_CONFIG)
    (path / "generation_config.json").write_text(json.dumps(cfg))
    return path


def _llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), kv_cache_space=0.05, block_size=8, **kwargs)


def test_generation_config_auto_vllm_and_folder(tiny_folder, tmp_path):
    auto = _llm(tiny_folder)
    d = auto.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.repetition_penalty, d.max_tokens) == \
        (0.7, 5, 0.9, 0.01, 1.1, 3)
    outs = auto.generate(["Hello there", "The quick brown fox"], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) <= 3 for o in outs)
    auto.shutdown()

    plain = _llm(tiny_folder, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    plain.shutdown()

    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    from_folder = _llm(tiny_folder, generation_config=str(other))
    assert from_folder.get_default_sampling_params().temperature == 0.5
    assert from_folder.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
    from_folder.shutdown()

    with pytest.raises(ValueError, match="generation_config"):
        _llm(tiny_folder, generation_config=str(tmp_path / "missing"))


def test_priority_orders_the_offline_batch(tiny_folder):
    llm = _llm(tiny_folder, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = ["one two", "three four", "five six", "seven eight"]
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[3, 0, 2, 1])
    finish_order = sorted(range(4), key=lambda i: outs[i].metrics.finished_time)
    assert finish_order == [1, 3, 2, 0]
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(prompts, params, use_tqdm=False, priority=[1])
    llm.shutdown()


def test_fcfs_refuses_a_priority_and_max_logprobs_limits(tiny_folder):
    llm = _llm(tiny_folder)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm.generate(["hi"], SamplingParams(max_tokens=1), use_tqdm=False, priority=[2])
    with pytest.raises(ValueError, match="max-logprobs"):
        llm.generate(["hi"], SamplingParams(max_tokens=1, logprobs=21), use_tqdm=False)
    out = llm.generate(["hi"], SamplingParams(max_tokens=1, logprobs=20), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 20
    llm.shutdown()

    wide = _llm(tiny_folder, max_logprobs=-1)
    vocab = wide.llm_engine.core.vocab_size
    out = wide.generate(["hello there my friend"],
                        SamplingParams(max_tokens=1, logprobs=vocab, prompt_logprobs=3),
                        use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) == vocab
    assert len(out[0].prompt_logprobs[1]) >= 3
    wide.shutdown()


def test_best_of_keeps_the_most_likely_samples(tiny_folder):
    llm = _llm(tiny_folder)
    kw = dict(temperature=1.0, max_tokens=5, seed=7, ignore_eos=True)
    all3 = llm.generate(["a b c"], SamplingParams(n=3, logprobs=0, **kw), use_tqdm=False)[0]
    best = llm.generate(["a b c"], SamplingParams(n=1, best_of=3, **kw), use_tqdm=False)[0]
    top = max(all3.outputs, key=lambda c: c.cumulative_logprob)
    assert len(best.outputs) == 1 and best.outputs[0].token_ids == top.token_ids
    assert best.outputs[0].logprobs is None and best.outputs[0].index == 0
    llm.shutdown()
