"""Suffix decoding (no model): the suffix tree against a brute-force reference (counts, the
longest match, proposals), the probability threshold, the spec-factor cap, FIFO eviction of
the global cache, incremental growth equal to a rebuild, the proposer's bookkeeping (no
state left after a finish or an abort), and the config."""

from __future__ import annotations

import gc
import random

import pytest

from pagedllm.core.request import SequenceState
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer_choice import BUILT_METHODS, make_proposer
from pagedllm.spec_decode.suffix import SuffixCache, SuffixProposer
from pagedllm.spec_decode.suffix_tree import SuffixTree, _walk

# ---- the brute-force reference ------------------------------------------------------------


def bf_count(seqs: list[list[int]], pattern: list[int]) -> int:
    """Occurrences of `pattern` in the sequences."""
    m = len(pattern)
    return sum(s[i:i + m] == pattern for s in seqs for i in range(len(s) - m + 1))


def bf_trie(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Every substring of at most `depth` tokens and how often it occurs."""
    out: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                key = tuple(s[i:i + n])
                out[key] = out.get(key, 0) + 1
    return out


def bf_speculate(seqs, depth, context, k, factor=1.0, offset=0.0, min_prob=0.1):
    """arctic-inference's rule on the uncompressed trie: every match length m = 1 ..
    len(context) - 1 (stop at the first that does not occur), from each the most frequent
    next token (ties: the smallest) while prob >= min_prob, at most min(k, m * factor +
    offset) tokens and never past `depth`; the best score wins, a longer match on a tie.
    Returns (tokens, score, match_len)."""
    context = list(context[-depth:])
    vocab = sorted({t for s in seqs for t in s})
    best = ([], 0.0, 0)
    for m in range(1, len(context)):
        cur = context[-m:]
        count = bf_count(seqs, cur)
        if count == 0:
            break
        limit = max(min(k, int(m * factor + offset + 1e-6)), 0)
        tokens, score, prob = [], 0.0, 1.0
        while len(tokens) < limit and len(cur) < depth:
            counts = [(bf_count(seqs, cur + [t]), -t) for t in vocab]
            c, neg = max(counts) if counts else (0, 0)
            if c == 0:
                break
            prob *= c / count  # 1 within a compressed edge: the product is unchanged
            if prob < min_prob:
                break
            tokens.append(-neg)
            score += prob
            cur, count = cur + [-neg], c
        if score >= best[1]:
            best = (tokens, score, m)
    return best


def grow(rng: random.Random, tree: SuffixTree, seqs: dict, steps: int, vocab: int, ids) -> None:
    for _ in range(steps):
        sid = rng.choice(ids)
        tok = rng.randrange(vocab)
        tree.append(sid, tok)
        seqs.setdefault(sid, []).append(tok)


def trie_of(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    return {path: c for path, c in tree.nodes() if path}


# ---- the tree -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(120))
def test_counts_equal_brute_force_with_interleaved_growth_and_removal(seed):
    rng = random.Random(seed)
    depth, vocab = rng.randint(1, 8), rng.randint(1, 5)
    tree, seqs = SuffixTree(depth), {}
    grow(rng, tree, seqs, rng.randint(0, 80), vocab, range(rng.randint(1, 4)))
    tree.check_invariants()
    assert trie_of(tree) == bf_trie(list(seqs.values()), depth)
    assert tree.root.count == sum(map(len, seqs.values()))
    for sid in rng.sample(sorted(seqs), rng.randint(0, len(seqs))):
        tokens = tree.tokens(sid)
        tree.remove(sid)
        del seqs[sid]
        tree.check_invariants()
        assert trie_of(tree) == bf_trie(list(seqs.values()), depth)
        # no node points into the removed sequence's token list any more
        assert all(node.seq is not tokens for node in _walk(tree.root))
    if seqs:  # growth goes on after removals
        grow(rng, tree, seqs, rng.randint(0, 40), vocab, sorted(seqs))
        tree.check_invariants()
        assert trie_of(tree) == bf_trie(list(seqs.values()), depth)


@pytest.mark.parametrize("seed", range(150))
def test_speculate_equals_brute_force(seed):
    rng = random.Random(1000 + seed)
    depth, vocab = rng.randint(2, 9), rng.randint(1, 4)
    tree, seqs = SuffixTree(depth), {}
    grow(rng, tree, seqs, rng.randint(1, 70), vocab, range(rng.randint(1, 3)))
    k = rng.randint(1, 10)
    factor = rng.choice([0.0, 0.5, 1.0, 2.0, 3.5])
    offset = rng.choice([0.0, 0.0, 1.0, -1.0])
    min_prob = rng.choice([0.0, 0.1, 0.3, 0.5, 0.9, 1.0])
    for trial in range(6):
        if trial % 2 == 0:  # a sequence's own tail, matched through its unfinished strings
            sid = rng.choice(sorted(seqs))
            context, own = seqs[sid][-rng.randint(1, depth + 2):], sid
        else:
            context, own = [rng.randrange(vocab + 1) for _ in range(rng.randint(0, depth + 3))], None
        draft = tree.speculate(context, k, factor, offset, min_prob, own=own)
        tokens, score, match_len = bf_speculate(list(seqs.values()), depth, context, k, factor, offset, min_prob)
        assert (draft.token_ids, draft.score, draft.match_len) == (tokens, score, match_len)
        assert len(draft.probs) == len(draft.token_ids) and all(p >= min_prob for p in draft.probs)
        assert draft.score == pytest.approx(sum(draft.probs))


def test_the_longest_match_and_the_most_frequent_continuation():
    tree = SuffixTree(8)
    tree.extend("a", [1, 2, 3, 4, 9, 2, 3, 5, 2, 3, 5, 7, 1, 2, 3])
    # after [2, 3] come 4 once and 5 twice (+ the trailing occurrence): 5; after [1, 2, 3], 4
    assert tree.count([2, 3]) == 4 and tree.count([2, 3, 5]) == 2 and tree.count([1, 2, 3]) == 2
    draft = tree.speculate([7, 1, 2, 3], 4, max_spec_factor=1.0, min_token_prob=0.1)
    assert draft.match_len == 3 and draft.token_ids == [4, 9, 2]  # m = 3 allows 3 tokens
    assert draft.probs == [0.5, 0.5, 0.5]
    short = tree.speculate([9, 2, 3], 4, max_spec_factor=4.0)
    # a three-token context tries m = 1, 2; [3] and [2, 3] both give [5, 2, 3, 5]: the longer wins
    assert short.match_len == 2 and short.token_ids[:1] == [5] and short.probs[0] == 0.5
    assert tree.speculate([6, 6], 4).token_ids == []  # nothing matches
    assert tree.speculate([3], 4).token_ids == []  # a context of one token has no match length


def test_probability_threshold_cuts_the_path():
    tree = SuffixTree(16)
    # after [8, 9]: 1 (three times) or 2 (once); after [8, 9, 1]: 5 twice, 6 once
    for sid, tail in enumerate([[1, 5], [1, 5], [1, 6], [2, 7]]):
        tree.extend(sid, [8, 9] + tail)
    context = [0, 8, 9]
    d = tree.speculate(context, 8, max_spec_factor=8.0, min_token_prob=0.45)
    assert d.token_ids == [1, 5] and d.probs == pytest.approx([0.75, 0.5]) and d.match_len == 2
    d = tree.speculate(context, 8, max_spec_factor=8.0, min_token_prob=0.6)
    assert d.token_ids == [1] and d.probs == [0.75]  # 0.75 * 2/3 = 0.5 < 0.6
    assert tree.speculate(context, 8, max_spec_factor=8.0, min_token_prob=0.8).token_ids == []
    # the threshold is inclusive (vLLM: "greater than or equal to")
    assert tree.speculate(context, 8, max_spec_factor=8.0, min_token_prob=0.75).token_ids == [1]


def test_spec_factor_caps_the_draft_by_the_match_length():
    tree = SuffixTree(24)
    seq = list(range(1, 11)) + list(range(1, 6))  # 1..10 then 1..5: the tail [1..5] matched
    tree.extend(0, seq)
    full = tree.speculate(seq, 8, max_spec_factor=1.0, own=0)
    assert full.match_len == 5 and full.token_ids == [6, 7, 8, 9, 10]
    half = tree.speculate(seq, 8, max_spec_factor=0.5, own=0)
    assert half.token_ids == [6, 7] and len(half.token_ids) <= int(half.match_len * 0.5)
    assert tree.speculate(seq, 8, max_spec_factor=0.0, own=0).token_ids == []
    assert tree.speculate(seq, 3, max_spec_factor=4.0, own=0).token_ids == [6, 7, 8]  # k caps too
    # the offset (arctic's max_spec_offset) shifts the cap
    assert tree.speculate(seq, 8, max_spec_factor=0.5, max_spec_offset=1.0, own=0).token_ids == [6, 7, 8]


def test_the_tree_depth_bounds_match_plus_draft():
    tree = SuffixTree(4)
    seq = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    tree.extend(0, seq)
    d = tree.speculate(seq, 10, max_spec_factor=10.0, own=0)
    assert d.match_len + len(d.token_ids) <= 4 and d.token_ids and d.token_ids[0] == 4


@pytest.mark.parametrize("seed", range(40))
def test_incremental_equals_rebuilt(seed):
    """Interleaved growth, speculation and removals give the tree (and the drafts) that
    inserting the surviving sequences whole into a new tree gives: a draft depends only on
    the tree's contents."""
    rng = random.Random(5000 + seed)
    depth, vocab = rng.randint(2, 10), rng.randint(2, 6)
    tree, seqs = SuffixTree(depth), {}
    ids = list(range(5))
    for _ in range(rng.randint(20, 120)):
        grow(rng, tree, seqs, 1, vocab, ids)
        if rng.random() < 0.3:
            sid = rng.choice(sorted(seqs))
            tree.speculate(seqs[sid], 4, own=sid)
        if rng.random() < 0.03 and len(seqs) > 1:
            sid = rng.choice(sorted(seqs))
            tree.remove(sid)
            del seqs[sid]
            ids.remove(sid)
            ids.append(max(ids) + 1)
    rebuilt = SuffixTree(depth)
    for sid in rng.sample(sorted(seqs), len(seqs)):
        rebuilt.extend(sid, seqs[sid])
    tree.check_invariants()
    rebuilt.check_invariants()
    assert trie_of(tree) == trie_of(rebuilt)
    for _ in range(20):
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, depth + 2))]
        a = tree.speculate(context, 6, 2.0, 0.0, 0.2)
        b = rebuilt.speculate(context, 6, 2.0, 0.0, 0.2)
        assert (a.token_ids, a.score, a.match_len) == (b.token_ids, b.score, b.match_len)


