"""AsyncLLMEngine and the streaming helpers against a fake engine (no model, milliseconds):
steps run off the event loop, outputs reach their streams, leaving early aborts, a failed
step fails only the requests in flight and the loop goes on, rejected adds raise."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.errors import SchedulerStallError
from pagedllm.entrypoints.openai.streaming import ChoiceStream, merge_async_iterators
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams


class FakeEngine:
    """Each step appends one token ("t<i> ") to every request; done after max_tokens."""

    def __init__(self) -> None:
        self.requests: dict[str, dict] = {}
        self.step_threads: set[int] = set()
        self.aborted: list[str] = []
        self.fail_next_step = False
        self.step_gate: threading.Event | None = None  # a step waits for it when set
        self.step_permits: threading.Semaphore | None = None  # a step takes one permit when set
        self.stall_ids: list[str] | None = None  # the next step raises SchedulerStallError

    def add_request(self, request_id, prompt, params, arrival_time=None):
        if prompt == "bad":
            raise ValueError("bad prompt")
        self.requests[request_id] = {"tokens": [], "max": params.max_tokens,
                                     "arrival": arrival_time, "prompt": prompt}

    def abort_request(self, request_id):
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.step_threads.add(threading.get_ident())
        if self.step_gate is not None:
            self.step_gate.wait(5)
        if self.step_permits is not None:
            self.step_permits.acquire(timeout=5)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("kernel exploded")
        if self.stall_ids is not None:
            ids, self.stall_ids = self.stall_ids, None
            raise SchedulerStallError(ids, num_steps=1000)
        outs = []
        for rid, r in list(self.requests.items()):
            r["tokens"].append(len(r["tokens"]))
            done = len(r["tokens"]) >= r["max"]
            text = "".join(f"t{t} " for t in r["tokens"])
            outs.append(RequestOutput(
                request_id=rid, prompt=r["prompt"], prompt_token_ids=[1, 2],
                prompt_logprobs=None,
                outputs=[CompletionOutput(0, text, list(r["tokens"]),
                                          finish_reason="length" if done else None)],
                finished=done, metrics=RequestMetrics(arrival_time=r["arrival"] or 0.0)))
            if done:
                del self.requests[rid]
        return outs


def run(coro):
    return asyncio.run(coro)


async def _with_engine(fn):
    fake = FakeEngine()
    engine = AsyncLLMEngine(fake)
    engine.start()
    try:
        return await fn(fake, engine)
    finally:
        await engine.shutdown()


def test_outputs_stream_until_finished_and_steps_run_off_the_loop():
    async def body(fake, engine):
        outs = [o async for o in engine.generate("p", SamplingParams(max_tokens=4), "r1")]
        assert outs[-1].finished and outs[-1].outputs[0].text == "t0 t1 t2 t3 "
        assert all(not o.finished for o in outs[:-1])
        assert threading.get_ident() not in fake.step_threads
        assert engine.num_open_streams == 0

    run(_with_engine(body))


def test_concurrent_requests_each_get_their_own_outputs():
    async def body(fake, engine):
        async def one(i):
            outs = [o async for o in engine.generate("p", SamplingParams(max_tokens=2 + i),
                                                     f"r{i}")]
            return outs[-1].outputs[0].token_ids

        results = await asyncio.gather(*(one(i) for i in range(8)))
        assert results == [list(range(2 + i)) for i in range(8)]

    run(_with_engine(body))


def test_leaving_early_aborts_the_request():
    async def body(fake, engine):
        gen = engine.generate("p", SamplingParams(max_tokens=1000), "long")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()
        for _ in range(100):
            if "long" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert fake.aborted == ["long"] and not fake.requests
        assert engine.num_open_streams == 0

    run(_with_engine(body))


def test_cancelled_consumer_aborts_the_request():
    async def body(fake, engine):
        got_first = asyncio.Event()
        # Exactly one step may run before the cancel, however slow the event loop is, so
        # "c" cannot finish first; a step without a permit waits up to 5 s.
        fake.step_permits = threading.Semaphore(1)

        async def consume():
            async for _ in engine.generate("p", SamplingParams(max_tokens=1000), "c"):
                got_first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_first.wait(), timeout=10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        fake.step_permits.release(1000)
        for _ in range(500):
            if "c" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert fake.aborted == ["c"] and "c" not in fake.requests

    run(_with_engine(body))


def test_rejected_add_raises_and_keeps_nothing():
    async def body(fake, engine):
        with pytest.raises(ValueError, match="bad prompt"):
            await engine.add_request("x", "bad", SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="bad prompt"):
            await engine.add_requests([("a", "p"), ("b", "bad")], SamplingParams(max_tokens=50))
        for _ in range(100):
            if not fake.requests:
                break
            await asyncio.sleep(0.01)
        assert not fake.requests and engine.num_open_streams == 0  # "a" was aborted

    run(_with_engine(body))


def test_failed_step_fails_requests_in_flight_then_serves_again():
    async def body(fake, engine):
        fake.step_gate = threading.Event()
        gen = engine.generate("p", SamplingParams(max_tokens=5), "doomed")
        task = asyncio.ensure_future(gen.__anext__())
        while "doomed" not in fake.requests:
            await asyncio.sleep(0.005)
        fake.fail_next_step = True
        fake.step_gate.set()
        with pytest.raises(RuntimeError, match="kernel exploded"):
            await task
        fake.step_gate = None
        outs = [o async for o in engine.generate("p", SamplingParams(max_tokens=2), "next")]
        assert outs[-1].finished
        assert engine.is_running

    run(_with_engine(body))


def test_slow_consumer_keeps_only_the_newest_cumulative_output():
    async def body(fake, engine):
        stream = await engine.add_request("s", "p", SamplingParams(max_tokens=6))
        while "s" in fake.requests:  # let the engine finish without reading
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        out = await stream.get()
        assert out.finished and out.outputs[0].token_ids == list(range(6))

    run(_with_engine(body))


def test_choice_stream_holds_back_a_possible_stop_string():
    cs = ChoiceStream(["STOP"], hold_back=True)
    steps = ["Hello S", "Hello ST", "Hello STa", "Hello STa ST", "Hello STa "]
    deltas = []
    for i, text in enumerate(steps):
        done = i == len(steps) - 1
        out = CompletionOutput(0, text, list(range(i + 1)),
                               finish_reason="stop" if done else None)
        deltas.append(cs.delta(out)[0])
    assert deltas == ["Hello ", "", "STa", " ", ""]
    assert "".join(deltas) == steps[-1]
    # include_stop_str_in_output: nothing is held back
    cs = ChoiceStream(["STOP"], hold_back=False)
    assert cs.delta(CompletionOutput(0, "ab S", [1]))[0] == "ab S"


def test_merge_async_iterators_interleaves_and_closes():
    closed = []

    async def gen(name, n, delay):
        try:
            for i in range(n):
                await asyncio.sleep(delay)
                yield f"{name}{i}"
        finally:
            closed.append(name)

    async def body():
        items = [x async for x in merge_async_iterators(gen("a", 3, 0.001), gen("b", 2, 0.0015))]
        assert sorted(v for _, v in items) == ["a0", "a1", "a2", "b0", "b1"]
        assert [v for i, v in items if i == 0] == ["a0", "a1", "a2"]
        merged = merge_async_iterators(gen("x", 100, 0.001), gen("y", 100, 0.001))
        await merged.__anext__()
        await merged.aclose()
        assert {"x", "y"} <= set(closed)

    run(body())


# ---- id reuse, shutdown during a step, the scheduler watchdog -----------------------------


async def _until(cond, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


def test_id_aborted_and_readded_during_a_step_never_sees_the_old_outputs():
    async def body(fake, engine):
        fake.step_permits = threading.Semaphore(0)  # every step waits for a permit
        await engine.add_request("x", "old", SamplingParams(max_tokens=100))
        await _until(lambda: fake.step_threads)  # the step for the old "x" is in flight
        engine.abort("x")
        readd = asyncio.ensure_future(engine.add_request("x", "new", SamplingParams(max_tokens=3)))
        await asyncio.sleep(0.05)  # the new stream exists; its add waits behind the step
        fake.step_permits.release(1)  # the in-flight step ends with an output of the old "x"
        stream = await asyncio.wait_for(readd, 5)
        fake.step_permits.release(100)
        outs = [o async for o in engine.stream_outputs(stream)]
        assert [o.prompt for o in outs] == ["new"] * len(outs)
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == [0, 1, 2]
        assert fake.aborted == ["x"]

    run(_with_engine(body))


def test_late_abort_of_a_finished_stream_spares_the_request_that_reuses_its_id():
    async def body(fake, engine):
        old = await engine.add_request("x", "old", SamplingParams(max_tokens=1))
        await _until(lambda: engine.num_open_streams == 0)  # delivered, not yet read
        fake.step_permits = threading.Semaphore(0)  # the new "x" cannot finish meanwhile
        new = await engine.add_request("x", "new", SamplingParams(max_tokens=3))
        engine.abort_unfinished([old])  # the old consumer leaves without reading
        fake.step_permits.release(100)
        outs = await asyncio.wait_for(_collect(engine, new), 5)
        assert outs[-1].finished and outs[-1].prompt == "new"
        assert outs[-1].outputs[0].token_ids == [0, 1, 2] and fake.aborted == []

    run(_with_engine(body))


async def _collect(engine, stream):
    return [o async for o in engine.stream_outputs(stream)]


def test_shutdown_during_a_long_step_fails_everyone_and_never_calls_back_later():
    async def body():
        fake = FakeEngine()
        engine = AsyncLLMEngine(fake)
        engine.start()
        loop_errors = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
        fake.step_permits = threading.Semaphore(0)
        stream = await engine.add_request("a", "p", SamplingParams(max_tokens=5))
        await _until(lambda: fake.step_threads)  # a long step is in flight
        pending_add = asyncio.ensure_future(
            engine.add_request("b", "p", SamplingParams(max_tokens=5)))
        await asyncio.sleep(0.02)
        calls_after = []
        await engine.shutdown(timeout=0.1)  # returns while the step still runs
        for name in ("_deliver", "_deliver_error", "_resolve"):
            setattr(engine, name, lambda *a, _n=name: calls_after.append(_n))
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(stream.get(), 2)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(pending_add, 2)  # an add waiting on the engine fails too
        fake.step_permits.release(100)  # the step ends after shutdown returned
        await asyncio.to_thread(engine._thread.join, 5)
        assert not engine._thread.is_alive()
        await asyncio.sleep(0.05)  # anything the thread scheduled would have run by now
        assert calls_after == [] and loop_errors == []
        with pytest.raises(EngineDeadError):
            await engine.add_request("c", "p", SamplingParams(max_tokens=1))

    run(body())


def test_scheduler_stall_fails_the_stuck_requests_and_marks_the_engine_unhealthy():
    async def body(fake, engine):
        fake.step_permits = threading.Semaphore(0)
        stuck = await engine.add_request("stuck", "p", SamplingParams(max_tokens=50))
        await _until(lambda: fake.step_threads)  # its first step is in flight
        adding = asyncio.ensure_future(
            engine.add_request("other", "p", SamplingParams(max_tokens=3)))
        assert engine.health_error is None
        fake.stall_ids = ["stuck"]  # that step raises the watchdog's error
        fake.step_permits.release(1000)
        other = await asyncio.wait_for(adding, 5)
        with pytest.raises(SchedulerStallError) as info:
            await asyncio.wait_for(stuck.get(), 5)
        assert info.value.request_ids == ["stuck"]
        assert "stuck" in fake.aborted and "stuck" not in fake.requests  # blocks returned
        outs = await asyncio.wait_for(_collect(engine, other), 5)  # the others go on
        assert outs[-1].finished
        assert engine.health_error is not None and "stuck" in engine.health_error
        assert engine.is_running  # new requests are still served (health says restart)
        outs = [o async for o in engine.generate("p", SamplingParams(max_tokens=2), "later")]
        assert outs[-1].finished
        assert engine.health_error is not None  # unhealthy until restart

    run(_with_engine(body))
