"""The engine's watchdog: a scheduler that stops making progress is a clear error, not a spin."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.errors import SchedulerStallError

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def _stalled_schedule() -> SchedulerOutput:
    """What a scheduler with no way forward returns: nothing scheduled, no block moved."""
    return SchedulerOutput(scheduled=[], block_copies=[], preempted=[], num_batched_tokens=0)


def test_engine_step_raises_naming_the_stuck_requests(smollm2_llm, monkeypatch):
    engine = smollm2_llm.llm_engine
    monkeypatch.setattr(engine.core, "stall_steps", 7)
    monkeypatch.setattr(engine.scheduler, "schedule", _stalled_schedule)
    engine.add_request("stuck-a", "Hello", SamplingParams(max_tokens=4))
    engine.add_request("stuck-b", "World", SamplingParams(max_tokens=4))
    try:
        for _ in range(6):
            assert engine.step() == []
        with pytest.raises(SchedulerStallError, match="stuck-a, stuck-b") as info:
            engine.step()
        assert info.value.request_ids == ["stuck-a", "stuck-b"] and info.value.num_steps == 7
        assert isinstance(info.value, RuntimeError)
    finally:
        engine.abort_request(["stuck-a", "stuck-b"])
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_generate_raises_and_returns_the_blocks(smollm2_llm, monkeypatch):
    engine = smollm2_llm.llm_engine
    monkeypatch.setattr(engine.core, "stall_steps", 5)
    monkeypatch.setattr(engine.scheduler, "schedule", _stalled_schedule)
    with pytest.raises(RuntimeError, match="no progress for 5 consecutive steps"):
        smollm2_llm.generate(["a", "b"], SamplingParams(max_tokens=3), use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    out = smollm2_llm.generate("a", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3  # the engine goes on serving


def test_a_progressing_engine_never_trips_it(smollm2_llm, monkeypatch):
    # n > 1 forks and prefix hits: no step of a working engine is idle three times in a row.
    monkeypatch.setattr(smollm2_llm.llm_engine.core, "stall_steps", 3)
    outs = smollm2_llm.generate(["The capital of France is"] * 3,
                                SamplingParams(max_tokens=8, n=2, ignore_eos=True), use_tqdm=False)
    assert all(len(c.token_ids) == 8 for o in outs for c in o.outputs)
