"""BeamSearch selection on a toy 4-token vocabulary (3 = EOS), width 2, with the expected
results worked out by hand; tests/integration/test_beam_search.py compares with transformers.

Step 1 from the prompt: p = .5 .3 .05 .15    -> beams [0] (-0.693), [1] (-1.204); EOS is 3rd.
Step 2: after [0]: p = .15 .1 .05 .7 ; after [1]: p = .6 .2 .1 .1
        candidates: [0,3] -1.050 | [1,0] -1.715 | [0,0] -2.590 | [1,1] -2.813
        -> [0,3] finishes; beams [1,0], [0,0]
Step 3: after [1,0]: p = .1 .1 .1 .7 ; after [0,0]: p = .4 .3 .2 .1
        candidates: [1,0,3] -2.072 | [0,0,0] -3.506 | [0,0,1] -3.794 | ...
        -> [1,0,3] finishes; beams [0,0,0], [0,0,1] (beam [0,0] kept twice, [1,0] dropped)
"""

import math

import pytest
import torch

from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.engine.beam_search import BeamSearch, BeamSearchRequest
from pagedllm.beam_search_params import BeamSearchParams

TABLE = {
    (): [0.5, 0.3, 0.05, 0.15],
    (0,): [0.15, 0.1, 0.05, 0.7],
    (1,): [0.6, 0.2, 0.1, 0.1],
    (1, 0): [0.1, 0.1, 0.1, 0.7],
    (0, 0): [0.4, 0.3, 0.2, 0.1],
}
UNIFORM = [0.3, 0.3, 0.3, 0.1]
LP = {  # cumulative logprobs of the two hypotheses that finish
    (0, 3): math.log(0.5) + math.log(0.7),
    (1, 0, 3): math.log(0.3) + math.log(0.6) + math.log(0.7),
}


def run(max_tokens=10, **kw):
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=max_tokens, **kw), {3})
    running: list[list[int]] = [[]]
    trace = []
    while not search.done:
        logits = torch.log(torch.tensor([TABLE.get(tuple(t), UNIFORM) for t in running]))
        step = search.step(logits, [list(t) for t in running])
        trace.append([(c.parent, c.token_id) for c in step.continuations])
        running = [running[c.parent] + [c.token_id] for c in step.continuations]
    return search, trace


def test_steps_finished_hypotheses_and_stop_by_heuristic():
    search, trace = run()
    assert trace[0] == [(0, 0), (0, 1)]
    assert trace[1] == [(1, 0), (0, 0)]  # [1,0] then [0,0]; [0,3] finished
    # Step 3: both continuations extend running beam 1 ([0,0]); the search then stops
    # (best running -3.506 / 3 cannot beat the worst finished -2.072 / 3).
    assert len(trace) == 3 and trace[2] == []
    res = search.results()
    assert [h.token_ids for h in res] == [[0, 3], [1, 0, 3]]
    assert [h.finish_reason for h in res] == ["stop", "stop"]
    assert res[0].cumulative_logprob == pytest.approx(LP[(0, 3)], abs=1e-5)
    assert res[0].score == pytest.approx(LP[(0, 3)] / 2, abs=1e-5)
    assert res[1].score == pytest.approx(LP[(1, 0, 3)] / 3, abs=1e-5)


def test_length_penalty_reorders_finished():
    search, _ = run(length_penalty=2.0)
    res = search.results()
    assert [h.token_ids for h in res] == [[1, 0, 3], [0, 3]]  # -2.072/9 > -1.050/4
    assert res[0].score == pytest.approx(LP[(1, 0, 3)] / 9, abs=1e-5)


def test_early_stopping_never_searches_on():
    # At step 3 the best running beam, scored at max_tokens=10, could still win: continue.
    search, trace = run(early_stopping="never")
    assert len(trace) > 3 and search.done
    search, trace = run(early_stopping=True)  # two finished: stop at once
    assert len(trace) == 3


def test_max_tokens_finishes_the_best_beams_by_length():
    search, trace = run(max_tokens=2)
    assert len(trace) == 2 and trace[1] == []
    res = search.results()
    assert [h.token_ids for h in res] == [[0, 3], [1, 0]]
    assert [h.finish_reason for h in res] == ["stop", "length"]


def test_ignore_eos_never_finishes_early():
    search, trace = run(max_tokens=3, ignore_eos=True)
    res = search.results()
    assert len(trace) == 3 and all(len(h.token_ids) == 3 for h in res)
    # EOS is just a token: [0, 3] runs on (uniform next: -1.050 - 1.204) and loses to
    # [1, 0, 3] (-2.072); both end by length.
    assert trace[1] == [(0, 3), (1, 0)]  # (parent, token): [0, 3] and [1, 0]
    assert res[0].token_ids == [1, 0, 3] and res[1].token_ids[:2] == [0, 3]
    assert [h.finish_reason for h in res] == ["length", "length"]


def test_advance_forks_before_appending_and_drops_unchosen():
    params = BeamSearchParams(beam_width=2, max_tokens=10)
    seqs = [SequenceState(seq_id=i, request_id="r", prompt_token_ids=[5], arrival_time=0.0,
                     output_token_ids=list(t)) for i, t in enumerate(([1, 0], [0, 0]))]
    for s in seqs:
        s.status = SequenceStatus.RUNNING
        s.num_computed_tokens = s.num_tokens
    req = BeamSearchRequest(BeamSearch(params, {3}), running=list(seqs))
    req.search.num_generated = 2
    req.search.running_scores = torch.tensor([-1.715, -2.590])
    forked, dropped = [], []

    def fork(parent):
        child = SequenceState(seq_id=9, request_id="r", prompt_token_ids=[5], arrival_time=0.0,
                         output_token_ids=list(parent.output_token_ids))
        forked.append((parent.seq_id, list(parent.output_token_ids)))
        return child

    assert not req.ready()
    req.add_logits(seqs[0], torch.log(torch.tensor(TABLE[(1, 0)])))
    assert not req.ready()
    req.add_logits(seqs[1], torch.log(torch.tensor(TABLE[(0, 0)])))
    assert req.ready()
    done = req.advance(fork, dropped.append)
    # The first hypothesis ([0, 3] from step 2) is unknown here: one finished, not done.
    assert not done and dropped == [seqs[0]] and forked == [(1, [0, 0])]
    assert [s.output_token_ids for s in req.running] == [[0, 0, 0], [0, 0, 1]]
    assert req.pending == {}
