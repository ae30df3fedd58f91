"""The ``Proposer`` protocol every draft method implements, and the typed phase payloads.

The draft worker converts protobuf messages into these types at the gRPC edge and hands them to a
proposer. A proposer keeps per-sequence state: the tokens the target has committed, and whatever it
drafted on top of them. Phases:

- :class:`DraftInput` — draft up to ``num_tokens`` tokens for a sequence after appending
  ``new_tokens`` (tokens committed since the draft last heard of the sequence);
- :class:`DraftOutput` — the proposal: token ids and, when the draft sampled, the sparse
  distribution each token was drawn from;
- :class:`VerifyResult` — the target's verdict: how many drafts it accepted, every token it emitted
  this round, and hidden states for methods that need them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DraftInput:
    seq_id: str
    round: int
    new_tokens: list[int]
    num_tokens: int
    sampling: SamplingSpec = SamplingSpec()
    hidden_states: list[torch.Tensor] = field(default_factory=list)  # per layer: [rows, hidden], see spec.proto


@dataclass(frozen=True)
class SparseDist:
    ids: list[int]
    probs: list[float]


@dataclass(frozen=True)
class DraftOutput:
    seq_id: str
    round: int
    token_ids: list[int]
    distributions: list[SparseDist] = field(default_factory=list)  # empty: greedy (one-hot)
    draft_seconds: float = 0.0


@dataclass(frozen=True)
class VerifyResult:
    seq_id: str
    round: int
    num_accepted: int
    emitted_tokens: list[int]
    hidden_states: list[torch.Tensor] = field(default_factory=list)  # per layer: [len(emitted), hidden]


class Proposer(Protocol):
    """A draft method. Calls for one sequence arrive in order: propose, verified, propose, ..., release."""

    method: str
    hidden_layers: list[int]  # target layers whose hidden states it needs (empty: none)

    def propose(self, batch: list[DraftInput]) -> list[DraftOutput]:
        """Draft for every sequence of the batch (one output per input, same order)."""
        ...

    def verified(self, results: list[VerifyResult]) -> None:
        """Commit what the target accepted and emitted; roll back the rest."""
        ...

    def release(self, seq_ids: list[str]) -> None:
        """Forget sequences that finished."""
        ...


def sample_draft(logits: torch.Tensor, sampling: SamplingSpec, generator: torch.Generator | None,
                 max_support: int) -> tuple[int, SparseDist | None]:
    """One draft token from logits [V], and the distribution it was drawn from (None: greedy).

    Sampled drafts come from q = softmax(logits / T) over its top min(max_support, top_k) tokens,
    renormalised: a sparse q that travels whole, so the target's rejection test stays exact.
    """
    if sampling.greedy:
        return int(logits.argmax()), None
    k = min(max_support, sampling.top_k) if sampling.top_k > 0 else max_support
    top_vals, top_ids = (logits.float() / sampling.temperature).topk(min(k, logits.shape[-1]))
    probs = top_vals.softmax(-1)  # [k]
    choice = int(torch.multinomial(probs, 1, generator=generator))
    return int(top_ids[choice]), SparseDist(top_ids.tolist(), probs.tolist())


def grow_blocks(manager, blocks: list[int], num_tokens: int) -> bool:
    """Extend a block table (in place) to hold ``num_tokens`` tokens; False when the cache is full."""
    need = -(-num_tokens // manager.block_size) - len(blocks)
    if need <= 0:
        return True
    if not manager.can_allocate(need):
        return False
    blocks.extend(manager.allocate(need))
    return True
