"""A depth-bounded suffix tree with occurrence counts: the index behind suffix decoding.

The tree holds several token sequences. Every suffix of every sequence, cut to ``max_depth`` tokens,
is a path from the root, and each node counts the occurrences of the string it spells (a
*bounded-depth suffix trie*: the SuffixDecoding paper's tree, Oliaro et al. 2024, arXiv 2411.04975).
A node at depth d < ``max_depth`` therefore knows, through its children's counts, how often each
token followed that d-token string: ``P(t | s) = count(s t) / Σ_u count(s u)``.

Operations, with D = ``max_depth``:

- ``extend(key, tokens)`` appends tokens to a sequence in O(D) per token: the sequence keeps the
  nodes of its current suffixes shorter than D (its *open* nodes), and each new token extends every
  one of them by one child and opens a new suffix at the root.
- ``match(context, max_len)`` finds the longest suffix of ``context`` (at most ``max_len`` tokens)
  that the tree holds *with a continuation*: O(max_len²) dictionary look-ups at worst.
- ``chain`` and ``tree`` read proposals from a matched node: the most frequent continuation (ties:
  the most recently seen), or a best-first tree over the top-k children of every node, scored by
  the product of the conditional frequencies along the path; both stop below ``min_prob``.
- ``remove(key)`` walks each of the sequence's suffixes again and decrements; nodes that reach zero
  are freed (a child never counts more than its parent, so a freed node has no live descendants).

Memory: a sequence of n tokens adds at most n·D nodes (fewer when it repeats what the tree holds);
``num_nodes`` is exact, and the owner evicts whole sequences, oldest first, to keep it bounded.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass, field

from ..speculation.payloads import ROOT

ROOT_NODE = 0  # the tree's root: the empty string


@dataclass
class _Sequence:
    tokens: list[int] = field(default_factory=list)
    open: list[int] | None = field(default_factory=list)  # nodes of suffixes shorter than D; None: closed


class SuffixTree:
    """Counts of every substring (up to ``max_depth`` tokens) of the sequences it holds."""

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        # Nodes as parallel lists (index 0: the root); freed indices are reused.
        self._children: list[dict[int, int] | None] = [{}]
        self._count: list[int] = [0]
        self._depth: list[int] = [0]
        self._parent: list[int] = [-1]
        self._token: list[int] = [-1]  # the token on the edge from the parent
        self._seen: list[int] = [0]  # when an occurrence was last added (for recency tie-breaks)
        self._free: list[int] = []
        self._clock = 0
        self._seqs: dict[Hashable, _Sequence] = {}  # insertion order: oldest first
        self.num_tokens = 0

    # ------------------------------------------------------------------ sequences

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def num_nodes(self) -> int:
        """Live nodes, the root excluded."""
        return len(self._count) - len(self._free) - 1

    def oldest(self) -> Hashable:
        """The key of the sequence added first."""
        return next(iter(self._seqs))

    def newest(self) -> Hashable:
        """The key of the sequence added last."""
        return next(reversed(self._seqs))

    def tokens(self, key: Hashable) -> list[int]:
        return self._seqs[key].tokens

    def add(self, key: Hashable, tokens: list[int] = ()) -> None:
        """Start a new sequence (the newest)."""
        if key in self._seqs:
            raise KeyError(f"sequence {key!r} is already in the tree")
        self._seqs[key] = _Sequence()
        self.extend(key, tokens)

    def extend(self, key: Hashable, tokens: list[int]) -> None:
        """Append tokens to an open sequence."""
        seq = self._seqs[key]
        if seq.open is None:
            raise ValueError(f"sequence {key!r} is closed")
        children, count, depth, seen = self._children, self._count, self._depth, self._seen
        limit = self.max_depth
        for t in tokens:
            self._clock += 1
            grown = []
            for node in (*seq.open, ROOT_NODE):  # longest suffix first, the new one-token suffix last
                kids = children[node]
                child = kids.get(t) if kids is not None else None
                if child is None:
                    child = self._new_node(node, t)
                count[child] += 1
                seen[child] = self._clock
                if depth[child] < limit:
                    grown.append(child)
            seq.open = grown
        seq.tokens.extend(tokens)
        self.num_tokens += len(tokens)

    def close(self, key: Hashable) -> None:
        """No more tokens for this sequence: drop its open nodes (it stays in the tree)."""
        seq = self._seqs.get(key)
        if seq is not None:
            seq.open = None

    def remove(self, key: Hashable) -> None:
        """Take a sequence's every suffix out of the tree, freeing nodes no other sequence uses."""
        seq = self._seqs.pop(key)
        toks, n, limit = seq.tokens, len(seq.tokens), self.max_depth
        count, children = self._count, self._children
        for start in range(n):
            node = ROOT_NODE
            for t in toks[start : min(start + limit, n)]:
                node = children[node][t]
                count[node] -= 1
                if count[node] == 0:  # its subtree is empty too; the walk frees the rest of the path
                    del children[self._parent[node]][t]
                    self._free.append(node)
        self.num_tokens -= n

    def _new_node(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self._children[node] = None
            self._count[node] = 0
            self._depth[node] = self._depth[parent] + 1
            self._parent[node] = parent
            self._token[node] = token
        else:
            node = len(self._count)
            self._children.append(None)
            self._count.append(0)
            self._depth.append(self._depth[parent] + 1)
            self._parent.append(parent)
            self._token.append(token)
            self._seen.append(0)
        if self._children[parent] is None:
            self._children[parent] = {}
        self._children[parent][token] = node
        return node

    # ------------------------------------------------------------------ lookups

    def count(self, path: list[int]) -> int:
        """Occurrences of ``path`` (0 when absent; paths longer than ``max_depth`` are never held)."""
        node = self._walk(path)
        return 0 if node is None else self._count[node]

    def depth(self, node: int) -> int:
        return self._depth[node]

    def _walk(self, path) -> int | None:
        node, children = ROOT_NODE, self._children
        for t in path:
            kids = children[node]
            node = kids.get(t) if kids else None
            if node is None:
                return None
        return node

    def match(self, context: list[int], max_len: int) -> tuple[int, int]:
        """(node, length) of the longest suffix of ``context``, at most ``max_len`` tokens, that the
        tree holds with at least one continuation; (root, 0) when even the last token has none."""
        for length in range(min(max_len, len(context), self.max_depth - 1), 0, -1):
            node = self._walk(context[len(context) - length :])
            if node is not None and self._children[node]:
                return node, length
        return ROOT_NODE, 0

    def _ranked(self, node: int) -> tuple[list[tuple[int, int]], int]:
        """A node's children as (token, child), most frequent first (ties: most recently seen), and
        the total count of its children."""
        kids = self._children[node]
        if not kids:
            return [], 0
        count, seen = self._count, self._seen
        ranked = sorted(kids.items(), key=lambda kv: (-count[kv[1]], -seen[kv[1]]))
        return ranked, sum(count[c] for _, c in ranked)

    def chain(self, node: int, max_tokens: int, min_prob: float) -> tuple[list[int], list[float]]:
        """The most frequent continuation of ``node``: tokens and the estimated probability of reaching
        each (the product of conditional frequencies), stopping before it falls below ``min_prob``."""
        tokens: list[int] = []
        probs: list[float] = []
        p = 1.0
        while len(tokens) < max_tokens:
            ranked, total = self._ranked(node)
            if not ranked:
                break
            token, child = ranked[0]
            p *= self._count[child] / total
            if p < min_prob:
                break
            tokens.append(token)
            probs.append(p)
            node = child
        return tokens, probs

    def chain_alternatives(self, node: int, max_tokens: int, min_prob: float, k: int
                           ) -> tuple[list[int], list[float], list[list[int]]]:
        """:meth:`chain`, and at each of its depths up to ``k`` other children, most frequent first."""
        tokens, probs = self.chain(node, max_tokens, min_prob)
        if k <= 0:
            return tokens, probs, [[] for _ in tokens]
        alternatives = []
        for token in tokens:
            ranked, _ = self._ranked(node)
            alternatives.append([t for t, _ in ranked if t != token][:k])
            node = self._children[node][token]
        return tokens, probs, alternatives

    def tree(self, node: int, max_nodes: int, topk: int, max_depth: int, min_prob: float
             ) -> tuple[list[int], list[int], list[float]]:
        """Up to ``max_nodes`` continuations of ``node`` as a token tree (tokens, parents, probabilities):
        best first by estimated probability, at most ``topk`` children per node and ``max_depth`` levels.

        Popping in order of decreasing probability puts every parent before its children (a child is
        never likelier than its parent) and siblings best first, as proposals need."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        heap: list[tuple[float, int, int, int, int]] = []  # (-prob, tie, node, parent index, depth)
        tie = 0

        def push(at: int, index: int, p: float, depth: int) -> None:
            nonlocal tie
            ranked, total = self._ranked(at)
            for _, child in ranked[:topk]:
                q = p * self._count[child] / total
                if q >= min_prob:
                    heapq.heappush(heap, (-q, tie, child, index, depth))
                    tie += 1

        push(node, ROOT, 1.0, 1)
        while heap and len(tokens) < max_nodes:
            neg, _, child, parent, depth = heapq.heappop(heap)
            tokens.append(self._token[child])
            parents.append(parent)
            probs.append(-neg)
            if depth < max_depth:
                push(child, len(tokens) - 1, -neg, depth + 1)
        return tokens, parents, probs
