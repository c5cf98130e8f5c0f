"""The scheduler's side of the encoder cache: which images' embedding rows the runner holds,
who still needs them, and the encoder work each step may do (vLLM v1's encoder cache manager).

An image's rows (multimodal/inputs.py `MultiModalFeature`, keyed by content hash) are needed
while any chunk of its placeholder runs is still to prefill: a chunk that overlaps an image
either finds its rows cached (a hit: another chunk, another request, an earlier recompute
computed them) or has them computed this step, within the step's encoder budget
(`max_num_encoder_input_tokens`) and the cache's capacity (`encoder_cache_size`, rows), or
the chunk is cut before the image. The runner (worker/mm_embeddings.py) holds exactly the rows
listed here: it computes a plan's `encoder_inputs` and drops its `freed_encoder_hashes`.

Rows stay cached after the last sequence that needed them passed them (another request with
the same image hits them), until their room is needed: least recently used first, never one
that a sequence still needs. No torch here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pagedllm.core.request import SequenceState


class EncoderCacheManager:
    def __init__(self, capacity_rows: int, budget_per_step: int) -> None:
        if capacity_rows < 1 or budget_per_step < 1:
            raise ValueError(f"encoder cache size ({capacity_rows}) and per-step encoder budget "
                             f"({budget_per_step}) must be positive")
        self.capacity = capacity_rows
        self.budget_per_step = budget_per_step
        self.rows: OrderedDict[bytes, int] = OrderedDict()  # cached hash -> rows, least recent first
        self.users: dict[bytes, set[int]] = {}  # hash -> seq ids that still need it
        self.held: dict[int, set[bytes]] = {}  # seq id -> hashes it holds
        self.used = 0
        self._budget_left = budget_per_step
        self._to_compute: list[Any] = []  # this step's features to encode
        self._freed: list[bytes] = []  # evicted since the last plan
        # Counters (the metrics): per (sequence, image) first need, hits among them; work done.
        self.queries = 0
        self.hits = 0
        self.images_encoded = 0
        self.rows_encoded = 0

    # ---- a step ----------------------------------------------------------------------------

    def begin_step(self) -> None:
        self._budget_left = self.budget_per_step

    def take_step(self) -> tuple[list[Any], list[bytes]]:
        """(features to encode this step, hashes the runner drops before encoding them)."""
        compute, self._to_compute = self._to_compute, []
        freed, self._freed = self._freed, []
        return compute, freed

    def fit_chunk(self, seq: SequenceState, start: int, num_new: int) -> int:
        """`num_new` cut so that every image the chunk [start, start + num_new) overlaps has
        its rows (held now by `seq`), and no chunk ends inside an image that must be whole."""
        end = start + num_new
        for f in seq.mm_features:
            if f.end <= start:
                continue
            if f.start >= end:
                break
            if f.whole_in_one_chunk and f.end > end:
                return max(f.start - start, 0)
            if not self._hold(seq.seq_id, f):
                return max(f.start - start, 0)
        return num_new

    def _hold(self, seq_id: int, feature: Any) -> bool:
        h = feature.content_hash
        mine = self.held.setdefault(seq_id, set())
        if h in mine:
            return True
        if h in self.rows:
            self.queries += 1
            self.hits += 1
            mine.add(h)
            self.users.setdefault(h, set()).add(seq_id)
            self.rows.move_to_end(h)
            return True
        n = feature.num_rows
        if n > self._budget_left or not self._make_room(n):
            return False
        self.queries += 1
        self.rows[h] = n
        self.used += n
        self._budget_left -= n
        self._to_compute.append(feature)
        self.images_encoded += 1
        self.rows_encoded += n
        mine.add(h)
        self.users.setdefault(h, set()).add(seq_id)
        return True

    def _make_room(self, n: int) -> bool:
        if n > self.capacity:
            return False
        if self.capacity - self.used >= n:
            return True
        victims, room = [], self.capacity - self.used
        computing = {f.content_hash for f in self._to_compute}
        for h, rows in self.rows.items():
            if self.users.get(h) or h in computing:  # needed, or being encoded this step
                continue
            victims.append(h)
            room += rows
            if room >= n:
                break
        if room < n:
            return False
        for h in victims:
            self.used -= self.rows.pop(h)
            self.users.pop(h, None)
            self._freed.append(h)
        return True

    # ---- releasing -------------------------------------------------------------------------

    def release_passed(self, seq: SequenceState) -> None:
        """After a step: `seq` no longer needs the images its computed tokens have passed."""
        mine = self.held.get(seq.seq_id)
        if not mine:
            return
        for f in seq.mm_features:
            if f.end <= seq.num_computed_tokens and f.content_hash in mine:
                self._drop(seq.seq_id, f.content_hash)

    def release_all(self, seq: SequenceState) -> None:
        """`seq` finished or was preempted: it needs nothing now (recomputed, it holds again)."""
        for h in list(self.held.get(seq.seq_id, ())):
            self._drop(seq.seq_id, h)
        self.held.pop(seq.seq_id, None)

    def _drop(self, seq_id: int, h: bytes) -> None:
        self.held[seq_id].discard(h)
        users = self.users.get(h)
        if users is not None:
            users.discard(seq_id)
        if h in self.rows:
            self.rows.move_to_end(h)

    def reset(self) -> list[bytes]:
        """Forget every unreferenced entry (reset_prefix_cache); their hashes go to the runner."""
        for h in [h for h in self.rows if not self.users.get(h)]:
            self.used -= self.rows.pop(h)
            self.users.pop(h, None)
            self._freed.append(h)
        return list(self._freed)

    def check_item_fits(self, rows: int) -> None:
        """Refuse an image the cache or the step budget could never hold (it would wait forever)."""
        if rows > self.capacity or rows > self.budget_per_step:
            raise ValueError(f"An image of this prompt takes {rows} embedding rows, more than the encoder cache "
                             f"({self.capacity} rows, --encoder-cache-size) or the per-step encoder budget "
                             f"({self.budget_per_step}, --max-num-encoder-input-tokens) can hold.")

    @property
    def num_pending_users(self) -> int:
        return sum(1 for u in self.users.values() if u)
