"""Drafting with a smaller language model of the target's tokenizer, on the engine's paged KV cache.

Each sequence keeps one token list: the ``committed`` tokens the target confirmed, followed by a
speculative tail the draft generated (with the distribution each tail token was drawn from). KV is
computed for a prefix of that list. A verdict keeps the longest prefix of the tail that matches
what the target emitted and rolls the rest back (blocks truncated). A proposal reuses tail tokens
that are still consistent, which is how drafting ahead pays off: a chain longer than the round asks
for (``2γ + 1``, asked while the target verifies) extends the tail, assuming every draft (and the
draft's own guess of the bonus token) is accepted; if that assumption holds, the next proposal is
ready without any model call.

Sampled drafts come from q = softmax(logits / T) restricted to its top ``max_support`` tokens (and
the request's top_k), renormalised; that exact q travels with the proposal, so the target's
rejection test stays exact. Greedy requests draft greedily and send no distributions.

With ``tree_topk`` > 1 (the worker's setting or the request's) a proposal is a token tree grown by
:mod:`workers.draft.tree_search`: the LM's own KV cache holds the committed tokens, the frontier of
each depth runs in one batched pass under a tree mask, and the tree's slots are dropped afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..engine.block_manager import BlockManager
from ..engine.model import DecoderModel
from ..engine.model_runner import ModelRunner
from ..speculation.payloads import ROOT
from .drafter import (Branch, Capabilities, Draft, Drafter, Ready, SamplingSpec, SparseDist, VerifyResult,
                      grow_blocks, sample_draft, sequence_for)
from .tree_search import DraftTree, frontier_batch, grow

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # committed + speculative tail
    committed: int = 0
    computed: int = 0  # tokens[:computed] have KV in the cache
    blocks: list[int] = field(default_factory=list)
    dists: list[SparseDist | None] = field(default_factory=list)  # one per tail token
    sampling: SamplingSpec = SamplingSpec()
    generator: torch.Generator | None = None

    @property
    def tail(self) -> list[int]:
        return self.tokens[self.committed :]


class DraftModelProposer(Drafter):
    """A draft LM with its own paged KV cache and rollback."""

    caps = Capabilities("draft_model", drafts_ahead=True)

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int = 16, max_support: int = 64,
                 tree_topk: int = 1, tree_depth: int = 0):
        if tree_topk < 1 or tree_depth < 0:
            raise ValueError(f"tree_topk must be >= 1 and tree_depth >= 0, got {tree_topk} and {tree_depth}")
        self.tree_topk = tree_topk  # defaults for requests that do not ask for a shape (1: chains)
        self.tree_depth = tree_depth  # 0: as deep as the node budget allows
        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.device = self.runner.device  # the model's: its cache, inputs and draws live there
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.block_size = block_size
        self.max_support = max_support
        self.max_len = model.max_positions
        self.seqs: dict[str, _Seq] = {}
        self.forward_calls = 0

    # ------------------------------------------------------------------ the drafter interface

    def commit(self, seq_id: str, tokens: Sequence[int], hidden_states: Sequence = (),
               sampling: SamplingSpec = SamplingSpec()) -> None:
        seq = sequence_for(self.seqs, seq_id, sampling, _Seq, self.device)
        if tokens:
            self._rollback(seq, seq.committed)
            seq.tokens.extend(tokens)
            seq.committed = len(seq.tokens)

    def draft(self, branches: list[Branch], ready: Ready | None = None) -> list[Draft]:
        """Chains extend each sequence's tail (drawn as its request samples) and reuse what it holds;
        trees are grown afresh. Branches past the committed tokens only (it does not stage)."""
        chains = {b.seq_id: b.num_tokens for b in branches if b.tree is None and b.seq_id in self.seqs}
        self._extend(chains)
        trees = self._draft_trees({b.seq_id: (b.num_tokens, *b.tree) for b in branches
                                   if b.tree is not None and b.seq_id in self.seqs})
        out = []
        for br in branches:
            if br.seq_id in trees:
                tokens, parents = trees[br.seq_id]
                out.append(Draft(tokens, parents=parents))
            elif br.seq_id not in chains:
                out.append(Draft([]))
            else:
                seq = self.seqs[br.seq_id]
                n = min(br.num_tokens, len(seq.tail))
                out.append(Draft(seq.tail[:n], dists=[] if seq.sampling.greedy else seq.dists[:n]))
        return out

    def verified(self, results: list[VerifyResult]) -> None:
        for result in results:
            seq = self.seqs.get(result.seq_id)
            if seq is None:
                continue
            tail, emitted = seq.tail, result.emitted_tokens
            same = 0
            while same < min(len(tail), len(emitted)) and tail[same] == emitted[same]:
                same += 1
            if same == len(emitted):  # the tail continues what the target emitted: keep the rest
                seq.committed += same
                seq.dists = seq.dists[same:]
                continue
            self._rollback(seq, seq.committed + same)
            seq.tokens.extend(emitted[same:])
            seq.committed = len(seq.tokens)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None and seq.blocks:
                self.blocks.free(seq.blocks)

    def __len__(self) -> int:
        return len(self.seqs)

    # ------------------------------------------------------------------ internals

    def _rollback(self, seq: _Seq, length: int) -> None:
        """Drop tokens (and their KV) past ``length``."""
        del seq.tokens[length:]
        seq.dists = seq.dists[: max(0, length - seq.committed)]
        if seq.computed > length:
            seq.computed = length
            copies = self.blocks.truncate(seq.blocks, length)
            self.runner.copy_blocks(copies)


    def _extend(self, wanted: dict[str, int]) -> None:
        """Generate until every listed sequence has the wanted number of tail tokens (batched)."""
        while True:
            active = [(sid, self.seqs[sid]) for sid, n in wanted.items()
                      if len(self.seqs[sid].tail) < n and len(self.seqs[sid].tokens) < self.max_len - 1]
            ready = []
            for sid, seq in active:
                if not seq.tokens:
                    wanted[sid] = 0
                    continue
                seq.computed = min(seq.computed, len(seq.tokens) - 1)  # something to run
                # The last token's KV is computed in the same pass that samples the next token.
                if grow_blocks(self.blocks, seq.blocks, len(seq.tokens)):
                    ready.append(seq)
                else:
                    log.warning("draft KV cache full: no proposal for %s this round", sid)
                    wanted[sid] = 0
            if not ready:
                return
            chunks = [(seq.tokens[seq.computed :], seq.computed, seq.blocks) for seq in ready]
            out = self.runner.forward(chunks, [1] * len(ready))
            self.forward_calls += 1
            for seq, logits in zip(ready, out.logits):
                seq.computed = len(seq.tokens)
                token, dist = sample_draft(logits, seq.sampling, seq.generator, self.max_support)
                seq.tokens.append(token)
                seq.dists.append(dist)

    def _run_frontier(self, batch: list[DraftTree]) -> tuple[torch.Tensor, None]:
        """The draft LM over every tree's frontier tokens."""
        ids, pos, meta = frontier_batch(batch, self.block_size, self.runner.device)
        result = self.model(ids, pos, meta, self.runner.kv_caches)
        self.forward_calls += 1
        return result.logits.log_softmax(-1), None

    @torch.inference_mode()
    def _draft_trees(self, wanted: dict[str, tuple[int, int, int]]) -> dict[str, tuple[list[int], list[int]]]:
        """Seq id -> (node budget, top-k, depth) in; seq id -> (tokens, parents) out."""
        out: dict[str, tuple[list[int], list[int]]] = {}
        trees: dict[str, DraftTree] = {}
        for sid, (budget, topk, depth) in wanted.items():
            seq = self.seqs[sid]
            self._rollback(seq, seq.committed)  # a chain tail drafted ahead is of no use to a tree
            out[sid] = ([], [])
            length = len(seq.tokens)
            if not length or length + DraftTree.max_slots(topk, depth) >= self.max_len:
                continue
            seq.computed = min(seq.computed, length - 1)  # the last token runs in the root's pass
            if grow_blocks(self.blocks, seq.blocks, length + DraftTree.max_slots(topk, depth)):
                trees[sid] = DraftTree(seq, budget, topk, depth, length)
            else:
                log.warning("draft KV cache full: no proposal for %s this round", sid)
        if not trees:
            return out
        # pass 1: the committed tokens not yet in the cache; the last one's logits give the root's children
        batch = list(trees.values())
        chunks = [(t.seq.tokens[t.seq.computed :], t.seq.computed, t.seq.blocks) for t in batch]
        logits = self.runner.forward(chunks, [1] * len(batch)).logits
        self.forward_calls += 1
        for tree, row in zip(batch, logits.log_softmax(-1)):
            tree.seq.computed = tree.base
            tree.expand(ROOT, row)
        grow(batch, self._run_frontier)  # passes 2..depth: each frontier under its tree mask
        for sid, tree in trees.items():
            out[sid] = tree.best()
            # the committed tokens stay; the tree's slots go
            self.runner.copy_blocks(self.blocks.truncate(tree.seq.blocks, tree.base))
        return out
