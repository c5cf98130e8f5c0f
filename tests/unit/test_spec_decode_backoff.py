"""The per-sequence back-off of failing proposals (spec_decode/backoff.py) and the measured
break-even acceptance that sets its bar (spec_decode/step_cost.py)."""

from __future__ import annotations

import random

import pytest

from pagedllm.spec_decode.backoff import SpecBackoff
from pagedllm.spec_decode.step_cost import StepCostModel


def _speculating_steps(accept, steps=2000, k=4, **kw) -> list[int]:
    """The steps on which one sequence, whose k-token proposals get `accept()` accepted, speculates."""
    b, used = SpecBackoff(**kw), []
    for step in range(steps):
        if b.allows(7, step):
            used.append(step)
            b.observe(7, accept(), k, step)
    return used


def test_nothing_accepted_pauses_exponentially_up_to_the_cap():
    used = _speculating_steps(lambda: 0, max_pause=8, min_rate=0.15)
    # the share falls 1, 0.8, 0.64, ... below 0.15 at the 9th miss: then pauses of 1, 2, 4, 8, 8, ...
    assert used[:14] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 36]
    assert all(b - a == 9 for a, b in zip(used[12:], used[13:]))
    assert len(_speculating_steps(lambda: 0, min_rate=0.15)) <= 2000 // 65 + 15  # then 1 in 65


def test_the_bar_is_the_accepted_share_of_draft_tokens():
    assert len(_speculating_steps(lambda: 4, min_rate=0.8)) == 2000
    rng = random.Random(0)  # each of 4 drafts accepted with probability 0.5: a share of 0.5 (binomial draws)
    half = lambda: sum(rng.random() < 0.5 for _ in range(4))  # noqa: E731
    assert len(_speculating_steps(half, min_rate=0.2)) > 0.95 * 2000
    # the same proposals are not worth it where a draft token must be accepted 80% of the time
    assert len(_speculating_steps(half, min_rate=0.8)) < 0.1 * 2000


def test_sequences_are_independent_and_forgotten():
    b = SpecBackoff(min_rate=0.9)
    b.observe(1, 0, 4, step=0)
    assert not b.allows(1, 1) and b.allows(2, 1)
    b.forget_all_but({2})
    assert b.allows(1, 1) and len(b) == 0


def test_a_new_sequence_starts_from_the_engine_wide_mean():
    """Where proposals fail for every sequence, later sequences pause after one miss."""
    b = SpecBackoff(min_rate=0.15)
    for seq_id in range(40):  # 40 sequences, 10 failed proposals each
        for step in range(10):
            b.observe(seq_id, 0, 4, step)
    assert b.engine_mean < 0.02
    b.observe(99, 0, 4, step=100)
    assert not b.allows(99, 101)  # paused after its first miss
    good = SpecBackoff(min_rate=0.15)
    for step in range(10):
        good.observe(1, 3, 4, step)
    good.observe(2, 0, 4, step=10)
    assert good.allows(2, 11)  # proposals pay for others: one miss does not pause


def test_step_cost_fit_recovers_fixed_and_per_row_cost_and_break_even():
    model = StepCostModel()
    rng = random.Random(1)
    assert model.break_even(1) is None  # nothing measured yet
    for _ in range(400):  # T = 10 ms + 2 ms a row, 5% noise; rows 1..5 (drafts vary)
        rows = rng.choice([1, 1, 3, 5])
        model.observe(rows, (0.010 + 0.002 * rows) * (1 + 0.05 * (rng.random() - 0.5)))
    fixed, slope = model.fit()
    assert fixed == pytest.approx(0.010, rel=0.1) and slope == pytest.approx(0.002, rel=0.1)
    assert model.break_even(1) == pytest.approx(0.002 / 0.012, rel=0.1)
    assert model.break_even(20) == pytest.approx(0.040 / 0.050, rel=0.1)  # a batch: drafts must be nearly sure


def test_step_cost_waits_for_rows_that_vary():
    model = StepCostModel(min_steps=5)
    for _ in range(50):
        model.observe(8, 0.02)  # every step alike: no slope to measure
    assert model.fit() is None and model.break_even(8) is None
