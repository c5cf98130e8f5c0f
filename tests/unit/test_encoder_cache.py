"""The encoder cache and the scheduler (core/encoder_cache.py): chunks cut before an image
without rows, each image encoded once and shared, budget and capacity, eviction of unneeded
rows only, images kept whole where the model needs it, and prefix-cache blocks keyed by each
image's content hash. No model: features carry no tensors."""

from __future__ import annotations

import hashlib

import pytest

from pagedllm.core.encoder_cache import EncoderCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import SchedulerConfig
from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRun, runs_in

IMG = 99  # the placeholder token


def image(name: str, offset: int, length: int, whole: bool = False, runs=None) -> MultiModalFeature:
    runs = runs or [(offset, length)]
    placed, row = [], 0
    for off, n in runs:
        placed.append(PlaceholderRun(off, n, row))
        row += n
    return MultiModalFeature("image", hashlib.sha256(name.encode()).digest(), placed, {}, whole)


def seq(seq_id: int, prompt_len: int, *features: MultiModalFeature) -> SequenceState:
    ids = [seq_id * 1000 + i for i in range(prompt_len)]
    for f in features:
        for r in f.runs:
            ids[r.offset:r.offset + r.length] = [IMG] * r.length
    return SequenceState(seq_id, f"r{seq_id}", ids, float(seq_id), mm_features=tuple(features))


def same_prompt(seq_id: int, other: SequenceState, *features: MultiModalFeature) -> SequenceState:
    return SequenceState(seq_id, f"r{seq_id}", list(other.prompt_token_ids), float(seq_id),
                         mm_features=tuple(features))


def scheduler(budget=64, enc_budget=64, enc_cache=64, num_blocks=64, caching=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_encoder_input_tokens=enc_budget,
                                     encoder_cache_size=enc_cache, max_model_len=256), kv)


def run(sched: Scheduler):
    out = sched.schedule()
    sched.update_after_step(out)
    for s in out.scheduled:
        if s.sample:
            s.seq.append_token(7)
    return out


def test_chunk_inside_an_image_takes_its_rows_from_the_one_encoding():
    sched = scheduler(budget=6)
    a = seq(0, 20, image("cat", 3, 8))
    sched.add_sequence(a)
    out = run(sched)
    assert [len(s.token_ids) for s in out.scheduled] == [6]
    assert [f.content_hash for f in out.encoder_inputs] == [image("cat", 3, 8).content_hash]
    assert out.scheduled[0].mm_runs == [(image("cat", 3, 8).content_hash, 3, 3, 0)]
    out = run(sched)  # the rest of the image: rows 3..7, no second encoding
    assert out.encoder_inputs == [] and out.scheduled[0].mm_runs == [(image("cat", 3, 8).content_hash, 6, 5, 3)]
    assert sched.encoder_cache.users[image("cat", 3, 8).content_hash] == set()  # passed: no longer needed


def test_a_chunk_is_cut_before_an_image_the_step_budget_cannot_encode():
    sched = scheduler(budget=64, enc_budget=10, enc_cache=64)
    a, b = seq(0, 20, image("a", 2, 8)), seq(1, 20, image("b", 5, 8))
    sched.add_sequence(a)
    sched.add_sequence(b)
    out = run(sched)
    assert [(s.seq.seq_id, len(s.token_ids)) for s in out.scheduled] == [(0, 20), (1, 5)]  # b stops before its image
    assert len(out.encoder_inputs) == 1
    out = run(sched)
    assert [f.content_hash for f in out.encoder_inputs] == [image("b", 5, 8).content_hash]


def test_the_same_image_in_two_requests_is_encoded_once_and_counted_as_a_hit():
    sched = scheduler()
    a = seq(0, 20, image("cat", 3, 8))
    sched.add_sequence(a)
    out = run(sched)
    assert len(out.encoder_inputs) == 1
    b = seq(1, 30, image("cat", 10, 8))  # other text, the same picture
    sched.add_sequence(b)
    out = run(sched)
    assert out.encoder_inputs == [] and sched.encoder_cache.hits == 1 and sched.encoder_cache.queries == 2


def test_eviction_drops_only_unneeded_rows_and_tells_the_runner():
    sched = scheduler(enc_cache=10, enc_budget=10)
    a = seq(0, 12, image("a", 0, 8))
    sched.add_sequence(a)
    run(sched)  # a's image computed and passed
    b = seq(1, 12, image("b", 0, 8))
    sched.add_sequence(b)
    out = run(sched)
    assert out.freed_encoder_hashes == [image("a", 0, 8).content_hash]
    assert [f.content_hash for f in out.encoder_inputs] == [image("b", 0, 8).content_hash]


def test_rows_a_sequence_still_needs_are_never_evicted():
    sched = scheduler(budget=4, enc_cache=10, enc_budget=10)
    a, b = seq(0, 16, image("a", 2, 8)), seq(1, 16, image("b", 2, 8))
    sched.add_sequence(a)
    out = run(sched)  # a is inside its image: its rows are needed
    assert len(out.encoder_inputs) == 1
    sched.add_sequence(b)
    for _ in range(2):
        out = run(sched)
        assert image("a", 2, 8).content_hash not in out.freed_encoder_hashes
    assert b.num_computed_tokens <= 2  # b waits before its image until a's rows are no longer needed


def test_an_image_the_cache_could_never_hold_is_refused():
    cache = EncoderCacheManager(16, 8)
    with pytest.raises(ValueError, match="takes 12 embedding rows, more than the encoder cache"):
        cache.check_item_fits(12)


def test_whole_images_are_never_cut_by_a_chunk():
    sched = scheduler(budget=8)
    a = seq(0, 20, image("a", 4, 6, whole=True))
    sched.add_sequence(a)
    out = run(sched)
    assert len(out.scheduled[0].token_ids) == 4  # up to the image, not into it
    out = run(sched)
    assert len(out.scheduled[0].token_ids) == 8 and out.scheduled[0].mm_runs[0][1:3] == (4, 6)


def test_preemption_releases_the_rows_a_sequence_held():
    sched = scheduler(budget=4)
    a = seq(0, 16, image("a", 2, 8))
    sched.add_sequence(a)
    run(sched)
    h = image("a", 2, 8).content_hash
    assert sched.encoder_cache.users[h] == {0}
    sched._preempt_by_recompute(a)
    assert sched.encoder_cache.users[h] == set() and not sched.encoder_cache.held.get(0)


@pytest.mark.parametrize("same", [True, False])
def test_prefix_cache_blocks_are_keyed_by_the_image(same):
    """Two prompts with the same tokens (placeholders included) share blocks only when the
    image is the same: the hash of a block an image's rows fill includes its content hash."""
    sched = scheduler()
    a = seq(0, 20, image("cat", 4, 8))
    sched.add_sequence(a)
    run(sched)
    b = same_prompt(1, a, image("cat" if same else "dog", 4, 8))
    sched.add_sequence(b)
    run(sched)
    # blocks of 4: block 0 (positions 0-3) holds no image and is shared either way
    assert b.num_cached_tokens == (16 if same else 4)


def test_runs_in_clips_runs_to_the_chunk():
    f = image("tiles", 0, 0, runs=[(2, 3), (7, 4)])
    assert runs_in([f], 3, 9) == [(f.content_hash, 3, 2, 1), (f.content_hash, 7, 2, 3)]
