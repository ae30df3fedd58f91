"""A benchmarking draft with controllable acceptance: it knows the target's greedy continuations.

Given reference sequences (prompt + the target's greedy output), it proposes the next tokens of the
reference that the sequence's committed tokens are a prefix of, replacing each proposed token by a
random one with probability ``error_rate``. Drafting costs nothing, so sweeping ``error_rate``
traces achieved speedup against acceptance with the draft cost ratio c ≈ 0. Not for serving.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from .proposer import DraftInput, DraftOutput, VerifyResult


class OracleProposer:
    method = "oracle"
    hidden_layers: list[int] = []

    def __init__(self, references: list[list[int]], error_rate: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.references = [list(r) for r in references]
        self.error_rate = error_rate
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._seqs: dict[str, list[int]] = {}

    @classmethod
    def from_file(cls, path: str | Path, error_rate: float, vocab_size: int, seed: int = 0) -> OracleProposer:
        """``path``: a JSON list of token lists."""
        return cls(json.loads(Path(path).read_text()), error_rate, vocab_size, seed)

    def _continuation(self, tokens: list[int], n: int) -> list[int]:
        for ref in self.references:
            if len(ref) > len(tokens) and ref[: len(tokens)] == tokens:
                return ref[len(tokens) : len(tokens) + n]
        return []

    def propose(self, batch: list[DraftInput]) -> list[DraftOutput]:
        out = []
        for item in batch:
            start = time.perf_counter()
            tokens = self._seqs.setdefault(item.seq_id, [])
            tokens.extend(item.new_tokens)
            proposal = [t if self._rng.random() >= self.error_rate else self._rng.randrange(self.vocab_size)
                        for t in self._continuation(tokens, item.num_tokens)]
            out.append(DraftOutput(item.seq_id, item.round, proposal, [], time.perf_counter() - start))
        return out

    def verified(self, results: list[VerifyResult]) -> None:
        for result in results:
            if result.seq_id in self._seqs:
                self._seqs[result.seq_id].extend(result.emitted_tokens)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._seqs)
