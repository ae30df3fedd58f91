"""A benchmarking draft with controllable acceptance: it knows the target's greedy continuations.

Given reference sequences (prompt + the target's greedy output), it proposes the next tokens of the
reference that the sequence's committed tokens are a prefix of, replacing each proposed token by a
random one with probability ``error_rate``. Sweeping ``error_rate`` traces achieved speedup against
acceptance α.

Drafting costs nothing unless ``token_cost_s`` is set: then every drafted token costs that long
(a sleep, as if the draft ran on its own accelerator — a real draft model on this machine would
take the target's CPU cores instead), and a batch of sequences costs as much as its longest
proposal, as a batched draft forward does.

Its sampled chains (the synchronous seam's branches, :class:`.drafter.Branch`) extend a tail kept per
sequence, like a draft model's: drafting ahead (a chain longer than the round asks for) is kept while
the target's emitted tokens agree with it and paid for only once. Its greedy branches (the pipelined
seam's) are drawn afresh with the same error process. All the branches of one call cost as one
batched draft pass per depth (``token_cost_s`` × the most tokens a branch drew).
Where it drafted a wrong token, its one alternative there is the reference's token: it stands for a
draft model whose second choice is the target's (the bonus guess after a rejection is then right;
after a full acceptance the guess is its own next draft, right with probability 1 − ``error_rate``).
Not for serving.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

from .drafter import Branch, Capabilities, Draft, Drafter, Ready, SamplingSpec, VerifyResult


class OracleProposer(Drafter):
    """The reference continuation with errors (see the module docstring); benchmarks only."""

    def __init__(self, references: list[list[int]], error_rate: float, vocab_size: int, seed: int = 0,
                 token_cost_s: float = 0.0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        if token_cost_s < 0:
            raise ValueError(f"token_cost_s must be >= 0, got {token_cost_s}")
        self.caps = Capabilities("oracle", vocab_size=vocab_size, stages=True, drafts_ahead=True)
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

    def _grow_tail(self, seq_id: str, n: int) -> int:
        """Grow the sequence's tail to ``n`` tokens; the tokens drawn (each paid for once)."""
        tail = self._tails.setdefault(seq_id, [])
        if len(tail) >= n:
            return 0
        truth = self._continuation(self._seqs[seq_id], n)[len(tail) :]
        tail.extend(t if self._rng.random() >= self.error_rate else self._rng.randrange(self.vocab_size)
                    for t in truth)
        self.drafted_tokens += len(truth)
        return len(truth)

    def commit(self, seq_id: str, tokens: Sequence[int], hidden_states: Sequence = (),
               sampling: SamplingSpec = SamplingSpec()) -> None:
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

    def _guess(self, br: Branch) -> tuple[Draft, int]:
        """A greedy branch drawn afresh: where a token is wrong, its one alternative is the truth."""
        ref, n = self._reference(br.seq_id), len(self._seqs.get(br.seq_id, ()))
        at = n + len(br.extra)
        truth = ref[at : at + br.num_tokens] if ref is not None and list(ref[n:at]) == list(br.extra) else []
        tokens: list[int] = []
        alternatives: list[list[int]] = []
        for t in truth:
            token = t if self._rng.random() >= self.error_rate else self._rng.randrange(self.vocab_size)
            tokens.append(token)
            alternatives.append([t] if token != t and br.alternatives else [])
        self.drafted_tokens += len(truth)
        return Draft(tokens, alternatives), len(truth)

    def draft(self, branches: list[Branch], ready: Ready | None = None) -> list[Draft]:
        out = []
        deepest = 0  # tokens drawn by the longest branch: what the call costs
        for br in branches:
            if br.seq_id not in self._seqs or br.num_tokens <= 0:
                out.append(Draft([]))
            elif br.sampled:  # the synchronous seam's chain: its kept tail
                deepest = max(deepest, self._grow_tail(br.seq_id, br.num_tokens))
                out.append(Draft(self._tails[br.seq_id][: br.num_tokens]))
            else:
                draft, drawn = self._guess(br)
                deepest = max(deepest, drawn)
                out.append(draft)
        if self.token_cost_s and deepest:
            if ready is not None and deepest > 1:  # every chain but its last token: the proposals can go
                time.sleep(self.token_cost_s * (deepest - 1))
                ready([Draft(d.tokens[: b.num_tokens - 1], d.alternatives[: b.num_tokens - 1])
                       for b, d in zip(branches, out)])
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
