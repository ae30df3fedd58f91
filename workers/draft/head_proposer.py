"""Drafting with Medusa heads or an MLP speculator (:mod:`workers.draft.spec_heads`).

Both read only the target's last hidden state h_t at the position before the newest committed token
x_{t+1} (one row per new token arrives with proposal requests and verdicts; the last row is the one
that counts) and need no KV cache of their own, so a sequence's whole state here is its committed
tokens and that one row. Each proposal is drafted afresh from them:

- chains: stage i reads the state and the token before (x_{t+1}, then the drafts), and its logits
  give draft i + 1 — the argmax for greedy requests, a sample (with its distribution, for the target's
  rejection test) for sampled ones; at most ``n_predict`` tokens;
- trees (``tree_topk`` > 1): EAGLE-2's dynamic tree through :mod:`workers.draft.tree_search` — the
  root's ``topk`` best children, then per depth the ``topk`` best nodes of the newest depth by
  cumulative log-probability expanded by the next stage, the ``num_tokens`` best nodes proposed, with
  no distributions (deterministic candidates, verified losslessly as one-hot drafts). For Medusa every
  node of a depth has the same children (the heads do not read the drafted tokens), as in its paper's
  trees.

A sequence whose hidden states are missing (it began before this worker joined, or its target sends
other layers) gets empty proposals.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..speculation.convert import dtype_name
from ..speculation.payloads import ROOT
from .drafter import (Branch, Capabilities, Draft, Drafter, Ready, SamplingSpec, VerifyResult, sample_draft,
                      sequence_for)
from .spec_heads import SpecHead
from .tree_search import DraftTree, grow

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    last_token: int = -1  # the newest committed token x_{t+1}
    hidden: torch.Tensor | None = None  # h_t [H]
    sampling: SamplingSpec = SamplingSpec()
    generator: torch.Generator | None = None
    broken: bool = False


class HeadProposer(Drafter):
    """Runs where the head's parameters are, in their dtype: the hidden row, token ids and seeded
    generators go there."""

    def __init__(self, head: SpecHead, target_num_layers: int, max_support: int = 64, tree_topk: int = 1,
                 tree_depth: int = 0):
        if tree_topk < 1 or tree_depth < 0:
            raise ValueError(f"tree_topk must be >= 1 and tree_depth >= 0, got {tree_topk} and {tree_depth}")
        self.head = head.eval()
        param = next(head.parameters())
        self.dtype, self.device = param.dtype, param.device
        # the target's last layer, after its final norm (the LM head's input), in the head's dtype
        self.caps = Capabilities(head.kind, (target_num_layers,), dtype_name(param.dtype))
        self.max_support = max_support
        self.tree_topk, self.tree_depth = tree_topk, tree_depth
        self.seqs: dict[str, _Seq] = {}
        self.forward_calls = 0

    def __len__(self) -> int:
        return len(self.seqs)

    # ------------------------------------------------------------------ the drafter interface

    def commit(self, seq_id: str, tokens: Sequence[int], hidden_states: Sequence[torch.Tensor] = (),
               sampling: SamplingSpec = SamplingSpec()) -> None:
        """``hidden_states``: one layer, [len(tokens), H] (the first call: one row fewer)."""
        seq = sequence_for(self.seqs, seq_id, sampling, _Seq, self.device)
        if tokens:
            first = seq.last_token < 0
            self._commit(seq, list(tokens), list(hidden_states), len(tokens) - first)

    def draft(self, branches: list[Branch], ready: Ready | None = None) -> list[Draft]:
        """Every draft afresh from the sequence's last hidden row (branches past the committed tokens
        only: it does not stage); chains drawn as the request samples."""
        live = [b for b in branches if self._ready(b.seq_id)]
        drafted = self._draft_chains({b.seq_id: b.num_tokens for b in live if b.tree is None})
        drafted.update(self._draft_trees({b.seq_id: (b.num_tokens, *b.tree) for b in live if b.tree is not None}))
        return [drafted.get(b.seq_id, Draft([])) for b in branches]

    def verified(self, results: list[VerifyResult]) -> None:
        for result in results:
            seq = self.seqs.get(result.seq_id)
            if seq is not None and result.emitted_tokens:
                self._commit(seq, result.emitted_tokens, result.hidden_states, len(result.emitted_tokens))

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)

    # ------------------------------------------------------------------ internals

    def _commit(self, seq: _Seq, tokens: list[int], hidden: list[torch.Tensor], rows: int) -> None:
        seq.last_token = tokens[-1]
        if rows <= 0:
            seq.hidden = None  # a one-token prompt: no position before it
            return
        if len(hidden) != 1 or hidden[0].shape[0] != rows:
            if not seq.broken:
                log.warning("a sequence arrived without the target's last hidden states: no %s proposals for it",
                            self.caps.method)
            seq.broken = True
            return
        seq.hidden = hidden[0][-1].to(self.device, self.dtype)

    def _ready(self, seq_id: str) -> bool:
        seq = self.seqs.get(seq_id)
        return seq is not None and not seq.broken and seq.hidden is not None

    def _start(self, seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.head.init_state(torch.stack([s.hidden for s in seqs]))
        return state, torch.tensor([s.last_token for s in seqs], device=self.device)

    @torch.inference_mode()
    def _draft_chains(self, wanted: dict[str, int]) -> dict[str, Draft]:
        wanted = {sid: min(n, self.head.n_predict) for sid, n in wanted.items() if n > 0}
        if not wanted:
            return {}
        ids = list(wanted)
        seqs = [self.seqs[sid] for sid in ids]
        state, prev = self._start(seqs)
        out = {sid: Draft([]) for sid in ids}
        rows = list(range(len(ids)))  # rows of ``state`` still drafting
        for i in range(max(wanted.values())):
            state, logits = self.head.step(state, prev, i)
            self.forward_calls += 1
            picked = []
            for row, logit in zip(rows, logits):
                seq = seqs[row]
                token, dist = sample_draft(logit, seq.sampling, seq.generator, self.max_support)
                draft = out[ids[row]]
                draft.tokens.append(token)
                if dist is not None:
                    draft.dists.append(dist)
                picked.append(token)
            keep = [k for k, row in enumerate(rows) if wanted[ids[row]] > i + 1]
            if not keep:
                break
            index = torch.tensor(keep, device=self.device)
            state, prev = state[index], torch.tensor(picked, device=self.device)[index]
            rows = [rows[k] for k in keep]
        return out

    @torch.inference_mode()
    def _draft_trees(self, wanted: dict[str, tuple[int, int, int]]) -> dict[str, Draft]:
        if not wanted:
            return {}
        trees = {sid: DraftTree(self.seqs[sid], budget, topk, min(depth, self.head.n_predict), 0)
                 for sid, (budget, topk, depth) in wanted.items()}
        batch = list(trees.values())
        state, prev = self._start([tree.seq for tree in batch])
        state, logits = self.head.step(state, prev, 0)
        self.forward_calls += 1
        for tree, s, row in zip(batch, state, logits.log_softmax(-1)):
            tree.expand(ROOT, row, s)
        level = [1]  # the stage the next frontier runs (its nodes' depth)

        def run(front: list[DraftTree]) -> tuple[torch.Tensor, torch.Tensor]:
            states = torch.stack([_node_state(t, n) for t in front for n in t.front])
            tokens = torch.tensor([t.tokens[n] for t in front for n in t.front], device=self.device)
            new_state, logits = self.head.step(states, tokens, level[0])
            self.forward_calls += 1
            level[0] += 1
            return logits.log_softmax(-1), new_state

        grow(batch, run)
        best = {sid: tree.best() for sid, tree in trees.items()}
        return {sid: Draft(tokens, parents=parents) for sid, (tokens, parents) in best.items()}


def _node_state(tree: DraftTree, node: int) -> torch.Tensor:
    """The state stage depth(node) reads for ``node``: its parent's output (the root's for depth 1)."""
    parent = tree.parents[node]
    return tree.state[ROOT if parent == ROOT else parent]

