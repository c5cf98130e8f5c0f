"""The runner's persistent sampling batch (worker/input_batch.py), no model: after any run of
joins, leaves and forks, the metadata it gathers equals the metadata built afresh from the same
rows' lists (`SamplingMetadata.build`, the former per-step path); its penalty counts, kept
incrementally, give the logits a recount gives; rows are reused and the batch grows."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from pagedllm.layers.sampling_penalties import apply_penalties
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch, SamplingRowSpec, sample_batch, sample_seed

V = 97
EOS = frozenset({3, 5})


def _params(rng: random.Random) -> SamplingParams:
    kw: dict = {"max_tokens": 64}
    if rng.random() < 0.6:
        kw["temperature"] = rng.choice([0.5, 1.0, 1.3])
        kw["top_p"] = rng.choice([1.0, 0.9])
        kw["top_k"] = rng.choice([0, 5])
        kw["min_p"] = rng.choice([0.0, 0.05])
        kw["seed"] = rng.choice([None, rng.randrange(1000)])
    else:
        kw["temperature"] = 0.0
    if rng.random() < 0.4:
        kw["presence_penalty"] = 0.5
        kw["frequency_penalty"] = rng.choice([0.0, 0.3])
        kw["repetition_penalty"] = rng.choice([1.0, 1.2])
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(1, 4)
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randrange(V): rng.choice([-5.0, 5.0])}
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 2])
    return SamplingParams(**kw)


def _fresh(batch: InputBatch, rows: list[int]) -> SamplingMetadata:
    """What the former path built every step from each row's lists (no kept state)."""
    srows = [SamplingRow(batch.specs[r].params, batch.specs[r].prompt_token_ids,
                         list(batch.output_ids[r])) for r in rows]
    md = SamplingMetadata.build(srows, eos_token_id=min(EOS))
    # the former path added every EOS id to all_stop_token_ids; the batch holds the full set
    md.min_tokens_mask = [None if m is None else m | set(EOS) for m in md.min_tokens_mask]
    return md


def _spec(seq_id: int, params: SamplingParams, rng: random.Random, forks=()) -> SamplingRowSpec:
    blocked = frozenset(params.stop_token_ids) | EOS if params.min_tokens else frozenset()
    return SamplingRowSpec(seq_id, params, 0, [rng.randrange(V) for _ in range(rng.randint(1, 9))],
                           min_tokens_blocked=blocked, fork_seq_ids=list(forks))


