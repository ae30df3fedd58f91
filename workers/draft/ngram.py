"""Prompt-lookup (n-gram) drafting: no model, proposals copied from the sequence's own history.

For a sequence t_0..t_{L-1}, try n = max_n down to min_n: find the most recent earlier occurrence of
the last n tokens, and propose the tokens that followed it. Each sequence keeps an index from n-gram
to the end positions of its latest ``MAX_OCCURRENCES`` occurrences, updated incrementally, so a
lookup costs O(max_n) regardless of the sequence length. Proposals are greedy (no distributions).

One lookup serves every branch (:class:`.drafter.Branch`): the continuations of the occurrences of
the longest suffix of the committed tokens followed by the branch's assumed ones (occurrences that
reach into those count too), most recent first. The synchronous seam's chain (a sampled branch) is
the most recent continuation; a tree (``tree_topk`` > 1) is their trie, at most ``tree_topk``
children per node, siblings ordered by how many continuations go that way (then by recency), nodes
taken breadth first up to the node budget. A staged chain (greedy, for the pipelined seam) repeats
the lookup after every token it drafts, the other continuations' next tokens its alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..speculation.payloads import ROOT
from .drafter import Branch, Capabilities, Draft, Drafter, Ready, SamplingSpec, VerifyResult

MAX_OCCURRENCES = 8  # ends remembered per n-gram, for tree proposals


@dataclass
class _History:
    tokens: list[int] = field(default_factory=list)
    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> ends (exclusive), oldest first
    indexed_to: int = 0  # n-grams ending at positions < indexed_to are in ``index``


class NgramProposer(Drafter):
    """Prompt lookup over each sequence's own tokens."""

    def __init__(self, min_n: int = 1, max_n: int = 4, tree_topk: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if tree_topk < 1:
            raise ValueError(f"tree_topk must be >= 1, got {tree_topk}")
        self.tree_topk = tree_topk
        # pure Python, no torch (on the loop); branches are chains: set to draft trees, it serves the
        # synchronous seam
        self.caps = Capabilities("ngram", on_loop=True, stages=tree_topk <= 1)
        self.min_n = min_n
        self.max_n = max_n
        self._seqs: dict[str, _History] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def _index_until(self, hist: _History, end: int) -> None:
        """Index every n-gram that ends before ``end`` (the current suffix itself stays out)."""
        toks = hist.tokens
        for stop in range(hist.indexed_to + 1, end):
            for n in range(self.min_n, self.max_n + 1):
                if stop - n < 0:
                    break
                ends = hist.index.setdefault(tuple(toks[stop - n : stop]), [])
                ends.append(stop)
                if len(ends) > MAX_OCCURRENCES:
                    del ends[0]
        hist.indexed_to = max(hist.indexed_to, end - 1)

    def _continuations(self, hist: _History, extra: tuple[int, ...], depth: int) -> list[list[int]]:
        """What followed the occurrences of the longest suffix of ``hist.tokens + extra`` seen before
        (n from max_n down), up to ``depth`` tokens each, most recent first: the one lookup behind
        chains, their alternatives and trees (see the module docstring)."""
        length = len(hist.tokens)
        self._index_until(hist, length)
        total = length + len(extra)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = self._at(hist, extra, total - n, total)
            # occurrences that reach into ``extra`` or end the history (the index holds the others)
            ends = [stop for stop in range(total - 1, max(n, length) - 1, -1)
                    if self._at(hist, extra, stop - n, stop) == suffix]
            ends += [end for end in reversed(hist.index.get(tuple(suffix), [])) if end < length]
            if ends:
                return [self._at(hist, extra, end, min(end + depth, total)) for end in ends]
        return []

    @staticmethod
    def _at(hist: _History, extra: tuple[int, ...], start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of ``hist.tokens + extra`` without building it."""
        length = len(hist.tokens)
        return hist.tokens[start:min(stop, length)] + list(extra[max(0, start - length) : max(0, stop - length)])

    def _chain(self, hist: _History, br: Branch) -> Draft:
        """A sampled chain (the synchronous seam's) copies the most recent continuation (prompt lookup);
        a greedy one (staging) looks up again after every token it drafts, the other continuations'
        distinct next tokens being the alternatives at each depth."""
        if br.sampled:
            conts = self._continuations(hist, br.extra, br.num_tokens)
            return Draft(conts[0] if conts else [])
        tokens: list[int] = []
        alternatives: list[list[int]] = []
        while len(tokens) < br.num_tokens:
            found = list(dict.fromkeys(c[0] for c in self._continuations(hist, br.extra + tuple(tokens), 1) if c))
            if not found:
                break
            tokens.append(found[0])
            alternatives.append(found[1 : 1 + br.alternatives])
        return Draft(tokens, alternatives)

    @staticmethod
    def _tree(conts: list[list[int]], num_tokens: int, topk: int) -> Draft:
        """The trie of every continuation: at most ``topk`` children per node, siblings by how many
        continuations go that way (then by recency), nodes taken breadth first."""
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [(ROOT, [c for c in conts if c])]  # (node, continuations through it, without its token)
        while frontier and len(tokens) < num_tokens:
            nxt = []
            for node, through in frontier:
                groups: dict[int, list[list[int]]] = {}
                for c in through:  # dicts keep insertion order: first seen = most recent
                    groups.setdefault(c[0], []).append(c[1:])
                for token, rest in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:topk]:
                    if len(tokens) == num_tokens:
                        break
                    tokens.append(token)
                    parents.append(node)
                    rest = [r for r in rest if r]
                    if rest:
                        nxt.append((len(tokens) - 1, rest))
            frontier = nxt
        return Draft(tokens, parents=parents)

    def commit(self, seq_id: str, tokens: Sequence[int], hidden_states: Sequence = (),
               sampling: SamplingSpec = SamplingSpec()) -> None:
        self._seqs.setdefault(seq_id, _History()).tokens.extend(tokens)

    def draft(self, branches: list[Branch], ready: Ready | None = None) -> list[Draft]:
        # (``ready`` unused: drafting takes microseconds, the proposals leave when it returns)
        out = []
        for br in branches:
            hist = self._seqs.get(br.seq_id)
            if hist is None or br.num_tokens <= 0:
                out.append(Draft([]))
            elif br.tree is None:
                out.append(self._chain(hist, br))
            else:
                out.append(self._tree(self._continuations(hist, br.extra, br.tree[1]), br.num_tokens, br.tree[0]))
        return out

    def verified(self, results: list[VerifyResult]) -> None:
        # Drafts are never appended to the history, so there is nothing to roll back: commit what
        # the target emitted.
        for result in results:
            hist = self._seqs.get(result.seq_id)
            if hist is not None:
                hist.tokens.extend(result.emitted_tokens)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)