# ---- the cache: local and global trees ----------------------------------------------------


def cache_reference(prompt, output, global_outputs, depth, k, factor, min_prob):
    """The cache's choice: the local draft unless the global one scores higher."""
    seq = prompt + output
    local = bf_speculate([seq], depth, seq, k, factor, 0.0, min_prob)
    if not global_outputs:
        return local[0], False
    glob = bf_speculate(global_outputs, depth, seq, k, factor, 0.0, min_prob)
    return (glob[0], True) if glob[1] > local[1] else (local[0], False)


@pytest.mark.parametrize("seed", range(40))
def test_cache_equals_brute_force(seed):
    rng = random.Random(9000 + seed)
    depth, vocab, k = rng.randint(2, 8), rng.randint(2, 5), rng.randint(1, 6)
    cap = rng.randint(1, 4)
    cache = SuffixCache(depth, cap)
    prompts, outputs, started = {}, {}, []
    active: list[int] = []
    for step in range(rng.randint(10, 60)):
        if not active or (rng.random() < 0.15 and len(active) < 3):
            sid = len(started)
            prompts[sid] = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
            outputs[sid] = []
            cache.start(sid, prompts[sid])
            started.append(sid)
            active.append(sid)
        sid = rng.choice(active)
        tok = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        cache.add(sid, tok)
        outputs[sid] += tok
        cached = started[-cap:]
        assert cache.cached == cached
        draft, from_global = cache.speculate(sid, k, 1.0, 0.1)
        want = cache_reference(prompts[sid], outputs[sid], [outputs[c] for c in cached], depth, k, 1.0, 0.1)
        assert (draft.token_ids, from_global) == want
        if rng.random() < 0.2:
            cache.stop(sid)
            active.remove(sid)
    cache.global_tree.check_invariants()
    assert trie_of(cache.global_tree) == bf_trie([outputs[c] for c in started[-cap:]], depth)


