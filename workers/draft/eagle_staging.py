"""Staging for the pipelined seam with an EAGLE head: forks of the head's chain, drafted together.

:class:`EagleForks` drafts the staged branches of an :class:`.eagle_proposer.EagleProposer` (greedy
chains: :class:`.drafter.Branch`); this module owns the forks (:class:`_Fork`), the root pass they
fork from, the forks kept for later calls, and the per-depth batched head passes.
The target's commits (with the hidden rows of their positions, once per token, as proposal requests
carry them) and verdicts arrive as news (:meth:`.eagle_proposer.EagleProposer.commit`,
:meth:`.eagle_proposer.EagleProposer.verified`), and :meth:`EagleForks.draft`
drafts every staged branch of every sequence together. A branch assumes tokens the target has not
committed yet (``extra``: the first tokens of the proposal in flight and a guessed bonus token);
their positions have no target features, so the head runs on over them with its own predicted
features, exactly as it drafts past the committed prefix in a chain: the head first covers the
committed pairs (the root, one batched pass, its output kept for the next call while nothing new is
committed), then every branch is a fork of it with cache blocks of its own (the committed ones
shared; the partly filled last one copied), fed one pair per pass: an assumed token while it has
them, then its own greedy draft, every branch of every sequence in one head pass per depth (one
pair per branch: the CUDA graphs of :mod:`.head_graphs` replay it). The forks of the last
``KEPT_CALLS`` calls are kept (their blocks, each pass's token and output): a later branch whose
assumed tokens a kept fork already ran (the outcomes staged for a proposal: its first a tokens
and a bonus) forks that fork at its last such pass instead of running them again (its blocks
copied up to there), so staging takes about γ passes instead of about 2γ; the positions committed
since then keep the head's predicted features in that fork (the root, next call, has the real
ones). Each drafted token comes with the head's next likeliest ones (the stager's bonus guesses)
and the head's confidence (the product of its probabilities along the chain). Branch blocks are
freed afterwards; when commits and verdicts bring the target's real features, the head's KV is
re-based on them as for the synchronous seam. Staged proposals are greedy (no distributions)
whatever the request samples: the target verifies them as one-hot drafts, lossless either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .drafter import Branch, Draft, Ready, grow_blocks

KEPT_CALLS = 2  # pipelined seam: the forks of this many recent calls are kept for branches that fork them


@dataclass
class _Fork:
    """One staged branch while it is drafted: pairs from position ``base`` (its sequence's last
    committed one) on, fed ``extra`` (the tokens it assumes) and then its own drafts."""

    index: int  # the branch's place in the call
    base: int
    extra: list[int]
    num_tokens: int
    k: int  # tokens kept per depth: the draft and its alternatives
    feat: torch.Tensor  # the head's newest output: the feature of the next pair
    committed: int = 0  # its sequence's committed tokens when it was drafted
    assumed: list[int] = field(default_factory=list)  # tokens at positions committed .. base (a fork of a fork)
    shared: int = 0  # leading blocks of ``table`` that are its sequence's own (the rest are ``own``)
    own: list[int] = field(default_factory=list)  # its cache blocks (kept for forks of it, then freed)
    table: list[int] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)  # the token of each pass's pair
    outs: list[torch.Tensor] = field(default_factory=list)  # each pass's output
    tokens: list[int] = field(default_factory=list)
    alternatives: list[list[int]] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    streamed: int = 0  # its first tokens that are streamed: all its branch asks for but the last

    @property
    def steps(self) -> int:
        """Head passes it takes: one per assumed token and per drafted token but the last."""
        return len(self.extra) + self.num_tokens - 1

    def token(self, depth: int) -> int:
        """The token of the pair at ``base + depth``: the one after position base + depth."""
        return self.extra[depth] if depth < len(self.extra) else self.tokens[depth - len(self.extra)]

    @property
    def fed(self) -> list[int]:
        """The tokens it assumed and fed, from position ``committed`` on (its pairs' inputs)."""
        return self.assumed + self.inputs

    def take(self, ids: list[int], logps: list[float]) -> None:
        self.tokens.append(ids[0])
        self.alternatives.append([t for t, lp in zip(ids[1 : self.k], logps[1 : self.k]) if lp != float("-inf")])
        # a peaked log_softmax can round a hair above 0 (exp > 1), which the target drops as malformed
        self.confidence.append(min(1.0, (self.confidence[-1] if self.confidence else 1.0) * math.exp(logps[0])))


class EagleForks:
    """The pipelined seam's branches for an :class:`.eagle_proposer.EagleProposer` (see the module
    docstring), drafted through the drafter's head API: its sequences (``seqs``: each one's ``root``
    and ``kept`` forks), head, KV cache and block manager, ``forward`` and ``run_pairs`` (head
    passes), ``has_features``, ``rollback`` and ``truncate_tail``. The drafter calls :meth:`drop` when
    it rewrites blocks that kept forks read. A ``seq`` here is one of the drafter's (its module's
    ``_Seq``), not imported: that would be a cycle."""

    def __init__(self, drafter):
        self.drafter = drafter

    def _roots(self, seq_ids: list[str]) -> dict[str, torch.Tensor]:
        """Seq id -> the head's output after each sequence's committed pairs (the feature it predicts
        for its last committed position), the pairs not yet in the cache run in one batched pass."""
        roots: dict[str, torch.Tensor] = {}
        todo: list[tuple[str, object]] = []  # (seq id, its sequence)
        for sid in seq_ids:
            seq = self.drafter.seqs.get(sid)
            if seq is None or seq.broken:
                continue
            self.drafter.truncate_tail(seq)  # a chain the synchronous seam drafted (not expected here)
            last = seq.committed - 2  # the newest committed pair
            if last < 0:
                continue
            if seq.root is not None and seq.root[0] == last + 1 and seq.computed == last + 1:
                roots[sid] = seq.root[1]
                continue
            if seq.computed >= last + 1:  # in the cache, its output not kept: recompute the last pair
                self.drafter.rollback(seq, last)
            if not self.drafter.has_features(sid, seq, last + 1):
                continue
            if grow_blocks(self.drafter.blocks, seq.blocks, last + 1):
                todo.append((sid, seq))
        if not todo:
            return roots
        ends = self.drafter.run_pairs([seq for _, seq in todo], [seq.committed - 1 for _, seq in todo])
        for (sid, seq), feat in zip(todo, ends):
            seq.root = (seq.computed, feat)
            roots[sid] = feat
        return roots

    @torch.inference_mode()
    def draft(self, branches: list[Branch], ready: Ready | None = None) -> list[Draft]:
        """One greedy chain per branch, every branch a fork of its sequence's committed pairs, all of
        them one head pass per depth (see the module docstring); ``ready`` before the last pass
        (:meth:`.drafter.Drafter.draft`)."""
        blocks = self.drafter.blocks
        if blocks.num_free_blocks < blocks.num_blocks // 4:  # short of blocks: forks kept go first
            self.drop_all()
        roots = self._roots(list(dict.fromkeys(b.seq_id for b in branches)))
        bs = self.drafter.block_size
        forks: list[_Fork] = []
        copies: list[tuple[int, int]] = []
        for i, br in enumerate(branches):
            root = roots.get(br.seq_id)
            if root is None or br.num_tokens <= 0:
                continue
            seq = self.drafter.seqs[br.seq_id]
            # no deeper than the head has positions for (its rotary tables: the target's context)
            room = self.drafter.head.rotary.cos.shape[0] - seq.committed - len(br.extra)
            if min(br.num_tokens, room) <= 0:
                continue
            c = seq.committed
            source, depth = self._reusable(seq, list(br.extra))
            if source is None:  # from the root: pairs from the last committed position on
                fork = _Fork(i, c - 1, list(br.extra), min(br.num_tokens, room), 1 + br.alternatives, root,
                             committed=c)
                src_table, src_shared = seq.blocks, (c - 1) // bs
            else:  # from a kept fork's pass ``depth``: the assumed tokens it covers are not run again
                base = source.base + depth + 1
                context = seq.tokens[c:] + list(br.extra)  # (seq.tokens holds the committed ones only)
                fork = _Fork(i, base, context[base + 1 - c :], min(br.num_tokens, room), 1 + br.alternatives,
                             source.outs[depth], committed=c, assumed=context[: base + 1 - c])
                src_table, src_shared = source.table, source.shared
            fork.streamed = min(br.num_tokens - 1, fork.num_tokens)
            steps = fork.steps
            fork.shared = src_shared
            if steps > 0:
                # its own blocks: copies of the source's past its shared ones up to its first pair (the
                # last one partly filled), then fresh ones
                copied = -(-fork.base // bs) - src_shared
                need = -(-(fork.base + steps) // bs) - src_shared
                if not self.drafter.blocks.can_allocate(need):
                    continue
                fork.own = self.drafter.blocks.allocate(need)
                copies += [(src_table[src_shared + j], fork.own[j]) for j in range(copied)]
                fork.table = seq.blocks[:src_shared] + fork.own
            forks.append(fork)
        try:
            if copies:
                src = torch.tensor([c[0] for c in copies], device=self.drafter.device)
                dst = torch.tensor([c[1] for c in copies], device=self.drafter.device)
                for k, v in self.drafter.kv:
                    k[dst] = k[src]
                    v[dst] = v[src]
            self._grow_forks(forks, (lambda: ready(self._chains(branches, forks, copy=True))) if ready else None)
        except BaseException:
            for fork in forks:
                if fork.own:
                    self.drafter.blocks.free(fork.own)
            raise
        by_seq: dict[str, list[_Fork]] = {}
        out = self._chains(branches, forks)
        for fork in forks:
            if fork.own:
                by_seq.setdefault(branches[fork.index].seq_id, []).append(fork)
        for sid, kept in by_seq.items():  # kept for the next calls' branches that assume what they drafted
            seq = self.drafter.seqs[sid]
            seq.kept.append(kept)
            while len(seq.kept) > KEPT_CALLS:
                for fork in seq.kept.pop(0):
                    self.drafter.blocks.free(fork.own)
        return out

    def _reusable(self, seq, extra: list[int]) -> tuple[_Fork | None, int]:
        """A kept fork whose passes already ran the tokens a branch assumes after ``seq``'s committed
        ones (``extra``), and the last such pass: the one reaching furthest (None: none reaches past
        the root)."""
        c = seq.committed
        best, best_depth, best_pos = None, -1, c - 1
        for call in seq.kept:
            for fork in call:
                if fork.committed > c or not fork.outs:
                    continue
                toks = fork.fed
                # the positions from fork.committed on: committed ones, then the branch's assumed ones
                matched = 0
                for q in range(fork.committed, c + len(extra)):
                    i = q - fork.committed
                    if i >= len(toks) or toks[i] != (seq.tokens[q] if q < c else extra[q - c]):
                        break
                    matched += 1
                # pass d's pair (position base + d) fed the token at base + d + 1: usable while matched
                depth = min(len(fork.outs), fork.committed + matched - 1 - fork.base) - 1
                if depth >= 0 and fork.base + depth + 1 > best_pos:
                    best, best_depth, best_pos = fork, depth, fork.base + depth + 1
        return best, best_depth

    def drop(self, seq) -> None:
        for call in seq.kept:
            for fork in call:
                self.drafter.blocks.free(fork.own)
        seq.kept = []

    def drop_all(self) -> None:
        for seq in self.drafter.seqs.values():
            self.drop(seq)

    @staticmethod
    def _chains(branches: list[Branch], forks: list[_Fork], copy: bool = False) -> list[Draft]:
        """Each branch's chain as drafted so far (``copy``: of the forks' lists, which go on growing)."""
        out = [Draft([]) for _ in branches]
        for fork in forks:
            if copy:
                out[fork.index] = Draft(list(fork.tokens), [list(a) for a in fork.alternatives], list(fork.confidence))
            else:
                out[fork.index] = Draft(fork.tokens, fork.alternatives, fork.confidence)
        return out

    def _grow_forks(self, forks: list[_Fork], ready: Callable[[], None] | None = None) -> None:
        """Draft every fork to its length: the roots' next tokens, then one batched pass per depth;
        ``ready()`` once every fork has all its tokens but the last, if a pass is still to come."""
        first = [f for f in forks if not f.extra]  # the root's output gives their first token
        if first:
            ids, logps = self.drafter.head.top_tokens(torch.stack([f.feat for f in first]), max(f.k for f in first))
            for fork, row_ids, row_logp in zip(first, ids, logps):
                fork.take(row_ids, row_logp)
        depth = 0
        active = [f for f in forks if f.steps > 0]
        chunk = self.drafter.graphs.max_batch if self.drafter.graphs is not None else len(active) or 1
        while active:
            if ready is not None and all(len(f.tokens) >= f.streamed for f in forks):
                ready()
                ready = None
            for at in range(0, len(active), chunk):
                batch = active[at : at + chunk]
                pos = [f.base + depth for f in batch]
                hidden = self.drafter.forward([f.token(depth) for f in batch], [f.feat for f in batch], pos,
                                       [1] * len(batch), [p + 1 for p in pos], [f.table for f in batch])
                drafting = [r for r, f in enumerate(batch) if depth + 1 >= len(f.extra)]
                for fork, feat in zip(batch, hidden):
                    fork.inputs.append(fork.token(depth))
                    fork.outs.append(feat)
                    fork.feat = feat
                if drafting:
                    ids, logps = self.drafter.head.top_tokens(hidden[drafting], max(batch[r].k for r in drafting))
                    for r, row_ids, row_logp in zip(drafting, ids, logps):
                        batch[r].take(row_ids, row_logp)
            depth += 1
            active = [f for f in active if depth < f.steps]
