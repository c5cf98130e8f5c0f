"""Which drafted tokens the target accepts, from one token drawn at each verified position.

A decode step with draft tokens d_0 .. d_{k-1} computes the target's logits at k + 1
positions: position j predicts the token after d_{j-1} (position 0: after the last known
token). The runner draws a token t_j at each position from the target's own processed
distribution (temperature, top-k/p, min-p, penalties and min_tokens as if d_0 .. d_{j-1} were
already output). The drafts are accepted while t_j == d_j; the first t_j that differs, or
t_k after all k, is the step's last token. Greedy: t_j is the argmax, so the output is the
non-speculative output token for token. Sampled, with point-mass proposals (n-gram, suffix):
this is Leviathan et al.'s rejection sampling with q = 1 at the draft: d_j is accepted with
probability p_j(d_j), and on rejection t_j follows p_j restricted to the other tokens,
renormalised; so every emitted token follows the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_prefix(drawn: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the tokens drawn at their positions (len(drawn) = k + 1)."""
    n = 0
    for t, d in zip(drawn, drafts):
        if t != d:
            break
        n += 1
    return n


def rows_to_keep(drawn: Sequence[int], spans: Sequence[tuple[int, Sequence[int]]]) -> tuple[list[int], list[int]]:
    """`spans`: per sampled item, (its first row in `drawn`, its drafts; empty for a plain
    decode: one row). Returns the rows whose tokens are emitted, in order (per item: the
    accepted drafts' rows and the next), and each item's number of accepted drafts."""
    keep: list[int] = []
    accepted: list[int] = []
    for first, drafts in spans:
        n = accepted_prefix(drawn[first: first + len(drafts) + 1], drafts) if drafts else 0
        keep.extend(range(first, first + n + 1))
        accepted.append(n)
    return keep, accepted
