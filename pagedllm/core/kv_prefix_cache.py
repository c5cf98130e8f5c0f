"""Prefix caching: full blocks hashed by their tokens, looked up and shared by later sequences.

A block's chain hash covers every token before it (the first block keyed by `cache_salt`, the
long-context regime and the LoRA adapter; a block an image's rows fill keyed by the image's
content hash); a hit serves every KV cache group (a sliding group
only the blocks its window reads). Apart from allocation because hashing and lookup are
their own rules (what may be shared), while allocation decides what is held.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockHash, KVBlock, hash_block_tokens
from pagedllm.core.kv_block_tables import KVBlockTables
from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.request import SequenceState

# Prefix hits: one list of blocks (one group), or one list per group (hybrid).
PrefixHits = list


class KVPrefixCache(KVBlockTables):
    """Look up, publish and check prefix-cache blocks."""

    def _block_hash(
        self, seq: SequenceState, index: int, parent_hash: BlockHash | None
    ) -> BlockHash:
        start = index * self.block_size
        tokens = seq.token_ids_slice(start, start + self.block_size)
        # The salt, the long-context regime and the LoRA adapter key the first block only:
        # every later hash chains from it.
        extra = None
        if index == 0 and (seq.cache_salt is not None or seq.long_context or seq.lora_key is not None):
            extra = ((seq.cache_salt,) + (("long-context",) if seq.long_context else ())
                     + (("lora", seq.lora_key) if seq.lora_key is not None else ()))
        if seq.mm_features:
            # An image's placeholder tokens are the same for every image: the blocks its rows
            # fill are keyed by its content hash too (two images never share a block).
            images = tuple(("image", f.content_hash) for f in seq.mm_features
                           if f.overlaps(start, start + self.block_size))
            if images:
                extra = (extra or ()) + images
        return hash_block_tokens(parent_hash, tokens, extra)

    @staticmethod
    def _group_key(group: int, block_hash: BlockHash) -> BlockHash:
        """The pool's key of a block of `group` (group 0: the chain hash itself, as always)."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def get_computed_blocks(self, seq: SequenceState) -> tuple[PrefixHits, int]:
        """Longest run of cached full blocks at the start of `seq`, and the tokens they hold.

        Only the first `num_tokens - 1` tokens are looked up: the last one is always recomputed
        because its logits are needed. Takes no references and counts nothing: the hit and
        query counters move when `allocate_slots` admits the sequence, so that a sequence
        looked up in several steps before it fits is counted once. Hybrid: one list per group
        (a sliding group's dead positions null), or [] when nothing hits.
        """
        if not self._uses_prefix_cache(seq):
            return [], 0
        if not self.is_hybrid:
            blocks: list[KVBlock] = []
            parent: BlockHash | None = None
            for i in range((seq.num_tokens - 1) // self.block_size):
                parent = self._block_hash(seq, i, parent)
                block = self.block_pool.get_cached_block(parent)
                if block is None:
                    break
                blocks.append(block)
            return blocks, len(blocks) * self.block_size
        hashes: list[BlockHash] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            hashes.append(self._block_hash(seq, i, hashes[-1] if hashes else None))
        cached = [[self.block_pool.get_cached_block(self._group_key(g, h)) for h in hashes]
                  for g in range(len(self.groups))]
        length = len(hashes)
        changed = True
        while changed and length > 0:  # each group lowers the length it cannot serve
            changed = False
            for g, group in enumerate(self.groups):
                served = self._servable_length(group, cached[g], length)
                if served < length:
                    length, changed = served, True
        if length == 0:
            return [], 0
        B = self.block_size
        hits = []
        for g, group in enumerate(self.groups):
            dead = group.num_dead_blocks(length * B, B)
            hits.append([self.null_block] * dead + cached[g][dead:length])
        return hits, length * B

    def _servable_length(self, group: KVCacheGroup, cached: list[KVBlock | None],
                         length: int) -> int:
        """The longest hit <= `length` blocks this group can give: a full group its leading
        cached run; a sliding group an end h whose window's blocks are all cached."""
        if not group.is_sliding:
            n = 0
            while n < length and cached[n] is not None:
                n += 1
            return n
        B = self.block_size
        for h in range(length, 0, -1):
            dead = group.num_dead_blocks(h * B, B)
            if all(b is not None for b in cached[dead:h]):
                return h
        return 0

    def _uses_prefix_cache(self, seq: SequenceState) -> bool:
        return self.enable_caching and seq.num_computed_tokens == 0 and not seq.skip_prefix_cache

    def first_missed_block_hash(
        self, seq: SequenceState, hits: PrefixHits
    ) -> BlockHash | None:
        """Hash of the first looked-up block after `hits` (the block that missed), or None.

        The scheduler defers a waiting sequence whose missed block another sequence is
        computing in the same step: one step later it hits instead of computing it again.
        """
        if not self._uses_prefix_cache(seq):
            return None
        n = self._num_hit_blocks(hits)
        if n >= (seq.num_tokens - 1) // self.block_size:
            return None
        parent = None
        for i in range(n + 1):
            parent = self._block_hash(seq, i, parent)
        return parent

    def _num_hit_blocks(self, hits: PrefixHits) -> int:
        if not hits:
            return 0
        return len(hits[0]) if self.is_hybrid else len(hits)

    def hashes_filled_by(self, seq: SequenceState, num_new_tokens: int) -> list[BlockHash]:
        """Chain hashes of the blocks that computing `num_new_tokens` more tokens makes full."""
        if not self.enable_caching or seq.skip_prefix_cache:
            return []
        hashes = self.req_to_block_hashes.get(seq.seq_id, [])
        parent = hashes[-1] if hashes else None
        out = []
        for i in range(len(hashes), (seq.num_computed_tokens + num_new_tokens) // self.block_size):
            parent = self._block_hash(seq, i, parent)
            out.append(parent)
        return out

    def cache_full_blocks(self, seq: SequenceState) -> None:
        """Hash and publish every block now full of computed tokens (prompt or generated)."""
        if not self.enable_caching:
            return
        table = self.req_to_blocks.get(seq.seq_id)
        if table is None:
            return
        hashes = self.req_to_block_hashes.setdefault(seq.seq_id, [])
        # Computed positions can run ahead of the known tokens while a step's accepted draft
        # tokens are not appended yet (speculative decoding): those blocks hash next time.
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(table))
        for i in range(len(hashes), num_full):
            block_hash = self._block_hash(seq, i, hashes[-1] if hashes else None)
            hashes.append(block_hash)
            for g, tables in enumerate(self.tables):
                block = tables[seq.seq_id][i]
                if block is not self.null_block:
                    self.block_pool.cache_full_block(block, self._group_key(g, block_hash))

    def reset_prefix_cache(self) -> bool:
        if self.null_block is None:
            return self.block_pool.reset_prefix_cache()
        if self.block_pool.num_used_blocks > 1:  # the null block is always held
            return False
        self.block_pool.cached_block_hash_to_block.clear()
        for block in self.block_pool.blocks:
            block.block_hash = None
        return True

    def _check_hits(self, seq: SequenceState, group_hits: list[list[KVBlock]]) -> list[BlockHash]:
        """Chain hashes of the hits, refusing blocks evicted (and maybe reused) since the lookup."""
        hashes: list[BlockHash] = []
        if not group_hits:
            return hashes
        for i in range(len(group_hits[0])):
            hashes.append(self._block_hash(seq, i, hashes[-1] if hashes else None))
        for g, blocks in enumerate(group_hits):
            for i, block in enumerate(blocks):
                if block is self.null_block:
                    continue
                if block.block_hash != self._group_key(g, hashes[i]):
                    raise ValueError(f"seq {seq.seq_id}: stale prefix hit on block {block.block_id}")
        return hashes
