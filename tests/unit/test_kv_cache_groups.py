"""core/kv_cache_groups.py, no model: layers grouped by attention type with equal slot counts,
window arithmetic with exact block counts, and the theoretical minimum the issue measures
against."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_groups import KVCacheGroup, KVCacheGroups, group_layers


def test_one_attention_type_is_one_group_of_every_layer():
    for windows in ([None] * 30, [2047] * 32):
        g = group_layers(windows)
        assert not g.is_hybrid and g.slots == len(windows)
        assert g.groups[0].layer_ids == tuple(range(len(windows)))
        assert g.groups[0].sliding_window == windows[0]


def test_gemma2_alternating_layers_make_two_groups_of_half_the_layers():
    windows = [4096 if i % 2 == 0 else None for i in range(26)]
    g = group_layers(windows)
    assert g.slots == 13 and len(g.groups) == 2
    assert g.groups[0].sliding_window is None and g.groups[0].layer_ids == tuple(range(1, 26, 2))
    assert g.groups[1].sliding_window == 4096 and g.groups[1].layer_ids == tuple(range(0, 26, 2))
    assert g.layer_slot()[0] == (1, 0) and g.layer_slot()[25] == (0, 12)


def test_gemma3_five_to_one_groups_by_the_rarer_type_with_one_partial_group():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # full at 5, 11, 17, 23
    g = group_layers(windows)
    assert g.slots == 4
    assert [len(x.layer_ids) for x in g.groups] == [4, 4, 4, 4, 4, 4, 2]
    assert g.groups[0].layer_ids == (5, 11, 17, 23)
    assert sorted(layer for x in g.groups for layer in x.layer_ids) == list(range(26))
    assert g.num_layers == 26


def test_bad_windows_are_refused_by_layer():
    with pytest.raises(ValueError, match="layer 2: sliding window"):
        group_layers([None, 8, 0])
    with pytest.raises(ValueError, match="at least one"):
        group_layers([])


@pytest.mark.parametrize("window,block_size", [(1, 4), (4, 4), (5, 4), (8, 4), (512, 16), (7, 16)])
def test_dead_and_live_blocks_match_a_brute_force_over_positions(window, block_size):
    group = KVCacheGroup((0,), window)
    most = 0
    for computed in range(0, 6 * window + 3 * block_size):
        # keys readable by the next query (position `computed`) or any later one
        live = [k for k in range(computed + 1) if computed - k < window]
        first_block = min(live) // block_size
        assert group.num_dead_blocks(computed, block_size) == first_block
        held = -(-(computed + 1) // block_size) - first_block  # a decode step's table span
        most = max(most, held)
    assert group.max_live_blocks(10**6, block_size) == most


def test_full_group_never_drops_a_block():
    group = KVCacheGroup((0, 1), None)
    assert group.num_dead_blocks(10_000, 16) == 0
    assert group.max_live_blocks(1000, 16) == 63


def test_gemma3_at_8k_holds_close_to_the_theoretical_minimum():
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(34)]  # Gemma 3 4B's shape
    g = group_layers(windows)
    B, L = 16, 8192
    held = g.layer_blocks_per_sequence(L, B)
    minimum = KVCacheGroups.theoretical_min_layer_blocks(windows, L, B)
    everything = len(windows) * (L // B)
    assert minimum <= held <= 1.1 * minimum, (held, minimum)
    assert everything / held > 3.5  # the issue's ~3.9x more concurrent 8k sequences


def test_groups_from_hf_configs():
    """Full attention everywhere: no groups (the manager it always was); one window everywhere
    (Mistral, Phi-3-mini-4k): one sliding group; Qwen2/3 sliding above max_window_layers and
    Gemma's layer_types: mixed groups; the flag turns them all off."""
    from types import SimpleNamespace as NS

    from pagedllm.core.kv_cache_groups import hybrid_kv_cache_groups

    llama = NS(model_type="llama", num_hidden_layers=4, sliding_window=None)
    mistral = NS(model_type="mistral", num_hidden_layers=4, sliding_window=16)
    qwen2 = NS(model_type="qwen2", num_hidden_layers=4, sliding_window=16, use_sliding_window=True,
               max_window_layers=1)
    qwen2_off = NS(model_type="qwen2", num_hidden_layers=4, sliding_window=16, use_sliding_window=False)
    gemma = NS(model_type="gemma2", num_hidden_layers=4, sliding_window=16,
               layer_types=["sliding_attention", "full_attention"] * 2)
    assert hybrid_kv_cache_groups(llama) is None and hybrid_kv_cache_groups(qwen2_off) is None
    one = hybrid_kv_cache_groups(mistral)
    assert not one.is_hybrid and one.has_null_block and one.groups[0].layer_ids == (0, 1, 2, 3)
    mixed = hybrid_kv_cache_groups(qwen2)
    assert [g.sliding_window for g in mixed.groups] == [None, 16, 16, 16] and mixed.slots == 1
    assert [g.layer_ids for g in hybrid_kv_cache_groups(gemma).groups] == [(1, 3), (0, 2)]
    assert all(hybrid_kv_cache_groups(c, disabled=True) is None for c in (mistral, qwen2, gemma))


def test_the_hand_shake_gives_the_front_end_the_cores_groups():
    """The API process builds its KV cache groups from the windows in the core's hand-shake
    (no model config there): the same groups as the core's, none where the core has none."""
    from types import SimpleNamespace as NS

    from pagedllm.core.kv_cache_groups import hybrid_groups_of_windows, hybrid_kv_cache_groups
    from pagedllm.engine.core_messages import ready_info
    from pagedllm.engine.core_messages import CoreReady, decode_ready, encode

    gemma = NS(model_type="gemma2", num_hidden_layers=4, sliding_window=16,
               layer_types=["sliding_attention", "full_attention"] * 2)
    llama = NS(model_type="llama", num_hidden_layers=4, sliding_window=None)
    for hf_config, disabled in ((gemma, False), (gemma, True), (llama, False)):
        core = NS(hf_config=hf_config, kv_cache_groups=hybrid_kv_cache_groups(hf_config, disabled))
        ready = decode_ready(encode(ready_info(core)))
        assert isinstance(ready, CoreReady)
        assert hybrid_groups_of_windows(ready.hybrid_layer_windows) == core.kv_cache_groups