def _assert_same(a: SamplingMetadata, b: SamplingMetadata) -> None:
    for name in ("temperatures", "top_ps", "top_ks", "min_ps", "presence_penalties",
                 "frequency_penalties", "repetition_penalties"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("num_logprobs", "all_greedy", "all_random", "no_penalties", "no_top_k",
                 "no_top_p", "no_min_p"):
        assert getattr(a, name) == getattr(b, name), name
    assert [dict(x) if x else None for x in a.logit_bias] == [dict(x) if x else None
                                                              for x in b.logit_bias]
    assert [set(x) if x else None for x in a.min_tokens_mask] == [
        set(x) if x else None for x in b.min_tokens_mask]
    assert [list(x) for x in a.output_token_ids] == [list(x) for x in b.output_token_ids]
    assert [list(x) for x in a.prompt_token_ids] == [list(x) for x in b.prompt_token_ids]


@pytest.mark.parametrize("seed", range(6))
def test_rows_after_join_leave_fork_equal_a_fresh_build_and_penalties_equal_a_recount(seed):
    rng = random.Random(seed)
    batch = InputBatch(V, capacity=2)  # grows several times
    live: list[int] = []
    next_id = 0
    sampler = Sampler()
    for _step in range(60):
        for _ in range(rng.randint(0, 3)):  # joins, some with forks (n > 1)
            params = _params(rng)
            forks = list(range(next_id + 1, next_id + 1 + rng.choice([0, 0, 2])))
            batch.add(_spec(next_id, params, rng, forks))
            live.append(next_id)
            next_id += 1 + len(forks)
        for sid in [s for s in live if rng.random() < 0.1]:  # leaves
            batch.remove(sid)
            live.remove(sid)
        if not live:
            continue
        order = rng.sample(live, rng.randint(1, len(live)))  # the step's scheduled subset
        rows, logits_rows = [], []
        for j, sid in enumerate(order):
            new = batch.start_rows(sid)
            rows += new
            logits_rows += [j] * len(new)
            live += [batch.specs[r].seq_id for r in new[1:]]  # forks join for good
        assert len(set(rows)) == len(rows)
        md = batch.metadata(rows, torch.device("cpu"))
        _assert_same(md, _fresh(batch, rows))
        logits = torch.randn(len(order), V, generator=torch.Generator().manual_seed(_step))
        if not md.no_penalties:  # kept counts = counts rebuilt from the lists
            kept = logits[logits_rows].clone()
            recount = kept.clone()
            apply_penalties(kept, md)
            apply_penalties(recount, _fresh(batch, rows))
            torch.testing.assert_close(kept, recount, rtol=0, atol=0)
        out = sample_batch(sampler, batch, logits, rows, logits_rows, [0] * len(rows), None)
        assert len(out.sampled_token_ids) == len(rows)
        assert all(batch.output_ids[r][-1] == t for r, t in zip(rows, out.sampled_token_ids))
    assert len(batch) == len(live) and batch.capacity >= len(live)
    for sid in list(live):
        batch.remove(sid)
    assert len(batch) == 0 and sorted(batch._free) == list(range(batch.capacity))


def test_seeded_rows_draw_what_their_own_generator_draws_whatever_the_batch():
    """A seeded row's token depends only on its seed and its steps: alone or in a batch of
    other rows, at any row position (rows are reused after leaves)."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))

    def draws(others: int) -> list[int]:
        batch = InputBatch(V, capacity=1)
        rng = random.Random(0)
        for i in range(others):  # take rows first, then free some: the seeded one reuses one
            batch.add(_spec(100 + i, SamplingParams(temperature=1.0, max_tokens=8), rng))
        for i in range(0, others, 2):
            batch.remove(100 + i)
        batch.add(_spec(0, params, rng))
        got = []
        for _ in range(5):
            rows = [batch.row_of[s] for s in sorted(batch.row_of, reverse=True)]
            out = sample_batch(Sampler(), batch, logits[: 1].expand(len(rows), V).contiguous(),
                               rows, list(range(len(rows))), list(range(len(rows))), None)
            got.append(out.sampled_token_ids[rows.index(batch.row_of[0])])
        return got

    assert draws(0) == draws(3) == draws(6)


def test_a_seeded_draw_depends_on_its_output_position_not_on_the_draws_before():
    """Drawing positions 0..3 one step at a time, or position 3 alone after outputs were
    appended without drawing, or positions 2 and 3 in one call (verified drafts), gives the
    same token at each position: a draw is seeded by (sample seed, output position)."""
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=8)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    rng = random.Random(0)

    def one_by_one() -> list[int]:
        batch = InputBatch(V)
        batch.add(_spec(0, params, rng))
        row = batch.row_of[0]
        return [sample_batch(Sampler(), batch, logits, [row], [0], [0], None).sampled_token_ids[0]
                for _ in range(4)]

    steps = one_by_one()
    assert len(set(steps)) > 1  # the draws differ from position to position
    batch = InputBatch(V)
    batch.add(_spec(0, params, rng), output_ids=steps[:3])  # positions 0..2 already filled
    row = batch.row_of[0]
    assert sample_batch(Sampler(), batch, logits, [row], [0], [0], None).sampled_token_ids[0] == steps[3]
    batch = InputBatch(V)
    batch.add(_spec(0, params, rng), output_ids=steps[:2])
    row = batch.row_of[0]
    two = sample_batch(Sampler(), batch, logits.expand(2, V).contiguous(), [row, row], [0, 1], [0, 0], None,
                       extra_outputs=[[], [steps[2]]])
    assert two.sampled_token_ids == steps[2:4]


def test_forks_get_their_own_seeds_and_no_second_fork():
    batch = InputBatch(V)
    rng = random.Random(0)
    batch.add(_spec(10, SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=4), rng,
                    forks=[11, 12]))
    rows = batch.start_rows(10)
    assert [batch.specs[r].seq_id for r in rows] == [10, 11, 12]
    assert [batch.specs[r].index for r in rows] == [0, 1, 2]
    seeds = [batch.generators[r].initial_seed() for r in rows]
    assert seeds == [sample_seed(3, i) for i in range(3)] and len(set(seeds)) == 3
    assert batch.start_rows(10) == rows[:1]  # later steps: the row alone
    with pytest.raises(ValueError, match="already has a sampling row"):
        batch.add(_spec(11, SamplingParams(), rng))


def test_min_tokens_blocks_until_reached_then_lets_go():
    batch = InputBatch(V)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7], max_tokens=9)
    batch.add(_spec(0, params, rng))
    row = batch.row_of[0]
    logits = torch.full((1, V), -10.0)
    logits[0, 5] = 10.0  # an EOS id is the argmax
    got = [sample_batch(Sampler(), batch, logits, [row], [0], [0], None).sampled_token_ids[0]
           for _ in range(3)]
    assert got[0] != 5 and got[1] != 5 and got[2] == 5


def test_a_temperature_past_float32_is_accepted_and_samples_a_real_token():
    """1e308 is a valid float to SamplingParams; the row's float32 slot must take it (a tensor
    write of it raised, failing the step) and sample as an extremely flat distribution."""
    batch = InputBatch(V)
    rng = random.Random(0)
    batch.add(_spec(0, SamplingParams(temperature=1e308, seed=1, max_tokens=4), rng))
    row = batch.row_of[0]
    logits = torch.randn(1, V)
    logits[0, :10] = float("-inf")  # masked ids stay masked, never NaN
    token = sample_batch(Sampler(), batch, logits, [row], [0], [0], None).sampled_token_ids[0]
    assert 10 <= token < V
