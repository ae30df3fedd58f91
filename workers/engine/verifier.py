"""Verification of a whole batch's proposals at once: chains and trees, greedy and sampled rows.

Input: the scores of every logits row (:func:`workers.engine.logits.process`; a drafted sequence
has its root row followed by one row per draft node) and the proposals. One pass builds the batch's
tensors from flat Python lists (one ``torch.tensor`` each, never one per sequence), runs the
rejection rule of :mod:`workers.speculation.rejection` (chains; the fused Triton kernel on CUDA) or
:mod:`workers.speculation.tree_rejection` (any tree in the batch; chains ride along as degenerate
trees), and brings the outcome to the host in one copy.

Shapes: B drafted sequences, W = the most draft tokens of any, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..speculation.payloads import PAD, SparseDist
from ..speculation.rejection import rejection_sample, sparse_to_dense
from ..speculation.tree import chain_parents, parent_nodes
from ..speculation.tree_rejection import tree_rejection_sample
from .sampling import argmax_rows, exponentials, uniforms


@dataclass(frozen=True)
class Candidate:
    """One sequence's draft for this step: tokens after its last committed one, their tree
    (``parents``, empty: a chain), the sparse distributions they were drawn from (empty: one-hot),
    the row of its root in the scores, whether it samples greedily, and its generator."""

    tokens: list[int]
    parents: list[int]
    dists: list[SparseDist]
    root_row: int
    greedy: bool
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class Outcome:
    """``path``: the accepted draft token indices in order; ``tokens``: what is emitted (the accepted
    drafts, then one recovered or bonus token)."""

    path: list[int]
    tokens: list[int]


def verify(scores: torch.Tensor, candidates: list[Candidate]) -> list[Outcome]:
    """scores [R, V] float (rows of every candidate); returns one :class:`Outcome` per candidate."""
    if all(c.greedy and not c.parents for c in candidates):
        return _greedy_chains(scores, candidates)
    device, vocab = scores.device, scores.shape[-1]
    batch = len(candidates)
    width = max(len(c.tokens) for c in candidates)
    # [B, W+1] rows of each candidate's root and nodes (padding repeats the root: never read)
    index, tokens, lengths = [], [], []
    for c in candidates:
        k = len(c.tokens)
        index.extend(range(c.root_row, c.root_row + k + 1))
        index.extend([c.root_row] * (width - k))
        tokens.extend(c.tokens)
        tokens.extend([PAD] * (width - k))
        lengths.append(k)
    rows = torch.tensor(index, device=device)
    picked = scores.index_select(0, rows).view(batch, width + 1, vocab)  # [B, W+1, V]
    target = picked.softmax(-1)
    draft_tokens = torch.tensor(tokens, dtype=torch.long, device=device).view(batch, width)  # [B, W]
    greedy = torch.tensor([c.greedy for c in candidates], device=device)  # [B]
    if any(c.greedy for c in candidates):  # greedy rows by the plain decode rule: the argmax of the scores
        best = picked.argmax(-1, keepdim=True)
        target = torch.where(greedy[:, None, None], torch.zeros_like(target).scatter_(-1, best, 1.0), target)
    draft_probs = _draft_probs(candidates, width, vocab, device)  # [B, W, V] or None (all one-hot)
    if all(c.greedy for c in candidates):  # no draws: the greedy rule reads no randomness
        u = torch.zeros(batch, width, device=device)
        e = torch.ones(batch, vocab, device=device)
    else:
        gens = [c.generator for c in candidates]
        u, e = uniforms(batch, width, gens, device), exponentials(batch, vocab, gens, device)
    if any(c.parents for c in candidates):
        parents = parent_nodes([c.parents or chain_parents(len(c.tokens)) for c in candidates], width, device)
        out, path, accepted = tree_rejection_sample(target, draft_tokens, parents, draft_probs, greedy, u, e)
    else:
        sampler = rejection_sample
        if device.type == "cuda":  # the fused kernel; on CPU the torch function is the reference
            from ..speculation.triton_rejection import rejection_sample_triton as sampler
        num_draft = torch.tensor(lengths, dtype=torch.long, device=device)
        if draft_probs is None and device.type == "cuda":
            draft_probs = torch.zeros(batch, width, vocab, device=device)
            draft_probs.scatter_(-1, draft_tokens.clamp(min=0)[..., None], 1.0)
        out, accepted = sampler(target, draft_tokens, draft_probs, num_draft, greedy, u, e)
        path = None
    host = torch.cat([accepted[:, None], out] + ([path] if path is not None else []), dim=1).tolist()  # one copy
    results = []
    depth = out.shape[1]
    for row in host:
        n = row[0]
        chosen = row[1 + depth : 1 + depth + n] if path is not None else list(range(n))
        results.append(Outcome(chosen, row[1 : 2 + n]))
    return results


def _greedy_chains(scores: torch.Tensor, candidates: list[Candidate]) -> list[Outcome]:
    """A batch of greedy chains (the common case): accept while each draft token is its row's argmax,
    then emit the next row's argmax. That is the plain decode rule itself (:func:`.sampling.sample`
    takes the argmax of the same scores), with no softmax over the vocabulary, no draws and no
    dense one-hot drafts: one argmax on the device and one copy to the host. (The general path takes
    the argmax of the softmax, which can tie where the scores do not.)"""
    first = min(c.root_row for c in candidates)
    last = max(c.root_row + len(c.tokens) for c in candidates)
    rows = sum(len(c.tokens) + 1 for c in candidates)
    if last - first + 1 <= 2 * rows:  # the rows lie together (the usual case): the argmax of a view, no gather
        best = argmax_rows(scores[first : last + 1]).tolist()
        starts = [c.root_row - first for c in candidates]
    else:  # spread among many plain rows: gather the candidates' rows first
        index = [r for c in candidates for r in range(c.root_row, c.root_row + len(c.tokens) + 1)]
        best = argmax_rows(scores.index_select(0, torch.tensor(index, device=scores.device))).tolist()
        starts, at = [], 0
        for c in candidates:
            starts.append(at)
            at += len(c.tokens) + 1
    out = []
    for c, at in zip(candidates, starts):
        k = len(c.tokens)
        row = best[at : at + k + 1]
        n = 0
        while n < k and c.tokens[n] == row[n]:
            n += 1
        out.append(Outcome(list(range(n)), c.tokens[:n] + [row[n]]))
    return out


def _draft_probs(candidates: list[Candidate], width: int, vocab: int, device) -> torch.Tensor | None:
    """[B, W, V] dense draft distributions of the sampled candidates that sent them (one-hot for the
    rest), from one padded sparse tensor; None when every candidate is greedy or sent none."""
    if not any(c.dists and not c.greedy for c in candidates):
        return None
    span = max(max((len(d.ids) for d in c.dists), default=1) for c in candidates)
    ids, probs = [], []
    for c in candidates:
        if c.dists and not c.greedy:
            for d in c.dists:
                ids.extend(d.ids)
                ids.extend([PAD] * (span - len(d.ids)))
                probs.extend(d.probs)
                probs.extend([0.0] * (span - len(d.probs)))
        else:  # one-hot on its own token
            for t in c.tokens:
                ids.append(t)
                ids.extend([PAD] * (span - 1))
                probs.append(1.0)
                probs.extend([0.0] * (span - 1))
        pad = width - len(c.tokens)
        ids.extend([PAD] * (pad * span))
        probs.extend([0.0] * (pad * span))
    ids_t = torch.tensor(ids, dtype=torch.long, device=device).view(len(candidates), width, span)
    probs_t = torch.tensor(probs, device=device).view(len(candidates), width, span)
    return sparse_to_dense(ids_t, probs_t, vocab)
