"""What a target accepts from a draft worker: draft workers are untrusted input.

A proposal is used only if every field is sane for the request it answers; otherwise it is dropped
whole (the sequence decodes plainly that step) and the reason is counted. The checks are on plain
Python values, before any tensor is built from them.
"""

from __future__ import annotations

import math

from .payloads import ROOT, DraftOutput

PROB_SLACK = 1e-3  # a sparse distribution may sum to 1 + this (float32 rounding on the draft side)


def proposal_problem(prop: DraftOutput, asked: int, vocab_size: int) -> str | None:
    """Why ``prop`` cannot be used for a request of at most ``asked`` tokens, or None if it can.

    Checked: token ids in [0, vocab_size); no more tokens than asked; ``parents`` empty or one per
    token, each ROOT or an earlier index; ``distributions`` empty or one per token, each with as
    many ids as probabilities, ids in the vocabulary, probabilities finite in [0, 1] summing to at
    most 1, and a positive probability on the token it carries (a token drawn from q has q(x) > 0).
    """
    tokens = prop.token_ids
    if len(tokens) > asked:
        return "too_long"
    if any(not 0 <= t < vocab_size for t in tokens):
        return "token_id"
    parents = prop.parents
    if parents and (len(parents) != len(tokens) or any(not ROOT <= p < i for i, p in enumerate(parents))):
        return "parents"
    dists = prop.distributions
    if dists:
        if len(dists) != len(tokens):
            return "distributions"
        for token, dist in zip(tokens, dists):
            if len(dist.ids) != len(dist.probs) or any(not 0 <= i < vocab_size for i in dist.ids):
                return "distributions"
            if any(not (math.isfinite(p) and 0.0 <= p <= 1.0) for p in dist.probs):
                return "probabilities"
            if sum(dist.probs) > 1.0 + PROB_SLACK:
                return "probabilities"
            if not any(i == token and p > 0 for i, p in zip(dist.ids, dist.probs)):
                return "probabilities"
    return None
