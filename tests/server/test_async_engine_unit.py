"""AsyncLLMEngine (the front end) and the streaming helpers against a fake engine core (no
model, milliseconds), driven by the real `CoreBusyLoop` in a thread (`InprocCoreClient`):
steps run off the event loop, token deltas become cumulative outputs on their streams, leaving
early aborts, a failed step fails only the requests in flight and the loop goes on, rejected
adds raise, stop strings finish a sample in the front end and free it in the core."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.request_stream import RequestStream
from pagedllm.engine.core_client import InprocCoreClient
from pagedllm.engine.core_messages import (
    CoreStats,
    EngineCoreOutput,
    EngineCoreOutputs,
    SampleDelta,
)
from pagedllm.engine.errors import SchedulerStallError
from pagedllm.entrypoints.openai.streaming import merge_async_iterators
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

REJECTED_TOKEN = 13  # the fake core refuses prompts holding it (as the real one would a bad id)
MAX_MODEL_LEN = 2048
BASE = 1000  # the fake core's tokens are BASE, BASE + 1, ... (plain words, no special tokens)


def toks(n: int) -> list[int]:
    return [BASE + i for i in range(n)]


class FakeCore:
    """Each step gives every request one more token (BASE + its count so far); the
    sample finishes with "length" at max_tokens."""

    def __init__(self) -> None:
        self.requests: dict[str, dict] = {}
        self.step_threads: set[int] = set()
        self.aborted: list[str] = []
        self.finished_samples: list[tuple[str, int]] = []
        self.fail_next_step = False
        self.step_gate: threading.Event | None = None  # a step waits for it when set
        self.step_permits: threading.Semaphore | None = None  # a step takes one permit when set
        self.stall_ids: list[str] | None = None  # the next step raises SchedulerStallError

    @staticmethod
    def external(core_id: str) -> str:
        return core_id.split(":", 1)[1]

    def add_request(self, request):
        if REJECTED_TOKEN in request.prompt_token_ids:
            raise ValueError("the core refuses this prompt")
        self.requests[request.request_id] = {"tokens": [],
                                             "max": request.sampling_params.max_tokens}

    def abort_requests(self, request_ids):
        for rid in request_ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(self.external(rid))

    def finish_samples(self, samples):
        for rid, index in samples:
            if self.requests.pop(rid, None) is not None:
                self.finished_samples.append((self.external(rid), index))

    def has_unfinished_requests(self):
        return bool(self.requests)

    def stats(self):
        return CoreStats(num_running=len(self.requests))

    def utility(self, name, args):
        return {"name": name, "args": args}

    def shutdown(self):
        self.shut_down = True

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
            raise SchedulerStallError([r for r in self.requests if self.external(r) in ids],
                                      num_steps=1000)
        time.sleep(0.002)  # a step takes time, as a forward does: the loop can keep up
        outs = []
        for rid, r in list(self.requests.items()):
            token = BASE + len(r["tokens"])
            r["tokens"].append(token)
            done = len(r["tokens"]) >= r["max"]
            outs.append(EngineCoreOutput(rid, [SampleDelta(0, [token],
                                                           finish_reason="length" if done else None)],
                                         finished=done))
            if done:
                del self.requests[rid]
        return EngineCoreOutputs(outs)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from pathlib import Path

    from pagedllm.tokenizer import load_tokenizer

    path = Path(smollm2_gguf)
    return load_tokenizer(str(path.parent), path.name)


def make_engine(fake: FakeCore, tokenizer) -> AsyncLLMEngine:
    info = EngineInfo(model_name="fake", model_root="/fake", max_model_len=MAX_MODEL_LEN,
                      vocab_size=tokenizer.vocab_size + 1000, num_blocks=1024, block_size=16,
                      chat_template=None, startup_seconds=0.0, kernel_info={})
    return AsyncLLMEngine([InprocCoreClient(fake)], tokenizer, info)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def with_engine(tokenizer):
    def runner(fn):
        async def main():
            fake = FakeCore()
            engine = make_engine(fake, tokenizer)
            engine.start()
            try:
                return await fn(fake, engine)
            finally:
                await engine.shutdown()

        return run(main())

    return runner


def test_outputs_stream_until_finished_and_steps_run_off_the_loop(with_engine, tokenizer):
    async def body(fake, engine):
        outs = [o async for o in engine.generate("p", SamplingParams(max_tokens=4), "r1")]
        last = outs[-1]
        assert last.finished and last.request_id == "r1"
        assert last.outputs[0].token_ids == toks(4)
        assert last.outputs[0].text == tokenizer.decode(toks(4), skip_special_tokens=True) != ""
        assert last.outputs[0].finish_reason == "length"
        assert all(not o.finished for o in outs[:-1])
        assert threading.get_ident() not in fake.step_threads
        assert engine.num_open_streams == 0

    with_engine(body)


def test_concurrent_requests_each_get_their_own_outputs(with_engine):
    async def body(fake, engine):
        async def one(i):
            outs = [o async for o in engine.generate("p", SamplingParams(max_tokens=2 + i),
                                                     f"r{i}")]
            return outs[-1].outputs[0].token_ids

        results = await asyncio.gather(*(one(i) for i in range(8)))
        assert results == [toks(2 + i) for i in range(8)]

    with_engine(body)


def test_leaving_early_aborts_the_request(with_engine):
    async def body(fake, engine):
        gen = engine.generate("p", SamplingParams(max_tokens=1000), "long")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()
        await _until(lambda: "long" in fake.aborted)
        assert fake.aborted == ["long"] and not fake.requests
        assert engine.num_open_streams == 0

    with_engine(body)


def test_cancelled_consumer_aborts_the_request(with_engine):
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
        await _until(lambda: "c" in fake.aborted)
        assert fake.aborted == ["c"] and not fake.requests

    with_engine(body)


def test_rejected_add_raises_and_keeps_nothing(with_engine):
    async def body(fake, engine):
        too_long = {"prompt_token_ids": [1] * (MAX_MODEL_LEN + 1)}
        with pytest.raises(ValueError, match="maximum context length"):
            await engine.add_request("x", too_long, SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="maximum context length"):
            await engine.add_requests([("a", "p"), ("b", too_long)], SamplingParams(max_tokens=50))
        await _until(lambda: not fake.requests)  # "a" was aborted
        assert engine.num_open_streams == 0
        # Rejected by the core itself: the stream fails with its ValueError (a 400).
        stream = await engine.add_request("y", {"prompt_token_ids": [5, REJECTED_TOKEN]},
                                          SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="refuses"):
            await asyncio.wait_for(stream.get(), 5)
        assert engine.num_open_streams == 0 and not engine.output_processor.requests

    with_engine(body)


def test_failed_step_is_fatal_fails_requests_503_and_reports_the_engine_dead(with_engine):
    """A step that raises leaves the core's state unknown: its requests fail with
    EngineDeadError (503), /health's reason names it, on_fatal runs once, new requests are
    refused; never a live engine that fails every step (the zombie core)."""
    async def body(fake, engine):
        fatal: list[str] = []
        engine.on_fatal = fatal.append
        fake.step_gate = threading.Event()
        gen = engine.generate("p", SamplingParams(max_tokens=5), "doomed")
        task = asyncio.ensure_future(gen.__anext__())
        await _until(lambda: fake.requests)
        fake.fail_next_step = True
        fake.step_gate.set()
        with pytest.raises(EngineDeadError, match="fatal error.*kernel exploded"):
            await task
        await _until(lambda: fatal)
        assert len(fatal) == 1 and "kernel exploded" in fatal[0]
        assert "kernel exploded" in engine.health_problem()
        assert not engine.is_running and engine.num_open_streams == 0
        with pytest.raises(EngineDeadError):
            await engine.add_request("next", "p", SamplingParams(max_tokens=2))

    with_engine(body)


def test_slow_consumer_keeps_only_the_newest_cumulative_output(with_engine):
    async def body(fake, engine):
        stream = await engine.add_request("s", "p", SamplingParams(max_tokens=6))
        await _until(lambda: engine.num_open_streams == 0)  # delivered, not read
        out = await stream.get()
        assert out.finished and out.outputs[0].token_ids == toks(6)

    with_engine(body)


def test_stop_string_finishes_the_sample_in_the_front_end_and_frees_it_in_the_core(
        with_engine, tokenizer):
    async def body(fake, engine):
        stop = tokenizer.decode([BASE + 2])  # token 2's text: the sample stops there
        assert stop.strip() and stop not in tokenizer.decode(toks(2))
        outs = [o async for o in engine.generate(
            "p", SamplingParams(max_tokens=50, stop=[stop]), "st")]
        last = outs[-1].outputs[0]
        assert outs[-1].finished and last.finish_reason == "stop" and last.stop_reason == stop
        assert stop not in last.text
        await _until(lambda: ("st", 0) in fake.finished_samples)
        assert not fake.requests

    with_engine(body)


def test_utility_call_reaches_the_core(with_engine):
    async def body(fake, engine):
        assert await engine.call_utility("reset_prefix_cache") == {
            "name": "reset_prefix_cache", "args": []}

    with_engine(body)


def test_an_unread_delta_absorbs_the_next_and_a_cumulative_one_is_superseded():
    def out(text, ids, finished=False, reason=None):
        return RequestOutput("r", None, [1], None, [CompletionOutput(0, text, ids,
                                                                     finish_reason=reason)],
                             finished)

    async def body():
        delta = RequestStream("r", delta=True)
        delta.put(out("Hel", [1]))
        delta.put(out("lo", [2, 3]))
        delta.put(out("!", [4], True, "length"))
        got = await delta.get()
        assert (got.outputs[0].text, got.outputs[0].token_ids) == ("Hello!", [1, 2, 3, 4])
        assert got.finished and got.outputs[0].finish_reason == "length" and delta.finished
        cumulative = RequestStream("r")
        cumulative.put(out("Hel", [1]))
        cumulative.put(out("Hello", [1, 2]))
        got = await cumulative.get()
        assert (got.outputs[0].text, got.outputs[0].token_ids) == ("Hello", [1, 2])

    asyncio.run(body())


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


def test_id_aborted_and_readded_during_a_step_never_sees_the_old_outputs(with_engine):
    async def body(fake, engine):
        fake.step_permits = threading.Semaphore(0)  # every step waits for a permit
        await engine.add_request("x", "old", SamplingParams(max_tokens=100))
        await _until(lambda: fake.step_threads)  # the step for the old "x" is in flight
        engine.abort("x")
        stream = await engine.add_request("x", "new", SamplingParams(max_tokens=3))
        fake.step_permits.release(1)  # the in-flight step ends with an output of the old "x"
        fake.step_permits.release(100)
        outs = [o async for o in engine.stream_outputs(stream)]
        assert [o.prompt for o in outs] == ["new"] * len(outs)
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == toks(3)
        assert fake.aborted == ["x"]

    with_engine(body)


def test_late_abort_of_a_finished_stream_spares_the_request_that_reuses_its_id(with_engine):
    async def body(fake, engine):
        old = await engine.add_request("x", "old", SamplingParams(max_tokens=1))
        await _until(lambda: engine.num_open_streams == 0)  # delivered, not yet read
        fake.step_permits = threading.Semaphore(0)  # the new "x" cannot finish meanwhile
        new = await engine.add_request("x", "new", SamplingParams(max_tokens=3))
        engine.abort_unfinished([old])  # the old consumer leaves without reading
        fake.step_permits.release(100)
        outs = await asyncio.wait_for(_collect(engine, new), 5)
        assert outs[-1].finished and outs[-1].prompt == "new"
        assert outs[-1].outputs[0].token_ids == toks(3) and fake.aborted == []

    with_engine(body)


async def _collect(engine, stream):
    return [o async for o in engine.stream_outputs(stream)]


def test_shutdown_during_a_long_step_fails_everyone_and_never_calls_back_later(tokenizer):
    async def body():
        fake = FakeCore()
        engine = make_engine(fake, tokenizer)
        calls_after = []
        deliver = engine._on_outputs
        engine._on_outputs = lambda o: (calls_after.append(o) if engine._stopping
                                        else deliver(o))
        engine.start()
        loop_errors = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
        fake.step_permits = threading.Semaphore(0)
        stream = await engine.add_request("a", "p", SamplingParams(max_tokens=5))
        await _until(lambda: fake.step_threads)  # a long step is in flight
        await engine.shutdown(timeout=0.1)  # returns while the step still runs
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(stream.get(), 2)
        fake.step_permits.release(100)  # the step ends after shutdown returned
        thread = engine.clients[0]._thread
        await asyncio.to_thread(thread.join, 5)
        assert not thread.is_alive()
        assert getattr(fake, "shut_down", False)  # the core stopped its workers
        await asyncio.sleep(0.05)  # anything the thread scheduled would have run by now
        assert calls_after == [] and loop_errors == []
        with pytest.raises(EngineDeadError):
            await engine.add_request("c", "p", SamplingParams(max_tokens=1))

    run(body())


def test_scheduler_stall_fails_the_stuck_requests_and_marks_the_engine_unhealthy(with_engine):
    async def body(fake, engine):
        fake.step_permits = threading.Semaphore(0)
        stuck = await engine.add_request("stuck", "p", SamplingParams(max_tokens=50))
        await _until(lambda: fake.step_threads)  # its first step is in flight
        other = await engine.add_request("other", "p", SamplingParams(max_tokens=3))
        assert engine.health_error is None and engine.health_problem() is None
        fake.stall_ids = ["stuck"]  # that step raises the watchdog's error
        fake.step_permits.release(1000)
        with pytest.raises(SchedulerStallError) as info:
            await asyncio.wait_for(stuck.get(), 5)
        assert info.value.request_ids == ["stuck"]
        assert "stuck" in fake.aborted  # its blocks returned
        outs = await asyncio.wait_for(_collect(engine, other), 5)  # the others go on
        assert outs[-1].finished
        assert engine.health_error is not None and "stuck" in engine.health_error
        assert "unhealthy" in engine.health_problem()
        assert engine.is_running  # new requests are still served (health says restart)
        outs = [o async for o in engine.generate("p", SamplingParams(max_tokens=2), "later")]
        assert outs[-1].finished
        assert engine.health_error is not None  # unhealthy until restart

    with_engine(body)


def test_detokenize_false_gives_token_ids_without_text(with_engine):
    async def body(fake, engine):
        outs = [o async for o in engine.generate(
            "p", SamplingParams(max_tokens=3, detokenize=False, logprobs=0), "nd")]
        last = outs[-1].outputs[0]
        assert last.token_ids == toks(3) and last.text == ""

    with_engine(body)


def test_a_send_that_fails_leaves_nothing_behind(with_engine):
    """The add path used to register the stream, the output state and the router load before
    sending: a send (or encode) failure leaked all three."""
    async def body(fake, engine):
        client = engine.clients[0]
        real = client.add_request

        def broken(request):
            raise RuntimeError("the socket is gone")

        client.add_request = broken
        with pytest.raises(RuntimeError, match="socket is gone"):
            await engine.add_request("leak", "p", SamplingParams(max_tokens=2))
        client.add_request = real
        assert engine.num_open_streams == 0
        assert not engine.output_processor.requests
        assert engine.router.load == [0]
        outs = [o async for o in engine.generate("p", SamplingParams(max_tokens=2), "leak")]
        assert outs[-1].finished  # the id is free again

    with_engine(body)


def test_failed_requests_count_as_finished_with_reason_error(tokenizer):
    from prometheus_client import CollectorRegistry

    from pagedllm.metrics import EngineMetrics

    async def main():
        fake = FakeCore()
        engine = make_engine(fake, tokenizer)
        engine.metrics = EngineMetrics("fake", registry=CollectorRegistry(),
                                       kernel_info={"variant": "test"})
        engine.start()
        try:
            bad = [REJECTED_TOKEN]
            with pytest.raises(ValueError, match="refuses"):
                [o async for o in engine.generate({"prompt_token_ids": bad},
                                                  SamplingParams(max_tokens=2), "refused")]
            text = engine.metrics.render().decode()
            line = next(ln for ln in text.splitlines() if ln.startswith(
                "vllm:request_success_total") and 'finished_reason="error"' in ln)
            assert line.endswith(" 1.0"), line
            assert "refused" not in engine.metrics._seen
        finally:
            await engine.shutdown()

    run(main())


def test_health_names_a_dead_core_while_its_last_outputs_drain():
    """A core process that ends is reported dead only after its reader drained the socket
    (up to DRAIN_TIMEOUT_S). In that window /health used to answer "The engine is not
    running." — the client was no longer alive but the loop had not been told — so a
    supervisor could not tell a crash from a shutdown. It names the death at once."""
    from types import SimpleNamespace

    from pagedllm.engine.core_client import MPCoreClient

    delivered: list[tuple] = []
    draining = threading.Event()
    client = object.__new__(MPCoreClient)  # the death path only, no process or sockets
    client.engine_index = 0
    client.alive = True
    client.ended_how = None
    client._stopping = False
    client._reader_failed = None
    client._core_ended = threading.Event()
    client._reader = threading.Thread(target=draining.wait, args=(10,), daemon=True)
    client._reader.start()
    client._delivery = SimpleNamespace(call=lambda fn, *args: delivered.append(args))
    watcher = threading.Thread(target=client._report_end,
                               args=(None, "Engine core 0 (pid 1)", "killed by signal 9"))
    watcher.start()
    deadline = time.monotonic() + 5
    while client.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    front = SimpleNamespace(dead_engines={}, _stopping=False, clients=[client],
                            is_running=False, health_error=None)
    problem = AsyncLLMEngine.health_problem(front)
    assert not delivered  # still draining: the loop has not heard of the death
    assert problem is not None and "died" in problem and "killed by signal 9" in problem
    draining.set()
    watcher.join(5)
    assert delivered == [(0, "killed by signal 9")]