def test_global_cache_evicts_the_oldest_at_max_cached_requests():
    cache = SuffixCache(8, 3)
    lists = {}
    for sid in range(5):
        cache.start(sid, [100 + sid])
        cache.add(sid, [sid, sid + 1, sid + 2])
        lists[sid] = cache.global_tree.tokens(sid)
        cache.stop(sid, [sid + 3])
    assert cache.cached == [2, 3, 4] and len(cache.global_tree) == 3 and not cache.local
    assert trie_of(cache.global_tree) == bf_trie([[s, s + 1, s + 2, s + 3] for s in (2, 3, 4)], 8)
    assert cache.global_tree.count([0, 1]) == 0 and cache.global_tree.count([4, 5]) == 3
    for sid in (0, 1):  # evicted: nothing keeps their token lists
        assert all(node.seq is not lists[sid] for node in _walk(cache.global_tree.root))
    # an active sequence whose slot is evicted keeps its local tree, and feeds no global one
    cache.start("a", [1, 2, 3])
    for sid in "bcd":
        cache.start(sid, [])
    assert "a" not in cache.cached and "a" in cache.local
    cache.add("a", [9, 9])
    assert cache.global_tree.count([9]) == 0 and cache.local["a"].count([9]) == 2
    cache.stop("a")
    # max_cached_requests = 0: no global tree at all; prompts still serve
    off = SuffixCache(8, 0)
    off.start(1, [5, 6, 7, 5, 6])
    off.add(1, [7])
    assert len(off.global_tree) == 0 and off.speculate(1, 4, 1.0, 0.1)[0].token_ids == [5, 6, 7]


