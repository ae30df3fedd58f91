"""A step's outputs: plain rows sampled, drafted rows verified, logprobs, each turned into deltas.

The scores come from the one pipeline of :mod:`.logits`, so verification uses exactly the
distribution plain sampling would. Verifying commits the accepted tokens, moves the KV (and hidden
rows) of accepted tree paths to consecutive positions and copies blocks written on rollback, in one
batched copy each for the step, and leaves a :class:`.news.Verdict` for the draft worker. Under
async scheduling a plain step's tokens may stay on the device (:meth:`Outputs.defer`); their
bookkeeping runs one step behind (:meth:`Outputs.finish_pending`).
"""

from __future__ import annotations

import torch

from runtime.messages import TokenDelta, TopLogprob

from .block_manager import BlockManager
from .commits import Commits
from .hidden import HiddenStore
from .model_runner import ModelRunner
from .news import DraftNews, Verdict
from .pending import PendingStep
from .sampling import logprobs_of, sample
from .sequence import Sequence, SeqStatus
from .speculator import Drafted, Speculator
from .verifier import Candidate, verify

Deltas = list[tuple[str, TokenDelta]]
Plain = list[tuple[Sequence, int]]  # (sequence, its logits row)


class Outputs:
    """Turns one step's scores into tokens and deltas; state passed in at construction."""

    def __init__(self, commits: Commits, news: DraftNews, spec: Speculator, blocks: BlockManager,
                 runner: ModelRunner, hidden: HiddenStore | None):
        self.commits = commits
        self.news = news
        self.spec = spec
        self.blocks = blocks
        self.runner = runner
        self.hidden = hidden

    # ------------------------------------------------------------------ plain rows

    def sample(self, plain: Plain, scores: torch.Tensor, greedy: list[bool], logits: torch.Tensor) -> Deltas:
        """One token per plain sequence, committed now."""
        seqs = [s for s, _ in plain]
        index = [r for _, r in plain]
        tokens = draw(plain, scores, greedy).tolist()
        asking = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        lp = iter(logprobs(logits, [index[i] for i in asking], [tokens[i] for i in asking],
                           [(seqs[i].params.logprobs, 1) for i in asking]))
        outputs = []
        for seq, token in zip(seqs, tokens):
            lps, top = next(lp) if seq.params.logprobs is not None else (None, None)
            if seq.status is SeqStatus.FINISHED:
                continue  # async scheduling: it finished at the step before, which the host saw after this launch
            if seq.grammar is not None:
                seq.grammar.accept((token,))
            finish = self.commits.append(seq, token)
            usage = self.commits.close(seq) if finish else None
            outputs.append((seq.request_id, TokenDelta([token], lps, top, finish, usage)))
        return outputs

    def defer(self, plain: Plain, scores: torch.Tensor, greedy: list[bool], logits: torch.Tensor,
              max_model_len: int) -> PendingStep:
        """Sample on the device and leave the tokens there for the next step (:class:`PendingStep`)."""
        seqs = [s for s, _ in plain]
        tokens = draw(plain, scores, greedy)
        asking = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        found = None
        if asking:
            rows = torch.tensor([plain[i][1] for i in asking], device=logits.device)
            picked = tokens.index_select(0, torch.tensor(asking, device=tokens.device))
            found = logprobs_of(logits.index_select(0, rows), picked, max(seqs[i].params.logprobs for i in asking))
        launched = PendingStep.launch(seqs, tokens, asking, found)
        for s in seqs:
            s.num_pending += 1
            # its new token ends it whatever it is: schedule nothing after it
            s.ends_at_pending = (s.num_generated + s.num_pending >= s.params.max_tokens
                                 or len(s) + s.num_pending >= max_model_len or s.prefill_only)
        return launched

    def finish_pending(self, p: PendingStep) -> Deltas:
        """A deferred step's bookkeeping once its tokens are on the host (append, finish checks,
        prefix-cache registration, deltas). A sequence that finished or was aborted meanwhile drops
        its token (the step was launched before the host knew); a preempted one keeps it (it recomputes)."""
        tokens, found = p.wait()
        lp = iter(logprob_lists(found, [(p.seqs[i].params.logprobs, 1) for i in p.asking]) if found else [])
        outputs = []
        for seq, token in zip(p.seqs, tokens):
            seq.num_pending -= 1
            if not seq.num_pending:
                seq.ends_at_pending = False
            lps, top = next(lp) if seq.params.logprobs is not None else (None, None)
            if seq.status is SeqStatus.FINISHED:
                continue
            finish = self.commits.append(seq, token)
            # the KV of every token before it is computed (a finishing token's never is); done before
            # close frees the blocks, so the prefix cache keeps what the synchronous engine keeps
            self.commits.register_blocks(seq, len(seq) - 1 if finish else len(seq))
            usage = self.commits.close(seq) if finish else None
            outputs.append((seq.request_id, TokenDelta([token], lps, top, finish, usage)))
        return outputs

    # ------------------------------------------------------------------ drafted rows

    def verify(self, verified: list[tuple[Drafted, int]], scores: torch.Tensor, greedy: list[bool],
               logits: torch.Tensor) -> Deltas:
        """Verify each proposal (its root row given) by lossless rejection sampling and commit what
        it emits; sequences that go on leave a verdict for the draft."""
        candidates = [Candidate(d.tokens, d.parents, d.dists, row, greedy[row], d.seq.generator) for d, row in verified]
        outcomes = verify(scores, candidates)
        bs = self.commits.block_size
        moves: list[tuple[int, int]] = []  # (src, dst) slots of accepted tree paths, for the whole batch
        copies: list[tuple[int, int]] = []  # copy-on-write blocks after rollbacks
        lp_rows: list[int] = []
        lp_tokens: list[int] = []
        lp_counts: list[tuple[int, int]] = []  # (top-k asked, rows) per sequence that wants logprobs
        results = []
        for (d, root), outcome in zip(verified, outcomes):
            seq, accepted = d.seq, len(outcome.path)
            base = len(seq) - len(d.tokens)  # committed length before this round
            table = seq.block_table
            for j, i in enumerate(outcome.path):
                if i != j:  # a tree path: its KV (and hidden rows) move to consecutive positions
                    src, dst = base + i, base + j
                    moves.append((table[src // bs] * bs + src % bs, table[dst // bs] * bs + dst % bs))
            del seq.token_ids[base:]
            kept, finish = [], None
            for token in outcome.tokens:
                kept.append(token)
                finish = self.commits.append(seq, token)
                if finish:
                    break
            if seq.grammar is not None:
                seq.grammar.accept(kept)
            seq.num_computed = min(base + accepted, len(seq))
            copies.extend(self.blocks.truncate(seq.block_table, seq.num_computed))
            self.commits.register_blocks(seq)
            st = self.spec.record(d, accepted)
            if seq.params.logprobs is not None:
                lp_rows.extend(([root] + [root + 1 + i for i in outcome.path])[: len(kept)])
                lp_tokens.extend(kept)
                lp_counts.append((seq.params.logprobs, len(kept)))
            results.append((seq, kept, finish, accepted, base, st))
        if moves:
            src = torch.tensor([s for s, _ in moves], device=self.runner.device)
            dst = torch.tensor([t for _, t in moves], device=self.runner.device)
            self.runner.copy_slots(src, dst)
            if self.hidden is not None:
                self.hidden.copy(src, dst)
        self.runner.copy_blocks(copies)
        lp = iter(logprobs(logits, lp_rows, lp_tokens, lp_counts))
        outputs = []
        for seq, kept, finish, accepted, base, st in results:
            lps, top = next(lp) if seq.params.logprobs is not None else (None, None)
            usage = None
            if finish:
                usage = self.commits.close(seq)
            else:  # its hidden rows are those of positions base - 1 .. (read when the draft hears it)
                self.news.add(Verdict(seq, st.round - 1, accepted, kept, base - 1))
                st.told = len(seq)
            outputs.append((seq.request_id, TokenDelta(kept, lps, top, finish, usage)))
        return outputs


def draw(plain: Plain, scores: torch.Tensor, greedy: list[bool]) -> torch.Tensor:
    """One token per plain sequence ([B] long, on the scores' device)."""
    index = [r for _, r in plain]
    every = len(index) == scores.shape[0]  # a decode-only step: no gather
    picked = scores if every else scores[index]
    return sample(picked, [greedy[r] for r in index], [s.generator for s, _ in plain])


def logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], counts: list[tuple[int, int]]):
    """(logprobs, top logprobs) per sequence that asked for them, in order, from the raw model
    distribution (logits [R, V]); ``counts[i]`` = (top-k it asked for, how many of the concatenated
    ``rows`` and ``tokens`` are its: 1 for a plain step, the root and accepted nodes for a verified one)."""
    if not counts:
        return []
    k = max(n for n, _ in counts)
    found = logprobs_of(logits[rows], torch.tensor(tokens, device=logits.device), k)
    return logprob_lists(tuple(t.tolist() for t in found), counts)


def logprob_lists(found: tuple[list, list, list], counts: list[tuple[int, int]]):
    """:func:`logprobs`' result from (chosen, top ids, top logprobs) already on the host."""
    chosen, top_ids, top_vals = found
    out, at = [], 0
    for n, count in counts:
        span = range(at, at + count)
        top = [[TopLogprob(t, v) for t, v in zip(top_ids[j][:n], top_vals[j][:n])] for j in span] if n else None
        out.append(([chosen[j] for j in span], top))
        at += count
    return out
