"""The per-sequence back-off of failing proposals (spec_decode/backoff.py)."""

from __future__ import annotations

import random

from pagedllm.spec_decode.backoff import SpecBackoff


def _speculating_steps(accept, steps=2000, **kw) -> list[int]:
    """The steps on which one sequence, whose proposals get `accept()` tokens accepted, speculates."""
    b, used = SpecBackoff(**kw), []
    for step in range(steps):
        if b.allows(7, step):
            used.append(step)
            b.observe(7, accept(), step)
    return used


def test_nothing_accepted_pauses_exponentially_up_to_the_cap():
    used = _speculating_steps(lambda: 0, max_pause=8)
    # the mean falls 1, 0.8, 0.64, ... below 0.15 at the 9th miss: then pauses of 1, 2, 4, 8, 8, ...
    assert used[:14] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 36]
    assert all(b - a == 9 for a, b in zip(used[12:], used[13:]))
    assert len(_speculating_steps(lambda: 0)) <= 2000 // 65 + 15  # 9 misses, 6 rising pauses, then 1 in 65


def test_useful_proposals_keep_speculating():
    assert len(_speculating_steps(lambda: 1)) == 2000
    rng = random.Random(0)  # half a token accepted per proposal on average
    assert len(_speculating_steps(lambda: int(rng.random() < 0.5))) > 0.9 * 2000


def test_sequences_are_independent_and_forgotten():
    b = SpecBackoff(min_accepted=0.9)
    b.observe(1, 0, step=0)
    assert not b.allows(1, 1) and b.allows(2, 1)
    b.forget_all_but({2})
    assert b.allows(1, 1) and len(b) == 0


def test_a_new_sequence_starts_from_the_engine_wide_mean():
    """Where proposals fail for every sequence, later sequences pause after one miss."""
    b = SpecBackoff()
    for seq_id in range(40):  # 40 sequences, 10 failed proposals each
        for step in range(10):
            b.observe(seq_id, 0, step)
    assert b.engine_mean < 0.02
    b.observe(99, 0, step=100)
    assert not b.allows(99, 101)  # paused after its first miss
    good = SpecBackoff()
    for step in range(10):
        good.observe(1, 3, step)
    good.observe(2, 0, step=10)
    assert good.allows(2, 11)  # proposals pay for others: one miss does not pause
