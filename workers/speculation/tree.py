"""Token trees: the shape of a tree proposal, and what the target needs to verify one.

A proposal of N draft tokens carries ``parents`` (:class:`~workers.speculation.payloads.DraftOutput`):
the parent of token i is ``ROOT`` (-1, the sequence's last committed token) or an earlier token
index. In the tensors of one verify step the tree has N + 1 *nodes*: node 0 is the root (the last
committed token, which the target computes in the same pass) and node i + 1 is draft token i, so
the parent node of node i + 1 is ``parents[i] + 1``. Parents always precede children, so the first
k tokens of a proposal are themselves a tree, and nodes in index order are a topological order.

A chain is the tree whose every token is the child of the one before: ``parents == [-1, 0, 1, ...]``.
"""

from __future__ import annotations

import torch

from .payloads import ROOT

__all__ = ["ROOT", "ancestor_mask", "chain_parents", "parent_nodes", "tree_depths", "valid_parents"]


def chain_parents(n: int) -> list[int]:
    """Parents of an n-token chain."""
    return list(range(-1, n - 1))


def valid_parents(parents: list[int], num_tokens: int) -> bool:
    """True when ``parents`` describes a tree over ``num_tokens`` tokens (or is empty: a chain)."""
    if not parents:
        return True
    return len(parents) == num_tokens and all(ROOT <= p < i for i, p in enumerate(parents))


def parent_nodes(parents: list[list[int]], width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, width] long: parent node of node i + 1 for each row's tree (0 = root), -1 past its tokens."""
    out = torch.full((len(parents), width), -1, dtype=torch.long)
    for b, par in enumerate(parents):
        if par:
            out[b, : len(par)] = torch.tensor(par, dtype=torch.long) + 1
    return out.to(device)


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each token: 1 for the root's children."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[N+1, N+1] bool over nodes (0 = root): row j is True at j and at every ancestor of j.

    It is the attention mask of the tree's queries over the tree's own keys (each query also sees
    the whole committed context before the root).
    """
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(parents):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return mask.to(device)
