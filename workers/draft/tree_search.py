"""Growing a draft token tree depth by depth (EAGLE-2's dynamic tree), for any model-based draft.

A draft model (an EAGLE head, a small LM) first scores the sequence's committed context: its
distribution at the last committed token gives the root's ``topk`` most likely children. Each
later pass runs the *frontier* — the ``topk`` nodes of the newest depth with the highest cumulative
draft log-probability — and adds each frontier node's ``topk`` most likely children. The frontier's
keys go to cache slots after the committed context (slot s at position ``base + s - 1``), and each
frontier node attends to the committed context, its ancestors' slots and its own (``slot_mask``).
Of every node seen, the ``budget`` with the highest cumulative log-probability are proposed,
ancestors before children and siblings best first (:meth:`DraftTree.best`).

The candidates are a deterministic function of the context (no sampling), so the proposal carries
no distributions and the target verifies them as one-hot drafts, which its recursive rule keeps
lossless for greedy and sampled requests alike.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from ..engine.attention import AttentionMetadata
from ..speculation.payloads import ROOT, DraftInput


def tree_shape(item: DraftInput, default_topk: int, default_depth: int) -> tuple[int, int] | None:
    """(top-k, depth) of the tree to draft for ``item`` (the request's, else the worker's); None: a chain."""
    topk = item.tree_topk or default_topk
    if topk <= 1 or item.num_speculative_tokens <= 1:
        return None
    depth = item.tree_depth or default_depth or item.num_speculative_tokens
    return topk, max(1, min(depth, item.chain_budget))


class DraftTree:
    """One sequence's tree while it grows. ``seq`` is the caller's; ``base``: the first tree slot's position."""

    def __init__(self, seq, budget: int, topk: int, depth: int, base: int):
        self.seq, self.budget, self.topk, self.depth, self.base = seq, budget, topk, depth, base
        self.tokens: list[int] = []
        self.parents: list[int] = []  # node index or ROOT
        self.depths: list[int] = []
        self.scores: list[float] = []  # cumulative draft log-probability
        self.state: dict[int, torch.Tensor] = {}  # node (ROOT: the root) -> what its children's pass needs
        self.slot: dict[int, int] = {}  # node -> its slot (1-based)
        self.newest: list[int] = []  # nodes of the newest depth
        self.front: list[int] = []  # the frontier taken last (in slot order)

    @property
    def num_slots(self) -> int:
        return len(self.slot)

    @staticmethod
    def max_slots(topk: int, depth: int) -> int:
        """Cache slots a tree of this shape can take after the committed context."""
        return topk * (depth - 1)

    def expand(self, node: int, logp: torch.Tensor, state: torch.Tensor | None = None) -> None:
        """Record ``node``'s draft log-probabilities [V] (and state) and add its top-k children."""
        if state is not None:
            self.state[node] = state
        depth = 1 if node == ROOT else self.depths[node] + 1
        if depth > self.depth:
            return
        base_score = 0.0 if node == ROOT else self.scores[node]
        values, ids = logp.topk(self.topk)
        for v, t in zip(values.tolist(), ids.tolist()):
            if v == float("-inf"):
                break
            self.tokens.append(t)
            self.parents.append(node)
            self.depths.append(depth)
            self.scores.append(base_score + v)
            self.newest.append(len(self.tokens) - 1)

    def frontier_size(self) -> int:
        return len(self.newest) if self.newest and self.depths[self.newest[0]] < self.depth else 0

    def take_frontier(self) -> list[int]:
        """The top-k nodes of the newest depth by score; they take the next slots and are run next."""
        self.front = heapq.nlargest(self.topk, self.newest, key=lambda n: self.scores[n])
        self.newest = []
        for n in self.front:
            self.slot[n] = len(self.slot) + 1
        return self.front

    def position(self, node: int) -> int:
        """Position of ``node``'s token in the sequence (the root's children follow ``base - 1``)."""
        return self.base - 1 + self.depths[node]

    def slot_mask(self) -> torch.Tensor:
        """[frontier, slots] bool over every slot so far: each node of the newest frontier sees its
        ancestors' slots and its own."""
        mask = torch.zeros(len(self.front), self.num_slots, dtype=torch.bool)
        for row, n in enumerate(self.front):
            while n != ROOT:
                mask[row, self.slot[n] - 1] = True
                n = self.parents[n]
        return mask

    def best(self) -> tuple[list[int], list[int]]:
        """The ``budget`` best nodes as (tokens, parents): ancestors first, siblings best first."""
        chosen = set(heapq.nlargest(self.budget, range(len(self.tokens)), key=lambda n: self.scores[n]))
        for n in list(chosen):  # a child never outscores its parent, but ties could drop one
            while self.parents[n] != ROOT and self.parents[n] not in chosen:
                n = self.parents[n]
                chosen.add(n)
        order = sorted(chosen, key=lambda n: (self.depths[n], -self.scores[n]))[: self.budget]
        kept = set(order)
        order = [n for n in order if self.parents[n] == ROOT or self.parents[n] in kept]
        index = {n: i for i, n in enumerate(order)}
        return ([self.tokens[n] for n in order],
                [ROOT if self.parents[n] == ROOT else index[self.parents[n]] for n in order])


def frontier_batch(batch: list[DraftTree], block_size: int, device: torch.device | str = "cpu"
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Every tree's frontier as one forward's inputs: token ids [T], positions [T] and the attention
    metadata (each frontier after its tree's slots so far, under the tree's slot mask)."""
    ids, pos, qlens, clens, tables, masks = [], [], [], [], [], []
    for tree in batch:
        ids.extend(tree.tokens[n] for n in tree.front)
        pos.extend(tree.position(n) for n in tree.front)
        qlens.append(len(tree.front))
        clens.append(tree.base + tree.num_slots)
        tables.append(tree.seq.blocks)
        masks.append(tree.slot_mask())
    meta = AttentionMetadata.build(qlens, clens, tables, block_size, device, masks)
    return torch.tensor(ids, device=device), torch.tensor(pos, device=device), meta


def grow(trees: list[DraftTree], run: Callable[[list[DraftTree]], tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Passes 2 .. depth: every tree's frontier taken, run in one batch (``run`` sees the trees, each
    with its ``front`` and ``slot_mask()`` set, and returns log-probabilities [rows, V] and per-row
    states or None, rows in tree then frontier order), and expanded."""
    batch = list(trees)
    for _ in range(max((t.depth for t in batch), default=1) - 1):
        batch = [t for t in batch if t.frontier_size()]
        if not batch:
            return
        for tree in batch:
            tree.take_frontier()
        logps, states = run(batch)
        row = 0
        for tree in batch:
            for n in tree.front:
                tree.expand(n, logps[row], None if states is None else states[row])
                row += 1
