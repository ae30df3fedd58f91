"""Suffix decoding: no model, proposals read from suffix trees of the request's own tokens and of
earlier outputs of all the traffic this draft worker serves (SuffixDecoding, Oliaro et al. 2024,
arXiv 2411.04975; Snowflake's ArcticInference ships the reference implementation).

Two :class:`~workers.draft.suffix_tree.SuffixTree` indexes:

- a **per-request** tree over the sequence's prompt and output so far, freed when the request ends;
- one **global** tree over finished outputs: when a request ends, its output (with the last
  ``PROMPT_TAIL`` tokens of its prompt before it, so that the start of an output has a pattern to
  match — a chat template's assistant header, say) goes in. A draft worker serves every target
  that picks it, so repeated structured outputs (tool calls, JSON, code edits) of any request help
  all later ones. It is bounded: over ``max_cached_outputs`` outputs or ``max_cached_nodes`` nodes
  the oldest outputs are evicted. (Outputs still in flight stay out of it: the request's own tree
  has them, and counting them twice would skew the comparison of the two trees' scores.)

For each proposal, in each tree: match the longest suffix of the sequence (at most
``max_depth − γ`` tokens, leaving the tree room for γ more) that has a continuation; allow
``min(γ, ⌊spec_factor · match length⌋)`` tokens (a longer match speculates further); read the most
frequent continuation (a chain) or, when a tree is asked for, the best-first tree of the top-k
children at every level, both scored by the product of conditional frequencies and cut below
``min_token_prob``. Each token's confidence (what the target's plan and calibration read, see
:func:`match_reliability`) is that path probability times the reliability of the match it extends:
a continuation seen once after a one-token match is a guess, after a sixteen-token match (text the
model wrote or was shown earlier in the session, and is now copying) it is near certain. The
proposal with the larger score (Σ of those confidences: the expected number of accepted tokens)
wins, ties to the request's own tree, so a long match in the session's own context (its earlier
turns, their outputs and tool results, all in the prompt) beats a short one in unrelated outputs. Proposals are deterministic and
carry no distributions, so the target verifies them as one-hot drafts: lossless for greedy and
sampled requests whatever they propose.

Every branch (:class:`.drafter.Branch`) is read the same way, after the committed tokens plus the
branch's assumed ones; a chain carries the other children of each node on it as alternatives.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .drafter import Branch, Capabilities, Draft, Drafter, Ready, SamplingSpec, VerifyResult
from .suffix_tree import SuffixTree

PROMPT_TAIL = 8  # prompt tokens put before each output in the global tree
MATCH_HALF = 2  # the match length whose continuation is as likely right as wrong (see match_reliability)


def match_reliability(length: int) -> float:
    """How often a continuation that the tree saw after a ``length``-token match is the target's next
    token, whatever its frequency says: ``length² / (length² + MATCH_HALF²)``.

    Measured on the agent replay (``bench/agent_bench.py``, greedy replies of the demo model replayed
    through the proposer): the first drafted token came true 17 % of the time after a 1-token match,
    44 % after 2, 77 % after 3, 92 % after 4 to 7, 99 % after 16 or more, nearly all of them
    continuations seen once (path frequency 1). The i-th token of a chain extends a match of
    ``length + i - 1`` tokens, so its own reliability is this function of that."""
    return length * length / (length * length + MATCH_HALF * MATCH_HALF) if length > 0 else 0.0


def _confidence(probs: list[float], depths: list[int], length: int) -> list[float]:
    """Per token: its path probability times the reliability of every match on its path (the token at
    depth d, 1-based, follows a match of ``length + d - 1`` tokens)."""
    cum = [1.0]
    for d in range(1, max(depths, default=0) + 1):
        cum.append(cum[-1] * match_reliability(length + d - 1))
    return [p * cum[d] for p, d in zip(probs, depths)]


@dataclass
class _Request:
    local: SuffixTree  # this request's prompt and output
    prompt_len: int  # tokens of the first call: the prompt (and the first output token)


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 24  # tokens per tree path: the longest match plus what may follow it
    spec_factor: float = 1.0  # tokens proposed per matched token (bounded by γ)
    min_token_prob: float = 0.1  # stop a path once its estimated probability falls below this
    max_cached_outputs: int = 10_000  # outputs in the global tree
    max_cached_nodes: int = 500_000  # nodes in the global tree (its memory: about 300 B per node)
    tree_topk: int = 1  # children per node in tree proposals (1: chains); targets may ask per request
    tree_depth: int = 0  # tree depth (0: as deep as the node budget)

    def __post_init__(self) -> None:
        if self.max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {self.max_depth}")
        if self.spec_factor <= 0:
            raise ValueError(f"spec_factor must be > 0, got {self.spec_factor}")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_cached_outputs < 0 or self.max_cached_nodes < 0:
            raise ValueError("max_cached_outputs and max_cached_nodes must be >= 0 (0: no global tree)")
        if self.tree_topk < 1 or self.tree_depth < 0:
            raise ValueError(f"need tree_topk >= 1 and tree_depth >= 0, got {self.tree_topk}, {self.tree_depth}")


class SuffixProposer(Drafter):
    """Suffix decoding over each request's tokens and a bounded global tree of earlier outputs."""

    def __init__(self, config: SuffixConfig = SuffixConfig()):
        self.config = config
        self.tree_topk, self.tree_depth = config.tree_topk, config.tree_depth
        # pure Python, no torch (on the loop); branches are chains: set to draft trees, it serves the
        # synchronous seam
        self.caps = Capabilities("suffix", on_loop=True, stages=config.tree_topk <= 1)
        self.cache = SuffixTree(config.max_depth)  # the global tree
        self._seqs: dict[str, _Request] = {}
        self._keys = itertools.count()
        self.evicted = 0  # outputs evicted from the global tree
        self.won = {"request": 0, "global": 0}  # proposals taken from each tree

    def __len__(self) -> int:
        return len(self._seqs)

    # ------------------------------------------------------------------ state

    def _append(self, seq_id: str, tokens: list[int]) -> _Request:
        req = self._seqs.get(seq_id)
        if req is None:  # the first call carries the prompt (and the first output token)
            req = self._seqs[seq_id] = _Request(SuffixTree(self.config.max_depth), len(tokens))
            req.local.add(0, tokens)
        elif tokens:
            req.local.extend(0, tokens)
        return req

    def _cache_output(self, req: _Request) -> None:
        """A finished request's output into the global tree, then the oldest outputs out of it until
        it is within both caps (the new one too, when it alone is over the node cap)."""
        cfg = self.config
        tokens = req.local.tokens(0)
        if len(tokens) > req.prompt_len and cfg.max_cached_outputs and cfg.max_cached_nodes:
            self.cache.add(next(self._keys), tokens[max(0, req.prompt_len - PROMPT_TAIL) :])
            self.cache.close(self.cache.newest())
        while len(self.cache) and (len(self.cache) > cfg.max_cached_outputs
                                   or self.cache.num_nodes > cfg.max_cached_nodes):
            self.cache.remove(self.cache.oldest())
            self.evicted += 1

    # ------------------------------------------------------------------ drafting

    def _read(self, tree: SuffixTree, context: list[int], br: Branch) -> tuple[float, Draft]:
        """(score, draft) of one tree for ``br`` after ``context``; each token's confidence is the
        estimated probability of reaching it: its path probability times the match's reliability."""
        cfg = self.config
        depth = br.num_tokens if br.tree is None else br.tree[1]
        node, length = tree.match(context, max(1, cfg.max_depth - depth))
        limit = min(br.num_tokens, int(length * cfg.spec_factor + 1e-9)) if length else 0
        if limit <= 0:
            return 0.0, Draft([])
        if br.tree is None:
            tokens, probs, alternatives = tree.chain_alternatives(node, limit, cfg.min_token_prob, br.alternatives)
            conf = _confidence(probs, list(range(1, len(tokens) + 1)), length)
            return sum(conf), Draft(tokens, alternatives, conf)
        tokens, parents, probs = tree.tree(node, limit, br.tree[0], depth, cfg.min_token_prob)
        depths: list[int] = []
        for parent in parents:  # a parent comes before its children
            depths.append(1 if parent < 0 else depths[parent] + 1)
        conf = _confidence(probs, depths, length)
        return sum(conf), Draft(tokens, confidence=conf, parents=parents)

    def commit(self, seq_id: str, tokens: Sequence[int], hidden_states: Sequence = (),
               sampling: SamplingSpec = SamplingSpec()) -> None:
        self._append(seq_id, list(tokens))

    def draft(self, branches: list[Branch], ready: Ready | None = None) -> list[Draft]:
        # (``ready`` unused: drafting takes microseconds, the proposals leave when it returns)
        out = []
        for br in branches:
            req = self._seqs.get(br.seq_id)
            if req is None or br.num_tokens <= 0:
                out.append(Draft([]))
                continue
            context = req.local.tokens(0) + list(br.extra)
            own = self._read(req.local, context, br)
            other = self._read(self.cache, context, br) if len(self.cache) else (0.0, Draft([]))
            best = own if own[0] >= other[0] else other  # ties: the request's own history
            if best[1].tokens:
                self.won["request" if best is own else "global"] += 1
            out.append(best[1])
        return out

    def verified(self, results: list[VerifyResult]) -> None:
        # Drafts never enter the trees, so there is nothing to roll back: commit what the target emitted.
        for result in results:
            if result.seq_id in self._seqs and result.emitted_tokens:
                self._append(result.seq_id, result.emitted_tokens)

    def release(self, seq_ids: list[str]) -> None:
        """Free the requests' own trees; their outputs go into the global tree."""
        for seq_id in seq_ids:
            req = self._seqs.pop(seq_id, None)
            if req is not None:
                self._cache_output(req)
