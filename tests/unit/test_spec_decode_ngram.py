"""The n-gram proposer and speculative_config (no model): vLLM's semantics and refusals."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import propose_ngram


def reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Brute force: longest n first, earliest earlier occurrence with a token after it."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_vllms_docstring_example():
    # [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] has no match, [2,3] does: [4,2,3] follows
    assert propose_ngram(np.array([1, 2, 3, 4, 2, 3]), 2, 3, 4).tolist() == [4, 2, 3]


def test_longest_match_wins_then_the_earliest():
    toks = [9, 1, 2, 5, 7, 1, 2, 6, 3, 1, 2]  # [1,2] occurs at 1 and 5; [3,1,2] nowhere
    assert propose_ngram(np.array(toks), 1, 3, 2).tolist() == [5, 7]
    toks = [3, 1, 2, 8, 1, 2, 6, 3, 1, 2]  # [3,1,2] at 0 beats the later [1,2]
    assert propose_ngram(np.array(toks), 2, 3, 3).tolist() == [8, 1, 2]


def test_no_match_short_context_and_overlapping_repeats():
    assert propose_ngram(np.array([1, 2, 3, 4]), 2, 3, 4).tolist() == []
    assert propose_ngram(np.array([5]), 1, 1, 4).tolist() == []
    assert propose_ngram(np.array([7, 7, 7, 7]), 2, 2, 5).tolist() == [7, 7]  # overlap allowed


@pytest.mark.parametrize("seed", range(200))
def test_equals_brute_force(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
    lo = rng.randrange(1, 4)
    hi = rng.randrange(lo, 6)
    k = rng.randrange(1, 8)
    assert propose_ngram(np.array(tokens), lo, hi, k).tolist() == reference(tokens, lo, hi, k)


def test_config_defaults_and_spellings():
    c = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.from_value({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.from_value({"model": "/d", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.from_value(None) is None


@pytest.mark.parametrize("value, words", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not supported"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa' is not supported"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "'mtp' is not supported"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 10**6}, "more than 64"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "must be <="),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "typical"}, "acceptance_method"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "rank 0"),
    ({"method": "warp", "num_speculative_tokens": 2}, "Unknown speculative method"),
    ("{not json", "not valid JSON"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "awq"}, "for method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": float("nan")}, "positive integer"),
])
def test_config_refusals_name_what(value, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.from_value(value)
