"""Prompt-lookup (n-gram) drafting: no model, proposals copied from the sequence's own history.

For a sequence t_0..t_{L-1}, try n = max_n down to min_n: find the most recent earlier occurrence of
the last n tokens, and propose the tokens that followed it. Each sequence keeps an index from n-gram
to the end position of its latest occurrence, updated incrementally, so a lookup costs O(max_n)
regardless of the sequence length. Proposals are greedy (no distributions).

With ``tree_topk`` > 1 a proposal is a token tree: the continuations of the most recent occurrences
of the matched n-gram (up to ``MAX_OCCURRENCES`` are remembered per n-gram) merged into a trie, at
most ``tree_topk`` children per node, siblings ordered by how many occurrences continue that way
(then by recency), nodes taken breadth first up to the node budget. The most recent continuation
is always the first branch, so the chain proposal is the tree's first path.

For the pipelined seam it drafts branches (:mod:`.stager`): after the committed tokens plus a
branch's assumed ones it repeats the lookup token by token (the longest matching suffix's most
recent continuation), and the continuations of that suffix's other occurrences are the alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..speculation.payloads import ROOT
from .proposer import DraftInput, DraftOutput, Proposer, VerifyResult
from .stager import Branch, Chain, Ready

MAX_OCCURRENCES = 8  # ends remembered per n-gram, for tree proposals


@dataclass
class _History:
    tokens: list[int] = field(default_factory=list)
    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> ends (exclusive), oldest first
    indexed_to: int = 0  # n-grams ending at positions < indexed_to are in ``index``


class NgramProposer(Proposer):
    """Prompt lookup over each sequence's own tokens."""

    method = "ngram"
    on_loop = True  # pure Python, no torch

    def __init__(self, min_n: int = 1, max_n: int = 4, tree_topk: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if tree_topk < 1:
            raise ValueError(f"tree_topk must be >= 1, got {tree_topk}")
        self.tree_topk = tree_topk
        self.min_n = min_n
        self.max_n = max_n
        self._seqs: dict[str, _History] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def _extend(self, hist: _History, tokens: list[int]) -> None:
        hist.tokens.extend(tokens)

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

    def _ends(self, hist: _History) -> list[int]:
        """Ends of the occurrences of the longest matching suffix, most recent first."""
        length = len(hist.tokens)
        self._index_until(hist, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            ends = hist.index.get(tuple(hist.tokens[length - n :]))
            if ends:
                return ends[::-1]
        return []

    def lookup(self, tokens: list[int], num_tokens: int, hist: _History | None = None) -> list[int]:
        """The chain proposal for ``tokens`` (builds a throwaway index when ``hist`` is None)."""
        if hist is None:
            hist = _History()
            self._extend(hist, list(tokens))
        ends = self._ends(hist)
        return hist.tokens[ends[0] : ends[0] + num_tokens] if ends else []

    def lookup_tree(self, hist: _History, num_tokens: int, topk: int, depth: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the trie of every remembered continuation (see the module docstring)."""
        conts = [hist.tokens[end : end + depth] for end in self._ends(hist)]
        conts = [c for c in conts if c]
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [(ROOT, conts)]  # (node, continuations through it, each without the node's token)
        while frontier and len(tokens) < num_tokens:
            nxt = []
            for node, through in frontier:
                groups: dict[int, list[list[int]]] = {}
                for c in through:  # dicts keep insertion order: first seen = most recent
                    groups.setdefault(c[0], []).append(c[1:])
                ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[:topk]
                for token, rest in ranked:
                    if len(tokens) == num_tokens:
                        break
                    tokens.append(token)
                    parents.append(node)
                    rest = [r for r in rest if r]
                    if rest:
                        nxt.append((len(tokens) - 1, rest))
            frontier = nxt
        return tokens, parents

    def propose(self, batch: list[DraftInput]) -> list[DraftOutput]:
        out = []
        for item in batch:
            hist = self._seqs.setdefault(item.seq_id, _History())
            self._extend(hist, item.new_tokens)
            topk = item.tree_topk or self.tree_topk
            if item.num_tokens <= 0:
                out.append(DraftOutput(item.seq_id, item.round, []))
            elif topk > 1:
                depth = min(item.tree_depth or item.num_tokens, item.chain_length)
                tokens, parents = self.lookup_tree(hist, item.num_tokens, topk, depth)
                out.append(DraftOutput(item.seq_id, item.round, tokens, [], parents))
            else:
                out.append(DraftOutput(item.seq_id, item.round, self.lookup(hist.tokens, item.chain_length, hist)))
        return out

    @property
    def stages(self) -> bool:
        """Branches are chains: set to draft trees, it serves the synchronous seam."""
        return self.tree_topk <= 1

    def commit(self, seq_id: str, tokens: list[int]) -> None:
        self._extend(self._seqs.setdefault(seq_id, _History()), tokens)

    def _next_tokens(self, hist: _History, extra: list[int], k: int) -> list[int]:
        """Up to ``k`` distinct candidates for the token after ``hist.tokens + extra``: what followed the
        occurrences of its longest matching suffix (n from max_n down), most recent first."""
        length = len(hist.tokens)
        self._index_until(hist, length)
        total = length + len(extra)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = (hist.tokens[total - n :] if n > len(extra) else []) + extra[max(0, len(extra) - n) :]
            found: list[int] = []
            # occurrences that reach into ``extra`` (the index holds only those within the history)
            for stop in range(total - 1, max(n, length) - 1, -1):
                if self._at(hist, extra, stop - n, stop) == suffix:
                    nxt = self._at(hist, extra, stop, stop + 1)[0]
                    if nxt not in found:
                        found.append(nxt)
            for end in reversed(hist.index.get(tuple(suffix), [])):
                if end < length and hist.tokens[end] not in found:
                    found.append(hist.tokens[end])
            if found:
                return found[:k]
        return []

    @staticmethod
    def _at(hist: _History, extra: list[int], start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of ``hist.tokens + extra`` without building it."""
        length = len(hist.tokens)
        return hist.tokens[start:min(stop, length)] + extra[max(0, start - length) : max(0, stop - length)]

    def draft_branches(self, branches: list[Branch], ready: Ready | None = None) -> list[Chain]:
        # (``ready`` unused: drafting takes microseconds, the proposals leave when it returns)
        out = []
        for br in branches:
            hist = self._seqs.get(br.seq_id)
            tokens: list[int] = []
            alts: list[list[int]] = []
            while hist is not None and len(tokens) < br.num_tokens:
                found = self._next_tokens(hist, list(br.extra) + tokens, 1 + br.alternatives)
                if not found:
                    break
                tokens.append(found[0])
                alts.append(found[1:])
            out.append(Chain(tokens, alts))
        return out

    def verified(self, results: list[VerifyResult]) -> None:
        # Drafts are never appended to the history, so there is nothing to roll back: commit what
        # the target emitted.
        for result in results:
            hist = self._seqs.get(result.seq_id)
            if hist is not None:
                self._extend(hist, result.emitted_tokens)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)