def test_a_drafted_continuation_from_a_finished_request():
    cache = SuffixCache(24, 10)
    cache.start("first", [1, 2])
    cache.add("first", [10, 11, 12, 13, 14, 15])
    cache.stop("first")
    cache.start("second", [3, 4])
    cache.add("second", [10, 11, 12])
    draft, from_global = cache.speculate("second", 8, 1.0, 0.1)
    # the global tree has [10, 11, 12] twice (first's and second's own): 13 with prob 1/2
    assert from_global and draft.token_ids == [13, 14, 15] and draft.match_len == 3


# ---- the proposer -------------------------------------------------------------------------

CFG = SpeculativeConfig.from_value({"method": "suffix", "num_speculative_tokens": 4,
                                    "suffix_decoding_max_cached_requests": 2})


def _seq(seq_id: int, prompt: list[int], output: list[int], rid: str = "r") -> SequenceState:
    return SequenceState(seq_id=seq_id, request_id=rid, prompt_token_ids=prompt, arrival_time=0.0,
                    output_token_ids=list(output))


def test_proposer_drafts_within_max_draft_len_and_grows_incrementally():
    prop = make_proposer(CFG, max_model_len=64)
    assert isinstance(prop, SuffixProposer) and "suffix" in BUILT_METHODS
    text = [1, 2, 3, 4, 5, 6, 7, 8]
    seq = _seq(0, text + [1, 2], [3])
    params = SamplingParams(max_tokens=50)
    # [1, 2, 3] matched: at most 3 tokens (max_spec_factor 1)
    assert prop.propose([(seq, params)]) == 1 and seq.spec_token_ids == [4, 5, 6]
    seq.output_token_ids += [4, 5]  # two accepted
    seq.spec_token_ids = []
    prop.propose([(seq, params)])
    assert seq.spec_token_ids == [6, 7, 8, 1]  # (text, 1, 2 repeated)
    assert prop.cache.local[0].tokens(0) == seq.all_token_ids  # appended, not rebuilt
    near_end = SamplingParams(max_tokens=5)  # 3 out, a token is always drawn after the draft
    seq.spec_token_ids = []
    prop.propose([(seq, near_end)])
    assert seq.spec_token_ids == [6]
    tight = make_proposer(CFG, max_model_len=seq.num_tokens + 2)
    other = _seq(1, list(seq.prompt_token_ids), seq.output_token_ids)
    tight.propose([(other, params)])
    assert len(other.spec_token_ids) == 2


