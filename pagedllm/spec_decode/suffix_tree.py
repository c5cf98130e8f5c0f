"""The suffix tree that suffix decoding (spec_decode/suffix.py) draws its drafts from: a
path-compressed trie of every sequence's suffixes up to `max_depth` tokens, with counts, and the
most probable continuation of a match. Apart from the cache and the proposer because it is a
self-contained data structure with its own invariants (`check_invariants`), tested on its own.

A `SuffixTree` holds, for every sequence put in it and every start position i, the string
s[i : i + max_depth] (shorter at the end of s), in one path-compressed trie. A node's count is
the number of those strings that pass through or end at it: for a pattern P of at most
max_depth tokens, the count of P's node is the number of times P occurs in the sequences. So
count(P + t) / count(P) is the empirical probability that t follows P.

`speculate` matches the last m tokens of the context for every m = 1, 2, ... (until one does
not occur), and from each match follows the most frequent continuation, one token at a time:
the path's probability is the product of those ratios, the path stops where it would fall
under `min_token_prob`, or after min(max_spec_tokens, max_spec_factor * m + max_spec_offset)
tokens, or at the tree's depth. A draft's score is the sum of its tokens' probabilities; the
best-scoring match wins (a longer one on a tie). `SuffixCache` asks the sequence's own tree
and the global tree and keeps the better draft (its own on a tie).

Cost: appending a token touches the sequence's (at most max_depth) unfinished strings, O(1)
each; nodes are O(1) per token (path compression: an edge is a slice of one sequence's token
list). Removing a sequence (global cache eviction) walks its strings once, O(length x depth).
Nothing is rebuilt per step (a 2,000-token prompt goes in in about 10 ms; a step's
speculation over both trees takes tens of microseconds per sequence).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence as SequenceT
from dataclasses import dataclass, field


class _Node:
    """A trie edge and the node under it: tokens seq[idx : idx + length] (`seq` is some
    sequence's token list, or a private copy of a root path), `count` strings through or
    ending here, `best` the child to follow (highest count, then smallest token; None with
    children: recompute)."""

    __slots__ = ("count", "token", "length", "seq", "idx", "parent", "children", "best")

    def __init__(self, count: int, token: int, length: int, seq: list[int], idx: int,
                 parent: "_Node | None") -> None:
        self.count = count
        self.token = token  # the edge's first token, the key in the parent's children
        self.length = length
        self.seq = seq
        self.idx = idx
        self.parent = parent
        self.children: dict[int, _Node] | None = None
        self.best: _Node | None = None


def _best_child(node: _Node) -> _Node | None:
    """The child to follow from `node` (recomputed when an eviction left it unknown)."""
    best = node.best
    if best is None and node.children:
        best = node.best = max(node.children.values(), key=lambda c: (c.count, -c.token))
    return best


def _bump(parent: _Node, child: _Node) -> None:
    """`child`'s count rose (or it was just added): it may now be `parent`'s best child."""
    best = parent.best
    if best is child:
        return
    if best is None:
        if len(parent.children) == 1:  # otherwise unknown: recomputed when needed
            parent.best = child
    elif child.count > best.count or (child.count == best.count and child.token < best.token):
        parent.best = child


@dataclass
class Draft:
    """A speculation: its tokens, each one's estimated probability, their sum (the score)
    and the length of the context match it came from."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Path-compressed suffix trie of depth `max_depth` over sequences keyed by any hashable
    id; sequences grow by `append` / `extend` and leave by `remove`."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(0, -1, 0, [], 0, None)
        self._seqs: dict[Hashable, list[int]] = {}
        # Per sequence: the nodes where its unfinished strings end (the one starting at
        # len - m at [-m]); the oldest reaches max_depth and drops out at the next append.
        self._active: dict[Hashable, list[_Node]] = {}

    # ---- contents -------------------------------------------------------------------------

    def __contains__(self, sid: Hashable) -> bool:
        return sid in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def tokens(self, sid: Hashable) -> list[int]:
        """The tree's copy of sequence `sid` (do not modify)."""
        return self._seqs[sid]

    def extend(self, sid: Hashable, tokens: Iterable[int]) -> None:
        """Append `tokens` to sequence `sid` (a new one if unknown)."""
        seq = self._seqs.get(sid)
        if seq is None:
            seq = self._seqs[sid] = []
            self._active[sid] = []
        act = self._active.get(sid)
        if act is None:
            raise ValueError(f"sequence {sid!r} was sealed")
        for token in tokens:
            self._append(seq, act, int(token))

    def append(self, sid: Hashable, token: int) -> None:
        self.extend(sid, (token,))

    def seal(self, sid: Hashable) -> None:
        """`sid` gets no more tokens: forget where its strings end (it stays in the tree)."""
        self._active.pop(sid, None)

    def _append(self, seq: list[int], act: list[_Node], token: int) -> None:
        root = self.root
        pos = len(seq)  # the new token's index
        seq.append(token)
        root.count += 1
        act.append(root)  # the string starting at the new token
        if len(act) > self.max_depth:
            del act[0]  # that string has max_depth tokens: it ends where it is
        for j, node in enumerate(act):
            children = node.children
            child = children.get(token) if children is not None else None
            if child is None:
                if node.count == 1 and node is not root:
                    # Only this string reaches the node (a leaf): the edge grows.
                    node.length += 1
                    node.seq = seq
                    node.idx = pos + 1 - node.length
                else:
                    leaf = _Node(1, token, 1, seq, pos, node)
                    if children is None:
                        node.children = {token: leaf}
                    else:
                        children[token] = leaf
                    _bump(node, leaf)
                    act[j] = leaf
            elif node is not root and node.count == child.count + 1:
                # This string is the only one that ends at `node`, and every other goes on
                # to `child`: once it takes `token` too, the node and the child's first token
                # are one edge.
                if child.length == 1:
                    parent = node.parent
                    child.token = node.token
                    child.length = node.length + 1
                    child.count = node.count
                    child.seq = seq
                    child.idx = pos + 1 - child.length
                    child.parent = parent
                    parent.children[node.token] = child
                    if parent.best is node:
                        parent.best = child
                    act[j] = child
                else:
                    node.length += 1
                    node.seq = seq
                    node.idx = pos + 1 - node.length
                    del children[token]
                    child.idx += 1
                    child.length -= 1
                    child.token = child.seq[child.idx]
                    children[child.token] = child
            elif child.length == 1:
                child.count += 1
                _bump(node, child)
                act[j] = child
            else:
                # The string enters a longer edge: split it after its first token.
                mid = _Node(child.count + 1, token, 1, seq, pos, node)
                child.idx += 1
                child.length -= 1
                child.token = child.seq[child.idx]
                child.parent = mid
                mid.children = {child.token: child}
                mid.best = child
                children[token] = mid
                if node.best is child:
                    node.best = mid
                _bump(node, mid)
                act[j] = mid

    def remove(self, sid: Hashable) -> None:
        """Take sequence `sid` out: every count it added goes, nodes only it reached are
        deleted, and nodes whose edge pointed into its token list get a private copy of
        their root path (so the list is freed)."""
        seq = self._seqs.pop(sid)
        self._active.pop(sid, None)
        root = self.root
        depth_cap = self.max_depth
        n = len(seq)
        for start in range(n):
            length = min(depth_cap, n - start)
            root.count -= 1
            node = root
            depth = 0
            path: list[tuple[_Node, int]] = []  # surviving nodes and their start depth
            while depth < length:
                child = node.children[seq[start + depth]]
                if child.count == 1:  # only this string: the whole subtree goes
                    del node.children[child.token]
                    if not node.children:
                        node.children = None
                    if node.best is child:
                        node.best = None
                    break
                child.count -= 1
                if node.best is child and len(node.children) > 1:
                    node.best = None  # another child may lead now
                path.append((child, depth))
                depth += child.length
                node = child
            if not path:
                continue
            # The deepest node may now be one edge with its only child.
            last, d0 = path[-1]
            if last.children is not None and len(last.children) == 1:
                (only,) = last.children.values()
                if only.count == last.count:
                    parent = last.parent
                    only.token = last.token
                    only.length += last.length
                    only.idx -= last.length
                    only.parent = parent
                    parent.children[last.token] = only
                    if parent.best is last:
                        parent.best = only
                    path[-1] = (only, d0)
            for node, d0 in path:
                if node.seq is seq:
                    node.seq = node.seq[node.idx - d0: node.idx + node.length]
                    node.idx = d0

    # ---- matching and speculation ---------------------------------------------------------

    def match(self, pattern: SequenceT[int]) -> tuple[_Node, int] | None:
        """Where `pattern` ends in the tree: (node, tokens of its edge matched), or None."""
        node = self.root
        i = 0
        for token in pattern:
            if i == node.length:
                child = node.children.get(token) if node.children is not None else None
                if child is None:
                    return None
                node = child
                i = 1
            elif node.seq[node.idx + i] == token:
                i += 1
            else:
                return None
        return node, i

    def count(self, pattern: SequenceT[int]) -> int:
        """How many times `pattern` (at most max_depth tokens) occurs in the sequences."""
        hit = self.match(pattern)
        return 0 if hit is None else hit[0].count

    def speculate(self, context: SequenceT[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
                  own: Hashable | None = None) -> Draft:
        """The best draft to follow `context` (its last max_depth tokens are used). `own`: a
        sequence of this tree that ends with `context`; its unfinished strings give the
        matches they cover without walking from the root."""
        if len(context) > self.max_depth:
            context = context[-self.max_depth:]
        n = len(context)
        act = self._active.get(own) if own is not None else None
        n_act = len(act) if act is not None else 0
        best = Draft()
        for m in range(1, n):
            if m <= n_act:
                node, i = act[-m], act[-m].length
            else:
                hit = self.match(context[n - m:])
                if hit is None:
                    break
                node, i = hit
            limit = max(min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6)), 0)
            draft = self._path(node, i, limit, min_token_prob)
            if draft.score >= best.score:
                best = draft
                best.match_len = m
        return best

    @staticmethod
    def _path(node: _Node, i: int, limit: int, min_token_prob: float) -> Draft:
        """The most frequent continuation from `node` (edge offset `i`), up to `limit` tokens
        while its probability stays >= `min_token_prob`."""
        draft = Draft()
        tokens, probs = draft.token_ids, draft.probs
        prob, score = 1.0, 0.0
        while len(tokens) < limit and prob >= min_token_prob:
            if i < node.length:
                tokens.append(node.seq[node.idx + i])
                probs.append(prob)
                score += prob
                i += 1
            else:
                child = _best_child(node)
                if child is None:
                    break
                prob *= child.count / node.count
                node, i = child, 0
        draft.score = score
        return draft

    # ---- checks ---------------------------------------------------------------------------

    def nodes(self) -> Iterable[tuple[tuple[int, ...], int]]:
        """(path from the root, count) for every node, at each depth along its edge: the
        uncompressed trie, for comparisons in tests."""
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, path = stack.pop()
            for i in range(node.length):
                path = path + (node.seq[node.idx + i],)
                yield path, node.count
            for child in (node.children or {}).values():
                stack.append((child, path))

    def check_invariants(self) -> None:
        """Structure checks (tests): keys, parents, counts, canonical compression, each
        edge's tokens on a real root path, the best-child rule, the active ends."""
        for node in _walk(self.root):
            children = node.children or {}
            assert node.children is None or children, "empty children dict"
            total = sum(c.count for c in children.values())
            assert total <= node.count, "children count more than their parent"
            if node is not self.root:
                assert node.count > 0 and node.length > 0
                assert node.parent.children[node.token] is node
                assert node.seq[node.idx] == node.token
                assert 0 <= node.idx and node.idx + node.length <= len(node.seq)
                # canonical: a node with one child and no string ending here is one edge
                assert not (len(children) == 1 and total == node.count), "mergeable node"
            for tok, child in children.items():
                assert child.token == tok and child.parent is node
            if node.best is not None:
                want = max(children.values(), key=lambda c: (c.count, -c.token))
                assert node.best is want or node is self.root, "best child is stale"
        # every edge's tokens follow its ancestors' in the token list it points into
        stack = [(self.root, 0, ())]
        while stack:
            node, depth, path = stack.pop()
            if node is not self.root:
                d0 = depth - node.length
                assert node.idx >= d0
                assert tuple(node.seq[node.idx - d0: node.idx + node.length]) == path
            for child in (node.children or {}).values():
                stack.append((child, depth + child.length,
                              path + tuple(child.seq[child.idx: child.idx + child.length])))
        for sid, act in self._active.items():
            seq = self._seqs[sid]
            assert len(act) == min(self.max_depth, len(seq))
            for m in range(1, len(act) + 1):
                hit = self.match(seq[len(seq) - m:])
                assert hit is not None and hit[0] is act[-m] and hit[1] == act[-m].length


def _walk(root: _Node) -> Iterable[_Node]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        if node.children:
            stack.extend(node.children.values())


__all__ = ["Draft", "SuffixTree"]
