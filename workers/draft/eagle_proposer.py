"""Drafting with an EAGLE head fed by the target's hidden states (see :mod:`workers.draft.eagle`).

Per sequence: tokens (committed + drafted tail) and features f_t per position — from the target's
hidden states for committed positions (they arrive with proposal requests and verdicts, one row
per new token: the hidden state at the position just before it), from the head for drafted ones.
The head's KV cache holds pairs (x_{t+1}, f_t) for t < ``computed``. A verdict replaces predicted
features by the target's real ones, so the head's KV is rolled back to the first position whose
feature changed and the drafted tail is dropped: the next proposal is drafted from real features.
A sequence whose target features are incomplete (it started before this draft worker joined)
gets empty proposals rather than guesses.

Trees (``tree_topk`` > 1, EAGLE-2's dynamic tree): the head first runs over the committed pairs
(the root), then ``tree_depth - 1`` more passes, each over the frontier: the ``tree_topk`` nodes of
the newest depth with the highest cumulative draft log-probability, every one expanded to its
``tree_topk`` most likely children. Frontier nodes sit in cache slots after the committed pairs and
attend to the committed pairs and to their own ancestors only (a tree mask over those slots). Of
every node seen, the ``num_tokens`` with the highest cumulative log-probability are proposed
(ancestors before children, siblings best first), with no distributions: the candidates are a
deterministic function of the context, which the target's recursive rule verifies losslessly for
greedy and sampled requests alike. The tree's slots are dropped afterwards (drafting resumes from
the committed pairs).

The pipelined seam (chains only): staged branches (greedy chains, :class:`.drafter.Branch`) are
drafted as forks of the head's chain by :class:`.eagle_staging.EagleForks`, through this drafter's
head API (``seqs``, ``forward``, ``run_pairs``, ``has_features``, ``rollback``, ``truncate_tail``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..engine.attention import AttentionMetadata, allocate_kv_cache
from ..engine.block_manager import BlockManager
from ..speculation.convert import dtype_name
from .eagle import EagleHead
from .head_graphs import HeadGraphs
from ..speculation.payloads import ROOT
from .tree_search import DraftTree, frontier_batch, grow
from .eagle_staging import EagleForks
from .drafter import (Branch, Capabilities, Draft, Drafter, Ready, SamplingSpec, SparseDist, VerifyResult,
                      grow_blocks, sample_draft, sequence_for)

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)
    committed: int = 0
    feats: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> feature [H]
    computed: int = 0  # pairs t < computed are in the head's KV cache
    blocks: list[int] = field(default_factory=list)
    dists: list[SparseDist | None] = field(default_factory=list)
    sampling: SamplingSpec = SamplingSpec()
    generator: torch.Generator | None = None
    broken: bool = False  # target features missing: no proposals
    root: tuple[int, torch.Tensor] | None = None  # (pairs, the head's output at the last of them), while cached
    kept: list = field(default_factory=list)  # per recent staging call, its forks (pipelined seam)

    @property
    def tail(self) -> list[int]:
        return self.tokens[self.committed :]


class EagleProposer(Drafter):
    """Every tensor it builds (inputs, positions, attention metadata, the KV cache, seeded generators)
    lives on the head's device; target hidden states go there in the head's dtype in one copy."""

    def __init__(self, head: EagleHead, hidden_layers: list[int], num_blocks: int, block_size: int = 16,
                 max_support: int = 64, tree_topk: int = 1, tree_depth: int = 0, cuda_graphs: bool = False,
                 graph_batch: int = 64, staging: bool = True):
        """``cuda_graphs``: replay chain steps after the first as CUDA graphs (:mod:`.head_graphs`) of up
        to ``graph_batch`` sequences; on a CPU head the same static steps run eagerly (tests).
        ``staging``: draft branches for the pipelined seam (the draft worker's ``--speculative-config`` eagle_pipelined;
        without it the head serves the synchronous seam)."""
        if tree_topk < 1 or tree_depth < 0:
            raise ValueError(f"tree_topk must be >= 1 and tree_depth >= 0, got {tree_topk} and {tree_depth}")
        self.head = head
        self.tree_topk = tree_topk  # defaults for requests that do not ask for a shape (1: chains)
        self.tree_depth = tree_depth  # 0: as deep as the node budget allows
        param = next(head.parameters())
        self.device, self.dtype = param.device, param.dtype
        # targets send hidden states in its dtype; it stages chains only (set to draft trees, or not to
        # stage, it serves the synchronous seam)
        self.caps = Capabilities("eagle3" if head.version == 3 else "eagle", tuple(hidden_layers),
                                 dtype_name(param.dtype), stages=staging and tree_topk <= 1,
                                 distillable=head.version == 3)
        self.forks = EagleForks(self)
        cfg = head.cfg
        # with graphs, one block more than the manager hands out: padding rows write there
        self.kv = allocate_kv_cache(head.num_kv_layers, num_blocks + (1 if cuda_graphs else 0), block_size,
                                    cfg.num_kv_heads, cfg.head_dim, param.dtype, param.device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.block_size = block_size
        self.max_support = max_support
        self.seqs: dict[str, _Seq] = {}
        self.forward_calls = 0
        self.recorder = None  # online distillation's :class:`.online.Recorder`, when on
        self.weight_swaps = 0
        self.graphs: HeadGraphs | None = None
        if cuda_graphs:
            graphs = HeadGraphs(head, self.kv, block_size, head.rotary.cos.shape[0], num_blocks, graph_batch,
                                capture=self.device.type == "cuda")
            try:
                graphs.capture_all()
            except Exception:  # drafting goes on eagerly: slower, as correct
                log.warning("CUDA graphs of the draft head could not be captured; its steps run eagerly",
                            exc_info=True)
            else:
                self.graphs = graphs

    def __len__(self) -> int:
        return len(self.seqs)

    # ------------------------------------------------------------------ the drafter interface

    def commit(self, seq_id: str, tokens: Sequence[int], hidden_states: Sequence[torch.Tensor] = (),
               sampling: SamplingSpec = SamplingSpec()) -> None:
        """Committed ``tokens`` (after the ones already heard of) with the hidden rows of the positions
        before each, [len(tokens), H] per layer (the first call: its prompt, one row fewer)."""
        seq = sequence_for(self.seqs, seq_id, sampling, _Seq, self.device)
        if not tokens:
            return
        self.truncate_tail(seq)
        first = len(seq.tokens)
        seq.tokens.extend(tokens)
        seq.committed = len(seq.tokens)
        rows = len(tokens) - (first == 0)
        self._set_features(seq, max(first - 1, 0), list(hidden_states), rows)
        if self.recorder is not None:
            self.recorder.rows(seq_id, max(first - 1, 0), list(hidden_states), rows, len(tokens), sampling.greedy)

    def draft(self, branches: list[Branch], ready: Ready | None = None) -> list[Draft]:
        """Sampled chains extend each sequence's tail (the synchronous seam), greedy chains fork the
        head's chain (the pipelined seam: :class:`.eagle_staging.EagleForks`), trees are grown afresh."""
        forked = [i for i, b in enumerate(branches) if b.tree is None and not b.sampled]
        out = dict(zip(forked, self.forks.draft([branches[i] for i in forked], ready))) if forked else {}
        chains = {b.seq_id: b.num_tokens for b in branches if b.tree is None and b.sampled and b.seq_id in self.seqs}
        self._extend(chains)
        trees = self._draft_trees({b.seq_id: (b.num_tokens, *b.tree) for b in branches
                                   if b.tree is not None and b.seq_id in self.seqs})
        for i, br in enumerate(branches):
            if br.tree is not None and br.seq_id in trees:
                tokens, parents = trees[br.seq_id]
                out[i] = Draft(tokens, parents=parents)
            elif br.sampled and br.seq_id in chains:
                seq = self.seqs[br.seq_id]
                n = min(br.num_tokens, len(seq.tail))
                out[i] = Draft(seq.tail[:n], dists=[] if seq.sampling.greedy else seq.dists[:n])
        return [out.get(i, Draft([])) for i in range(len(branches))]

    def verified(self, results: list[VerifyResult]) -> None:
        for result in results:
            seq = self.seqs.get(result.seq_id)
            if seq is None:
                continue
            self.truncate_tail(seq)
            first = len(seq.tokens)
            seq.tokens.extend(result.emitted_tokens)
            seq.committed = len(seq.tokens)
            self._set_features(seq, first - 1, result.hidden_states, len(result.emitted_tokens))
            if self.recorder is not None:
                self.recorder.rows(result.seq_id, first - 1, result.hidden_states, len(result.emitted_tokens),
                                   len(result.emitted_tokens), seq.sampling.greedy)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            seq = self.seqs.pop(seq_id, None)
            if seq is None:
                continue
            if self.recorder is not None:
                self.recorder.finish(seq_id, seq.tokens[: seq.committed])
            self.forks.drop(seq)
            if seq.blocks:
                self.blocks.free(seq.blocks)

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """New weights for the head (online distillation; between proposal batches). ``state`` holds
        some of the head's tensors; the projection ``fc`` must not change, so the target features the
        sequences hold stay valid. Each live sequence drops its drafted tail and recomputes the head's
        KV from its first pair on its next proposal."""
        own = self.head.state_dict()
        unknown = [k for k in state if k not in own or own[k].shape != state[k].shape]
        if unknown or any(k.startswith("fc.") for k in state):
            raise ValueError(f"weights do not fit this head: {(unknown or ['fc.*'])[:3]}")
        for k, v in state.items():
            own[k].copy_(v.to(own[k].dtype))
        for seq in self.seqs.values():
            self.forks.drop(seq)
            self.truncate_tail(seq)
            self.rollback(seq, 0)
        self.weight_swaps += 1

    # ------------------------------------------------------------------ the head API (EagleForks uses it too)

    def truncate_tail(self, seq: _Seq) -> None:
        """Drop the drafted tail (its tokens, distributions, predicted features and KV pairs)."""
        length = len(seq.tokens)
        del seq.tokens[seq.committed :]
        seq.dists = []
        first = max(seq.committed - 1, 0)
        for pos in range(first, length):  # predicted features of drafted positions (all sit below length)
            seq.feats.pop(pos, None)
        if len(seq.feats) > first:  # some position >= first is still there (not expected): scan them all
            for pos in [p for p in seq.feats if p >= first]:
                del seq.feats[pos]
        self.rollback(seq, min(seq.computed, max(seq.committed - 1, 0)))

    def rollback(self, seq: _Seq, pairs: int) -> None:
        """Keep the first ``pairs`` pairs of the sequence in the head's KV cache."""
        if pairs < seq.computed:
            seq.computed = pairs
            self.blocks.truncate(seq.blocks, pairs)
            if seq.root is not None and pairs < seq.root[0]:
                seq.root = None
            if seq.kept and any(pairs < f.shared * self.block_size for call in seq.kept for f in call):
                self.forks.drop(seq)  # forks reading cache blocks of the sequence that are rewritten

    @torch.inference_mode()
    def _set_features(self, seq: _Seq, start: int, hidden: list[torch.Tensor], rows: int) -> None:
        """Target features for positions start .. start+rows-1."""
        if rows <= 0:
            return
        if len(hidden) != len(self.caps.hidden_layers) or any(h.shape[0] != rows for h in hidden):
            seq.broken = True
            return
        feats = self.head.project([h.to(device=self.device, dtype=self.dtype) for h in hidden])
        for i in range(rows):
            seq.feats[start + i] = feats[i]
        self.rollback(seq, min(seq.computed, start))


    @torch.inference_mode()
    def _extend(self, wanted: dict[str, int]) -> None:
        while True:
            ready = []
            for sid, n in wanted.items():
                seq = self.seqs[sid]
                last = len(seq.tokens) - 2  # the newest pair: (x_{t+1}, f_t) with t = len - 2
                if seq.broken or len(seq.tail) >= n or last < 0 or not self.has_features(sid, seq, last + 1):
                    continue
                if grow_blocks(self.blocks, seq.blocks, last + 1):
                    ready.append(seq)
            if not ready:
                return
            # each sequence's newest output: its next feature, whose logits give its next token
            last = self.run_pairs(ready, [len(seq.tokens) - 1 for seq in ready])
            if all(seq.sampling.greedy for seq in ready):  # argmax rows in one pass and one sync (an
                drafts = [(t, None) for t in self.head.greedy_tokens(last)]  # EAGLE-3 head: its draft vocabulary only)
            else:
                drafts = [sample_draft(row, seq.sampling, seq.generator, self.max_support)
                          for seq, row in zip(ready, self.head.logits(last))]
            for seq, feat, (token, dist) in zip(ready, last, drafts):
                seq.feats[len(seq.tokens) - 1] = feat
                seq.tokens.append(token)
                seq.dists.append(dist)

    def forward(self, ids: list[int], feats: list[torch.Tensor], pos: list[int], qlens: list[int],
                 clens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """The head over pairs (ids [T], feats T × [H], positions [T]) of sequences with ``qlens`` new
        pairs each, ``clens`` pairs in all: outputs [T, H]. Inputs and metadata built on the head's device."""
        self.forward_calls += 1
        if self.graphs is not None and self.graphs.fits(qlens, tables):  # one pair per sequence: replay
            return self.graphs.run(ids, torch.stack(feats), pos, tables)
        meta = AttentionMetadata.build(qlens, clens, tables, self.block_size, self.device)
        out = self.head(torch.tensor(ids, device=self.device), torch.stack(feats),
                        torch.tensor(pos, device=self.device), meta, self.kv)
        return out

    def has_features(self, sid: str, seq: _Seq, end: int) -> bool:
        """Whether the target's features of pairs ``computed .. end - 1`` are all there (else the
        sequence, whose history lacks them, is broken: no proposals for it)."""
        if any(t not in seq.feats for t in range(seq.computed, end)):
            seq.broken = True
            log.warning("sequence %s lacks target features: no EAGLE proposals for it", sid)
            return False
        return True

    def run_pairs(self, seqs: list[_Seq], ends: list[int]) -> torch.Tensor:
        """The head over each sequence's pairs ``computed .. end - 1`` (those not in its cache yet), in
        one pass: each sequence's newest output [B, H]; its ``computed`` is ``end`` after."""
        ids, feats, pos, qlens, tables = [], [], [], [], []
        for seq, end in zip(seqs, ends):
            span = range(seq.computed, end)
            ids.extend(seq.tokens[t + 1] for t in span)
            feats.extend(seq.feats[t] for t in span)
            pos.extend(span)
            qlens.append(len(span))
            tables.append(seq.blocks)
        hidden = self.forward(ids, feats, pos, qlens, list(ends), tables)
        for seq, end in zip(seqs, ends):
            seq.computed = end
        return hidden if len(ids) == len(seqs) else hidden[torch.tensor(qlens, device=self.device).cumsum(0) - 1]

    def _run_frontier(self, batch: list[DraftTree]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over every tree's frontier: pairs (node token, its parent's output)."""
        ids, pos, meta = frontier_batch(batch, self.block_size, self.device)
        feats = torch.stack([tree.state[tree.parents[n]] for tree in batch for n in tree.front])
        hidden = self.head(ids, feats, pos, meta, self.kv)
        self.forward_calls += 1
        return self.head.logits(hidden).log_softmax(-1), hidden

    @torch.inference_mode()
    def _draft_trees(self, wanted: dict[str, tuple[int, int, int]]) -> dict[str, tuple[list[int], list[int]]]:
        """Seq id -> (node budget, top-k, depth) in; seq id -> (tokens, parents) out (see the module docstring)."""
        out: dict[str, tuple[list[int], list[int]]] = {}
        trees: dict[str, DraftTree] = {}
        for sid, (budget, topk, depth) in wanted.items():
            seq = self.seqs[sid]
            self.truncate_tail(seq)
            last = len(seq.tokens) - 2  # the newest committed pair
            out[sid] = ([], [])
            if seq.broken or last < 0 or not self.has_features(sid, seq, last + 1):
                continue
            if seq.computed >= last + 1:  # nothing new: recompute the last pair for the root's output
                self.rollback(seq, last)
            if grow_blocks(self.blocks, seq.blocks, last + 1 + DraftTree.max_slots(topk, depth)):
                trees[sid] = DraftTree(seq, budget, topk, depth, last + 1)
        if not trees:
            return out
        # pass 1: the committed pairs not yet in the cache; their last output is the root's
        batch = list(trees.values())
        roots = self.run_pairs([tree.seq for tree in batch], [tree.base for tree in batch])
        for tree, feat, logp in zip(batch, roots, self.head.logits(roots).log_softmax(-1)):
            tree.expand(ROOT, logp, feat)
        grow(batch, self._run_frontier)  # passes 2..depth
        for sid, tree in trees.items():
            out[sid] = tree.best()
            self.rollback(tree.seq, tree.base)  # the tree's slots go; the committed pairs stay
        return out
