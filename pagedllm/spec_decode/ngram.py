"""Prompt lookup (vLLM's "ngram" method): the longest n-gram, prompt_lookup_min <= n <=
prompt_lookup_max, that ends the sequence and occurred earlier in it; the tokens that
followed its earliest occurrence are the proposal (up to k, fewer near the end).

numpy, no model: each length n is one vectorised comparison of the sequence's sliding
windows with its last n tokens, longest first, so the cost is O(length x n) per step and
no Python loop runs over tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The proposal for a sequence `tokens` (1-d int array, prompt + output); empty if none."""
    total = tokens.shape[0]
    if k <= 0 or total < min_n + 1:
        return tokens[:0]
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # windows starting at 0 .. total - n - 1: each is followed by at least one token
        windows = sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start: start + k]
    return tokens[:0]