def test_proposer_keeps_no_state_after_finish_or_abort():
    prop = make_proposer(CFG, max_model_len=128)
    params = SamplingParams(max_tokens=50)
    a = _seq(0, [1, 2, 3, 1, 2], [3], rid="a")
    b0, b1 = _seq(1, [7, 8, 9], [7], rid="b"), _seq(2, [7, 8, 9], [6], rid="b")  # n = 2
    prop.propose([(a, params), (b0, params), (b1, params)])
    assert prop.num_active == 3 and set(prop.cache.local) == {0, 1, 2}  # a tree per sample
    a.output_token_ids += [1, 2, 3]
    prop.on_finished(a)  # finished: its last tokens reach the global tree
    assert prop.num_active == 2 and 0 not in prop.cache.local
    assert prop.cache.cached == [1, 2]  # but the global cache holds two: a's output was evicted
    prop.on_finished(b0)
    prop.on_finished(b1)  # aborted the same way: the core calls on_finished for every exit
    prop.on_finished(b1)  # twice, or for a sequence never proposed for: nothing happens
    prop.on_finished(_seq(9, [1], [2]))
    assert prop.num_active == 0 and not prop.cache.local and not prop.cache.global_tree._active
    gc.collect()


def test_finished_output_serves_the_next_request():
    prop = make_proposer(CFG, max_model_len=128)
    params = SamplingParams(max_tokens=50)
    first = _seq(0, [50, 51], [60])
    prop.propose([(first, params)])
    first.output_token_ids += [61, 62, 63, 64, 65]
    prop.on_finished(first)
    second = _seq(1, [52, 60, 61], [62])  # its prompt and output repeat first's output
    prop.propose([(second, params)])
    assert second.spec_token_ids == [63, 64, 65] and prop.num_global_drafts == 1


# ---- the config ---------------------------------------------------------------------------


def test_suffix_config_defaults():
    c = SpeculativeConfig.from_value({"method": "suffix", "num_speculative_tokens": 5})
    assert (c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
            c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    # vLLM: without num_speculative_tokens the tree depth is the cap
    assert SpeculativeConfig.from_value({"method": "suffix"}).num_speculative_tokens == 24
    c = SpeculativeConfig.from_value({"method": "suffix", "suffix_decoding_max_tree_depth": 8,
                                      "suffix_decoding_max_cached_requests": 0})
    assert c.num_speculative_tokens == 8 and c.suffix_decoding_max_cached_requests == 0


@pytest.mark.parametrize("value, words", [
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be a positive integer"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests must be an integer >= 0"),
    ({"suffix_decoding_max_cached_requests": 1.5}, "suffix_decoding_max_cached_requests"),
    ({"suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor must be a finite number"),
    ({"suffix_decoding_max_spec_factor": float("inf")}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be in [0, 1]"),
    ({"suffix_decoding_min_token_prob": float("nan")}, "suffix_decoding_min_token_prob"),
    ({"suffix_decoding_min_token_prob": "0.1"}, "suffix_decoding_min_token_prob"),
    ({"prompt_lookup_max": 3}, "for method 'ngram'"),
])
def test_suffix_config_refusals(value, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.from_value({"method": "suffix", "num_speculative_tokens": 4, **value})
