"""Which data-parallel engine core gets a request: the least loaded, unless another already
holds its prefix.

Load is what the front end has in flight on each core (waiting + running there). Prefix
affinity: the request's first full KV blocks (up to `affinity_blocks`) are hashed as chained
hashes of token ids (the cache salt in the first), and each hash remembers the core that last
took a request with that prefix. The longest remembered prefix wins, so requests with the same
system prompt land on the core whose prefix cache holds it, unless that core is overloaded:
more than `slack` requests above the least loaded live core. Then the least loaded one takes
it, and becomes the prefix's home. With one core it is always core 0.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.engine.core_messages import EngineCoreRequest


class Router:
    def __init__(self, num_engines: int, block_size: int, affinity_blocks: int = 8,
                 slack: int = 16, max_prefixes: int = 65536) -> None:
        self.num_engines = num_engines
        self.block_size = block_size
        self.affinity_blocks = affinity_blocks
        self.slack = slack
        self.max_prefixes = max_prefixes
        self.load = [0] * num_engines
        self._homes: OrderedDict[int, int] = OrderedDict()  # prefix hash -> engine (LRU)
        self.affinity_hits = 0  # requests sent to their prefix's home (for tests, metrics)

    def prefix_hashes(self, request: EngineCoreRequest, salt: str | None) -> list[int]:
        ids = request.prompt_token_ids
        bs = self.block_size
        hashes: list[int] = []
        parent = hash(salt)
        for b in range(min(len(ids) // bs, self.affinity_blocks)):
            parent = hash((parent, tuple(ids[b * bs:(b + 1) * bs])))
            hashes.append(parent)
        return hashes

    def choose(self, request: EngineCoreRequest, live: list[int], salt: str | None = None) -> int:
        if not live:
            raise RuntimeError("No engine core is alive.")
        if self.num_engines == 1:
            return live[0]
        least = min(live, key=lambda i: self.load[i])
        hashes = self.prefix_hashes(request, salt)
        chosen = least
        for h in reversed(hashes):  # the longest known prefix first
            home = self._homes.get(h)
            if home is not None and home in live:
                if self.load[home] <= self.load[least] + self.slack:
                    chosen = home
                    self.affinity_hits += 1
                break
        for h in hashes:
            self._homes[h] = chosen
            self._homes.move_to_end(h)
        while len(self._homes) > self.max_prefixes:
            self._homes.popitem(last=False)
        return chosen

    def started(self, engine_index: int) -> None:
        self.load[engine_index] += 1

    def finished(self, engine_index: int) -> None:
        self.load[engine_index] = max(self.load[engine_index] - 1, 0)

    def reset(self, engine_index: int) -> None:
        """A core died: nothing is in flight there, and it is home to no prefix."""
        self.load[engine_index] = 0
        for h in [h for h, e in self._homes.items() if e == engine_index]:
            del self._homes[h]
