"""Prompt-lookup (n-gram) drafting: no model, proposals copied from the sequence's own history.

For a sequence t_0..t_{L-1}, try n = max_n down to min_n: find the most recent earlier occurrence of
the last n tokens, and propose the tokens that followed it. Each sequence keeps an index from n-gram
to the end position of its latest occurrence, updated incrementally, so a lookup costs O(max_n)
regardless of the sequence length. Proposals are greedy (no distributions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .proposer import DraftInput, DraftOutput, VerifyResult


@dataclass
class _History:
    tokens: list[int] = field(default_factory=list)
    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end (exclusive) of latest occurrence
    indexed_to: int = 0  # n-grams ending at positions < indexed_to are in ``index``


class NgramProposer:
    """Prompt lookup over each sequence's own tokens."""

    method = "ngram"
    hidden_layers: list[int] = []

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
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
                hist.index[tuple(toks[stop - n : stop])] = stop
        hist.indexed_to = max(hist.indexed_to, end - 1)

    def lookup(self, tokens: list[int], num_tokens: int, hist: _History | None = None) -> list[int]:
        """The proposal for ``tokens`` (builds a throwaway index when ``hist`` is None)."""
        if hist is None:
            hist = _History()
            self._extend(hist, list(tokens))
        length = len(hist.tokens)
        self._index_until(hist, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = hist.index.get(tuple(hist.tokens[length - n :]))
            if end is not None:
                return hist.tokens[end : end + num_tokens]
        return []

    def propose(self, batch: list[DraftInput]) -> list[DraftOutput]:
        out = []
        for item in batch:
            hist = self._seqs.setdefault(item.seq_id, _History())
            self._extend(hist, item.new_tokens)
            tokens = self.lookup(hist.tokens, item.num_tokens, hist) if item.num_tokens > 0 else []
            out.append(DraftOutput(item.seq_id, item.round, tokens))
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
