"""Suffix decoding (vLLM's "suffix" method; Snowflake arctic-inference's SuffixDecodingCache):
draft tokens from suffix trees over the sequence's own prompt and output and over the outputs
of recent requests, with no model.

`SuffixCache` keeps one suffix tree per running sequence (its prompt and output) and a global
tree over the outputs of the most recent requests, asks both and keeps the better draft (its own
on a tie); `SuffixProposer` is the `Proposer` the core calls. The tree itself, and how a draft
is scored, are in spec_decode/suffix_tree.py.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence as SequenceT
from typing import Any

from pagedllm.core.request import SequenceState
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import Proposer
from pagedllm.spec_decode.suffix_tree import Draft, SuffixTree


class SuffixCache:
    """arctic-inference's SuffixDecodingCache, on pagedllm's own trees: a local tree per
    active sequence (its prompt and output) and one global tree over the outputs of the
    last `max_cached_requests` sequences started (FIFO; 0: no global tree). An active
    sequence's output enters the global tree as it is generated, so concurrent requests
    (and the sequence itself) match it at once."""

    def __init__(self, max_depth: int, max_cached_requests: int) -> None:
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}")
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.global_tree = SuffixTree(max_depth)
        self.local: dict[Hashable, SuffixTree] = {}
        self._cached: dict[Hashable, None] = {}  # ids in the global tree, oldest first

    @property
    def cached(self) -> list[Hashable]:
        return list(self._cached)

    def start(self, sid: Hashable, prompt: SequenceT[int]) -> None:
        """A new active sequence: its local tree holds `prompt`; a global slot is taken,
        evicting the oldest cached output beyond the limit."""
        if sid in self.local:
            raise ValueError(f"sequence {sid!r} is already active")
        local = self.local[sid] = SuffixTree(self.max_depth)
        local.extend(0, prompt)
        if self.max_cached_requests == 0:
            return
        if sid in self._cached:
            self.evict(sid)
        self._cached[sid] = None
        self.global_tree.extend(sid, ())
        while len(self._cached) > self.max_cached_requests:
            self.evict(next(iter(self._cached)))

    def add(self, sid: Hashable, tokens: SequenceT[int]) -> None:
        """Output tokens of active sequence `sid`: into its local tree, and into the global
        one while its output is still cached."""
        self.local[sid].extend(0, tokens)
        if sid in self._cached:
            self.global_tree.extend(sid, tokens)

    def stop(self, sid: Hashable, tail: SequenceT[int] = ()) -> None:
        """`sid` finished, its last output tokens `tail` not added yet: they go to the global
        tree, where its output stays until evicted; its local tree goes."""
        del self.local[sid]
        if sid in self._cached:
            self.global_tree.extend(sid, tail)
            self.global_tree.seal(sid)

    def evict(self, sid: Hashable) -> None:
        del self._cached[sid]
        self.global_tree.remove(sid)

    def speculate(self, sid: Hashable, max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float, max_spec_offset: float = 0.0) -> tuple[Draft, bool]:
        """The better of the local and the global draft after `sid`'s tokens (the local one
        on a tie); and whether it is the global one."""
        local = self.local[sid]
        seq = local.tokens(0)
        context = seq[-self.max_depth:]
        draft = local.speculate(context, max_spec_tokens, max_spec_factor, max_spec_offset,
                                min_token_prob, own=0)
        if not self._cached:
            return draft, False
        own = sid if sid in self._cached else None
        other = self.global_tree.speculate(context, max_spec_tokens, max_spec_factor, max_spec_offset,
                                           min_token_prob, own=own)
        if other.score > draft.score:
            return other, True
        return draft, False


class SuffixProposer(Proposer):
    """vLLM's "suffix" method for the engine core. Each sampled sequence is a cache entry
    from its first proposal to its end (an n > 1 request's samples each, as vLLM's child
    requests are: a local tree holds one contiguous prompt + output); the tokens appended
    since its last proposal are added before it speculates, so a preempted sequence picks up
    where it was. `on_finished` hands the last tokens to the global tree and drops the rest."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        if config.method != "suffix":
            raise ValueError(f"SuffixProposer is for method 'suffix', not {config.method!r}.")
        self.config = config
        self.max_model_len = max_model_len
        self.cache = SuffixCache(config.suffix_decoding_max_tree_depth,
                                 config.suffix_decoding_max_cached_requests)
        self._synced: dict[int, int] = {}  # seq id -> its tokens in its local tree
        self.num_local_drafts = 0  # proposals taken from the sequence's own tree
        self.num_global_drafts = 0  # ... from the global tree

    @property
    def num_active(self) -> int:
        """Sequences with per-sequence state (a local tree)."""
        return len(self._synced)

    def propose(self, running: Iterable[tuple[SequenceState, Any]]) -> int:
        """Bring each (sequence, its sampling params) up to date in the cache and set its
        `spec_token_ids` (at most `max_draft_len`); the number given a proposal."""
        cfg = self.config
        cache = self.cache
        n = 0
        for seq, params in running:
            sid = seq.seq_id
            total = seq.num_tokens
            synced = self._synced.get(sid)
            if synced is None or synced > total:
                if synced is not None:  # never expected: its tokens were rewritten
                    cache.stop(sid)
                cache.start(sid, seq.prompt_token_ids)
                synced = seq.prompt_len
            if synced < total:
                cache.add(sid, seq.token_ids_slice(synced, total))
            self._synced[sid] = total
            k = self.max_draft_len(seq, params)
            if k <= 0:
                continue
            draft, from_global = cache.speculate(sid, k, cfg.suffix_decoding_max_spec_factor,
                                                 cfg.suffix_decoding_min_token_prob)
            if draft.token_ids:
                seq.spec_token_ids = draft.token_ids
                n += 1
                if from_global:
                    self.num_global_drafts += 1
                else:
                    self.num_local_drafts += 1
        return n

    def on_finished(self, seq: SequenceState) -> None:
        """`seq` ended (finished, stopped, aborted): its output so far is in the global tree
        (cached until evicted); its local tree goes."""
        synced = self._synced.pop(seq.seq_id, None)
        if synced is not None:
            self.cache.stop(seq.seq_id, seq.token_ids_slice(synced, seq.num_tokens))


__all__ = ["SuffixCache", "SuffixProposer"]
