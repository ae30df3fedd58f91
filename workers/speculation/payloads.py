"""The typed phase payloads of speculation, and its sentinels: what target and draft exchange.

Both sides convert protobuf messages into these types at the gRPC edge (:mod:`.convert`). Phases:

- :class:`DraftInput` — draft up to ``num_speculative_tokens`` tokens for a sequence after appending
  ``new_tokens`` (tokens committed since the draft last heard of the sequence);
- :class:`DraftOutput` — the proposal: token ids, their tree (``parents``; empty for a chain) and,
  when the draft sampled, the sparse distribution each token was drawn from; under the pipelined
  seam also the committed prefix it assumes (``start``, ``assumed``);
- :class:`VerifyResult` — the target's verdict: how many drafts it accepted, every token it emitted
  this round, and hidden states for methods that need them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.messages import is_greedy

PAD = -1  # token-id sentinel: no token (padding after a sequence's last draft or emitted token)
ROOT = -1  # parent index of a draft token that follows the last committed token


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


@dataclass(frozen=True)
class HiddenRef:
    """Where a message's hidden rows lie on the data plane (:mod:`.hidden_plane`): rows
    [offset, offset + count) of the ring, or of the streamed plane when ``streamed``."""

    offset: int
    count: int
    streamed: bool = False


@dataclass(frozen=True)
class DraftInput:
    seq_id: str
    round: int
    new_tokens: list[int]
    num_speculative_tokens: int  # γ for this round: a chain's length, or a tree's node budget
    sampling: SamplingSpec = SamplingSpec()
    hidden_states: list[torch.Tensor] = field(default_factory=list)  # per layer: [rows, hidden], see spec.proto
    tree_topk: int = 0  # children per node and depth (0: the draft worker's setting; 1: a chain)
    tree_depth: int = 0  # draft steps (0: the draft worker's setting)
    max_depth: int = 0  # deepest a drafted token can sit and still be emitted (0: no bound but num_speculative_tokens)
    hidden_ref: HiddenRef | None = None  # on a data plane: where hidden_states lie (resolved at the edge)

    @property
    def chain_budget(self) -> int:
        """Tokens a chain drafts: the budget, but none deeper than can be emitted."""
        return min(self.num_speculative_tokens, self.max_depth) if self.max_depth > 0 else self.num_speculative_tokens


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
    parents: list[int] = field(default_factory=list)  # per token: ROOT or an earlier index; empty: a chain
    # Pipelined seam (see :mod:`.staging`): the committed prefix it assumes. Its first token would be
    # token number ``start`` of the sequence (0: not positioned, the answer to ``round``), and
    # ``assumed`` are the last tokens before that position.
    start: int = 0
    assumed: list[int] = field(default_factory=list)
    # Per token, the draft's own estimate that the target accepts it and every token before it (a
    # tree node: its whole path), given the prefix it assumes; empty: no estimate. Evidence for the
    # target's policy only (calibrated there against what it accepts): it never changes what is emitted.
    confidence: list[float] = field(default_factory=list)

    @property
    def is_tree(self) -> bool:
        """True when some token is not the child of the one before it."""
        return any(p != i - 1 for i, p in enumerate(self.parents))


@dataclass(frozen=True)
class VerifyResult:
    seq_id: str
    round: int
    num_accepted: int
    emitted_tokens: list[int]
    hidden_states: list[torch.Tensor] = field(default_factory=list)  # per layer: [len(emitted), hidden]
    hidden_ref: HiddenRef | None = None  # on a data plane: where hidden_states lie (resolved at the edge)
