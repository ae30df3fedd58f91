"""A benchmarking draft with controllable acceptance: it knows the target's greedy continuations.

Given reference sequences (prompt + the target's greedy output), it proposes the next tokens of the
reference that the sequence's committed tokens are a prefix of, replacing each proposed token by a
random one with probability ``error_rate``. Sweeping ``error_rate`` traces achieved speedup against
acceptance α.

Drafting costs nothing unless ``token_cost_s`` is set: then every drafted token costs that long
(a sleep, as if the draft ran on its own accelerator — a real draft model on this machine would
take the target's CPU cores instead), and a batch of sequences costs as much as its longest
proposal, as a batched draft forward does. Like the draft model, it can draft ahead
(:meth:`predraft`) while the target verifies; a tail drafted ahead is kept while the target's
emitted tokens agree with it and paid for only once.

For the pipelined seam it drafts branches (:mod:`.stager`) with the same error process; all the
branches of one call cost as one batched draft pass per depth (``token_cost_s`` × the deepest).
Where it drafted a wrong token, its one alternative there is the reference's token: it stands for a
draft model whose second choice is the target's (the bonus guess after a rejection is then right;
after a full acceptance the guess is its own next draft, right with probability 1 − ``error_rate``).
Not for serving.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from .proposer import DraftInput, DraftOutput, Proposer, VerifyResult
from .stager import Branch, Chain, Ready


class OracleProposer(Proposer):
    method = "oracle"
    drafts_ahead = True
    stages = True  # drafts branches for the pipelined seam

    def __init__(self, references: list[list[int]], error_rate: float, vocab_size: int, seed: int = 0,
                 token_cost_s: float = 0.0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        if token_cost_s < 0:
            raise ValueError(f"token_cost_s must be >= 0, got {token_cost_s}")
        self.references = [list(r) for r in references]
        self.error_rate = error_rate
        self.vocab_size = vocab_size
        self.token_cost_s = token_cost_s
        self._rng = random.Random(seed)
        self._seqs: dict[str, list[int]] = {}  # committed tokens
        self._tails: dict[str, list[int]] = {}  # drafted past the committed tokens, already paid for
        self._ref_of: dict[str, tuple[int, int]] = {}  # seq id -> (its reference, committed tokens checked)
        self.drafted_tokens = 0  # tokens paid for (incl. drafted ahead)

    @classmethod
    def from_file(cls, path: str | Path, error_rate: float, vocab_size: int, seed: int = 0,
                  token_cost_s: float = 0.0) -> OracleProposer:
        """``path``: a JSON list of token lists."""
        return cls(json.loads(Path(path).read_text()), error_rate, vocab_size, seed, token_cost_s)

    def _continuation(self, tokens: list[int], n: int) -> list[int]:
        for ref in self.references:
            if len(ref) > len(tokens) and ref[: len(tokens)] == tokens:
                return ref[len(tokens) : len(tokens) + n]
        return []

    def _commit(self, seq_id: str, emitted: list[int]) -> None:
        tail = self._tails.get(seq_id, [])
        self._tails[seq_id] = tail[len(emitted) :] if tail[: len(emitted)] == emitted else []
        self._seqs[seq_id].extend(emitted)

    def _extend(self, wanted: dict[str, int]) -> None:
        """Grow each sequence's tail to the wanted length; pay for the longest growth once."""
        longest = 0
        for seq_id, n in wanted.items():
            tail = self._tails.setdefault(seq_id, [])
            if len(tail) >= n:
                continue
            truth = self._continuation(self._seqs[seq_id], n)[len(tail) :]
            tail.extend(t if self._rng.random() >= self.error_rate else self._rng.randrange(self.vocab_size)
                        for t in truth)
            longest = max(longest, len(truth))
            self.drafted_tokens += len(truth)
        if self.token_cost_s and longest:
            time.sleep(self.token_cost_s * longest)

    def propose(self, batch: list[DraftInput]) -> list[DraftOutput]:
        for item in batch:
            self._seqs.setdefault(item.seq_id, [])
            self._commit(item.seq_id, list(item.new_tokens))
        self._extend({item.seq_id: item.chain_length for item in batch})
        return [DraftOutput(item.seq_id, item.round, self._tails[item.seq_id][: item.chain_length])
                for item in batch]

    def predraft(self, seq_ids: list[str], num_tokens: int) -> None:
        """Draft ahead: extend the tails of ``seq_ids`` to ``num_tokens`` tokens."""
        self._extend({s: num_tokens for s in seq_ids if s in self._seqs})

    def commit(self, seq_id: str, tokens: list[int]) -> None:
        self._seqs.setdefault(seq_id, [])
        self._commit(seq_id, list(tokens))

    def _reference(self, seq_id: str) -> list[int] | None:
        """The reference the sequence's committed tokens are a prefix of (remembered, checked as it grows)."""
        committed = self._seqs.get(seq_id)
        if committed is None:
            return None
        index, checked = self._ref_of.get(seq_id, (-1, 0))
        ref = self.references[index] if index >= 0 else None
        if ref is None or len(ref) < len(committed) or ref[checked : len(committed)] != committed[checked:]:
            index = next((i for i, r in enumerate(self.references)
                          if len(r) >= len(committed) and r[: len(committed)] == committed), -1)
            ref = self.references[index] if index >= 0 else None
        self._ref_of[seq_id] = (index, len(committed))
        return ref

    def draft_branches(self, branches: list[Branch], ready: Ready | None = None) -> list[Chain]:
        out = []
        deepest = 0
        for br in branches:
            ref, n = self._reference(br.seq_id), len(self._seqs.get(br.seq_id, ()))
            at = n + len(br.extra)
            truth = (ref[at : at + br.num_tokens] if ref is not None and list(ref[n:at]) == list(br.extra)
                     else [])
            tokens: list[int] = []
            alternatives: list[list[int]] = []
            for t in truth:
                token = t if self._rng.random() >= self.error_rate else self._rng.randrange(self.vocab_size)
                tokens.append(token)
                alternatives.append([t] if token != t and br.alternatives else [])
            deepest = max(deepest, len(truth))
            self.drafted_tokens += len(truth)
            out.append(Chain(tokens, alternatives))
        if self.token_cost_s and deepest:
            if ready is not None and deepest > 1:  # every chain but its last token: the proposals can go
                time.sleep(self.token_cost_s * (deepest - 1))
                ready([Chain(c.tokens[: b.num_tokens - 1], c.alternatives[: b.num_tokens - 1])
                       for b, c in zip(branches, out)])
                time.sleep(self.token_cost_s)
            else:
                time.sleep(self.token_cost_s * deepest)
        return out

    def verified(self, results: list[VerifyResult]) -> None:
        for result in results:
            if result.seq_id in self._seqs:
                self._commit(result.seq_id, list(result.emitted_tokens))

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)
            self._tails.pop(seq_id, None)
            self._ref_of.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._seqs)
