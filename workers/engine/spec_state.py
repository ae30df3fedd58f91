"""What the engine keeps per speculating request (:class:`SpecState`), a proposal attached to a sequence
for one step (:class:`Drafted`), and a sequence to draft for (:class:`Request`); the
:class:`.speculator.Speculator` holds them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.messages import SpecUsage

from ..speculation.payloads import SparseDist
from ..speculation.tree import tree_depths
from .budget import Acceptance
from .sequence import Sequence

# Why a speculating sequence's step ran plainly where its draft had the chance (asked, and it proposed
# nothing usable, or its acceptance paused it): such a step counts against the draft's fit
DRAFT_FAILED = frozenset({"draft_late", "no_proposal", "draft_empty", "draft_stale", "draft_invalid", "paused"})


@dataclass
class SpecState:
    num_speculative_tokens: int  # γ: the request's chain length or node budget
    adapted: int  # adaptive γ for the next round (≤ num_speculative_tokens); 0: paused
    tree_topk: int = 0  # tree shape asked of the draft (0: the draft worker's setting)
    tree_depth: int = 0
    told: int = 0  # tokens of the sequence the draft worker knows
    round: int = 0  # rounds asked for so far; the proposal for round r answers the r-th request
    asked: int = 0  # tokens asked for in the latest round
    usage: SpecUsage = SpecUsage()
    acceptance: Acceptance = field(default_factory=Acceptance)
    pause: int = 0  # plain steps left before drafting is tried again
    why_plain: str = ""  # why the sequence's next step runs without a draft ("": it was asked for one)
    confidence: list[float] = field(default_factory=list)  # the draft's, for the chain verified this step
    plain_steps: dict[str, int] = field(default_factory=dict)  # decode steps without a draft, by why
    # The draft worker it speculates with and that stream's seam (None: the engine's default,
    # Speculator.draft_id and .pipelined): a target with several draft streams places each sequence
    # on one (Speculator.assign)
    draft: str | None = None
    pipelined: bool | None = None
    hint: str = ""  # the draft worker the router chose for the request ("": none)
    lora: str = ""  # the request's LoRA adapter: a draft trained against it is placed first
    # per draft worker it speculated with: [decode steps on it, draft tokens accepted] (see placement's fit)
    fit: dict[str, list[int]] = field(default_factory=dict)
    settled: bool = False  # placement compared its drafts' fit and chose: it moves only if that draft goes


@dataclass
class Drafted:
    """A proposal attached to a sequence for this step: its tokens follow the committed ones."""

    seq: Sequence
    tokens: list[int]
    dists: list[SparseDist]
    parents: list[int]  # empty: a chain
    masks: torch.Tensor | None = None  # [len(tokens) + 1, W] int32: the grammar's mask at each node

    @property
    def depth(self) -> int:
        return max(tree_depths(self.parents)) if self.parents else len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each token (1 for the root's children)."""
        return tree_depths(self.parents) if self.parents else list(range(1, len(self.tokens) + 1))

    def ancestors(self) -> list[tuple[int, ...]]:
        """Per node (root first): the draft tokens on the path from the root to it."""
        if not self.parents:
            return [tuple(self.tokens[:i]) for i in range(len(self.tokens) + 1)]
        out: list[tuple[int, ...]] = [()]
        for i, p in enumerate(self.parents):
            out.append(out[p + 1] + (self.tokens[i],))
        return out

    def keep(self, n: int) -> Drafted:
        """The first n tokens (parents precede children, so they still form a tree)."""
        masks = self.masks[: n + 1] if self.masks is not None else None
        return Drafted(self.seq, self.tokens[:n], self.dists[:n], self.parents[:n], masks)

    def subset(self, keep: list[int]) -> Drafted:
        """The tokens ``keep`` (ascending, closed under parents), indices renumbered."""
        if len(keep) == len(self.tokens):
            return self
        if not self.parents:  # a chain keeps a prefix
            return self.keep(len(keep))
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [self.parents[i] if self.parents[i] < 0 else new_index[self.parents[i]] for i in keep]
        masks = self.masks[[0] + [i + 1 for i in keep]] if self.masks is not None else None
        return Drafted(self.seq, [self.tokens[i] for i in keep], [self.dists[i] for i in keep] if self.dists else [],
                       parents, masks)


@dataclass(frozen=True)
class Request:
    """A sequence to draft for: ``num_speculative_tokens`` (a chain's length or a tree's budget), and the deepest
    a drafted token may sit and still be emitted (0: no bound but num_speculative_tokens)."""

    seq: Sequence
    state: SpecState
    num_speculative_tokens: int
    max_depth: int
