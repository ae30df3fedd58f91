"""A proposal attached to a sequence for one verify step, and the ways it is cut down before the
forward pass: to a prefix (budget, scheduling), or to a subset of its tree closed under parents
(depth, structured outputs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.sequence import Sequence
from ..speculation.payloads import SparseDist
from ..speculation.tree import tree_depths


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
