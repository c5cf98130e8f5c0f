"""Multi-LoRA in core/: at most `max_loras` distinct adapters run at once, and the prefix
cache never serves blocks computed under one adapter to another (or to the base model)."""

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import SchedulerConfig


def make(max_loras: int, num_blocks: int = 64, max_num_seqs: int = 8) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, 16, enable_caching=True)
    return Scheduler(SchedulerConfig(max_loras=max_loras, max_num_seqs=max_num_seqs), kv), kv


def seq(sid: int, lora: int, prompt: list[int] | None = None) -> SequenceState:
    s = SequenceState(seq_id=sid, request_id=f"r{sid}", prompt_token_ids=prompt or [100 * (sid + 1) + i for i in range(8)],
                 arrival_time=float(sid))
    s.lora_int_id = lora
    s.lora_key = f"{lora}:adapter{lora}" if lora else None
    return s


def running_loras(sched: Scheduler) -> set[int]:
    return {s.lora_int_id for s in sched.running if s.lora_int_id}


def test_a_third_adapter_waits_while_two_run_and_base_and_running_adapters_go_ahead():
    sched, _ = make(max_loras=2)
    seqs = [seq(0, 1), seq(1, 2), seq(2, 3), seq(3, 0), seq(4, 1)]
    for s in seqs:
        sched.add_sequence(s)
    out = sched.schedule()
    # adapter 3 would be a third: it waits; the base model and adapter 1 (running) go ahead
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1, 3, 4]
    assert seqs[2].status == SequenceStatus.WAITING
    assert running_loras(sched) == {1, 2}
    sched.update_after_step(out)
    for s in out.scheduled:
        s.seq.append_token(5)
    # adapter 2's only sequence finishes: adapter 3 gets its slot at the next step
    sched.finish_sequence(seqs[1], SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert 2 in [s.seq.seq_id for s in out.scheduled]
    assert running_loras(sched) == {1, 3}


def test_running_adapters_never_exceed_max_loras_under_random_load():
    import random

    rng = random.Random(0)
    sched, kv = make(max_loras=2, num_blocks=24, max_num_seqs=6)
    live: list[SequenceState] = []
    sid = 0
    for step in range(300):
        if rng.random() < 0.5 and len(live) < 12:
            s = seq(sid, rng.choice([0, 1, 2, 3, 4]), [rng.randrange(1000) for _ in range(rng.randrange(4, 40))])
            sid += 1
            sched.add_sequence(s)
            live.append(s)
        out = sched.schedule()
        assert len(running_loras(sched)) <= 2, step
        assert len({s.seq.lora_int_id for s in out.scheduled if s.seq.lora_int_id}) <= 2
        sched.update_after_step(out)
        for s in out.scheduled:
            if s.sample:
                s.seq.append_token(rng.randrange(1000))
                if s.seq.num_output_tokens >= rng.randrange(1, 12):
                    sched.finish_sequence(s.seq, SequenceStatus.FINISHED_LENGTH)
                    live.remove(s.seq)
    for s in list(live):
        sched.finish_sequence(s, SequenceStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_prefix_blocks_are_keyed_by_the_adapter():
    sched, kv = make(max_loras=4)
    prompt = list(range(1, 50))  # 3 full blocks + 1 token
    first = seq(0, 1, prompt)
    sched.add_sequence(first)
    out = sched.schedule()
    sched.update_after_step(out)
    sched.finish_sequence(first, SequenceStatus.FINISHED_STOPPED)  # its blocks stay cached
    same = seq(1, 1, prompt)
    other = seq(2, 2, prompt)
    base = seq(3, 0, prompt)
    assert kv.get_computed_blocks(same)[1] == 48
    assert kv.get_computed_blocks(other)[1] == 0
    assert kv.get_computed_blocks(base)[1] == 0
    # the same adapter id under another identity (reloaded from another path) does not hit either
    moved = seq(4, 1, prompt)
    moved.lora_key = "1:adapter1:/elsewhere"
    assert kv.get_computed_blocks(moved)[1] == 0


class _Manager:
    """A rank's manager as CoreLoRAs sees it: what is loaded and held."""

    def __init__(self) -> None:
        self.loaded: set[int] = set()
        self.held: set[int] = set()

    def load(self, lora) -> None:
        if "bad" in lora.lora_path:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: no adapter_config.json")
        self.loaded.add(lora.lora_int_id)

    def hold(self, i: int) -> None:
        self.held.add(i)

    def release(self, i: int) -> None:
        self.held.discard(i)

    def remove(self, i: int) -> None:
        self.loaded.discard(i)
        self.held.discard(i)


def test_core_registry_holds_adapters_of_live_requests_pins_and_removes_after_the_last():
    import pytest

    from pagedllm.lora.core_registry import CoreLoRAs
    from pagedllm.lora.request import LoRARequest

    m = _Manager()
    reg = CoreLoRAs(m)
    a = LoRARequest("a", 1, "/adapters/a")
    reg.acquire(a)
    reg.acquire(a)
    assert m.held == {1}
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a'"):
        reg.acquire(LoRARequest("b", 1, "/adapters/b"))
    with pytest.raises(ValueError, match="no adapter_config"):
        reg.acquire(LoRARequest("bad", 2, "/bad"))
    assert 2 not in reg.pins and reg.list() == [1]
    assert reg.remove(1) and 1 in m.loaded  # in use: it goes with its last request
    with pytest.raises(ValueError, match="being unloaded"):
        reg.acquire(a)
    reg.release(1)
    assert m.held == {1}
    reg.release(1)
    assert 1 not in m.loaded and reg.list() == []
    reg.add(a)
    assert reg.pin(1) and m.held == {1}
    reg.acquire(a)
    reg.release(1)
    assert m.held == {1}  # pinned: still held after its last request
    assert not reg.pin(9)
    assert reg.remove(1) and m.loaded == set() and not reg.remove(1)
