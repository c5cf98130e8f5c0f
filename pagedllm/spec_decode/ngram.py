"""Prompt lookup (vLLM's "ngram" method): the longest n-gram, prompt_lookup_min <= n <=
prompt_lookup_max, that ends the sequence and occurred earlier in it; the tokens that
followed its earliest occurrence are the proposal (up to k, fewer near the end).

numpy, no model: one vectorised comparison finds where the last token occurred before (each
such place is where a match could end); then each length n, longest first, compares only
those places' n-grams with the sequence's last n tokens. The cost is O(length) plus
O(places x n) per step, and no Python loop runs over tokens.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The proposal for a sequence `tokens` (1-d int array, prompt + output); empty if none."""
    total = tokens.shape[0]
    if k <= 0 or total < min_n + 1:
        return tokens[:0]
    # where an earlier n-gram could end: the last token's earlier places, each followed by a token
    ends = np.flatnonzero(tokens[: total - 1] == tokens[total - 1])
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        e = ends[ends >= n - 1]
        if not e.size:
            continue
        grams = tokens[e[:, None] + np.arange(1 - n, 1)]  # [places, n]
        hits = np.flatnonzero((grams == tokens[total - n:]).all(axis=1))
        if hits.size:  # the earliest occurrence of the longest n
            start = int(e[hits[0]]) + 1
            return tokens[start: start + k]
    return tokens[:0]
