"""Greedy verification follows the plain decode rule exactly (the argmax of the scores, as
``sampling.sample`` takes it), on the all-greedy fast path and in batches mixed with sampled rows."""

from __future__ import annotations

import torch

import pytest

from workers.engine.sampling import sample
from workers.engine.verifier import Candidate, verify

pytestmark = pytest.mark.unit


def _plain(scores: torch.Tensor) -> list[int]:
    return sample(scores, [True] * scores.shape[0], [None] * scores.shape[0]).tolist()


def test_greedy_chains_accept_the_scores_argmax_prefix_and_emit_the_next_argmax():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(14, 50, generator=gen)
    best = _plain(scores)
    # rows 0-4: a chain of 4 whose first two tokens are the argmax; rows 5-6: a chain of 1, right;
    # rows 7-11: a chain of 4, all right
    chains = [Candidate([best[0], best[1], (best[2] + 1) % 50, best[3]], [], [], 0, True),
              Candidate([best[5]], [], [], 5, True),
              Candidate(best[7:11], [], [], 7, True)]
    out = verify(scores, chains)
    assert [o.tokens for o in out] == [[best[0], best[1], best[2]], [best[5], best[6]], best[7:12]]
    assert [o.path for o in out] == [[0, 1], [0], [0, 1, 2, 3]]
    # the same greedy rows beside a sampled one (the general path) come out the same
    mixed = verify(scores, chains + [Candidate([3], [], [], 12, False, torch.Generator().manual_seed(1))])
    assert [o.tokens for o in mixed[:3]] == [o.tokens for o in out]
    # chains far apart among many plain rows (their rows gathered, not read as one block): the same rule
    wide = torch.randn(40, 50, generator=gen)
    top = _plain(wide)
    apart = verify(wide, [Candidate([top[0]], [], [], 0, True), Candidate([(top[37] + 1) % 50, 7], [], [], 37, True)])
    assert [o.tokens for o in apart] == [[top[0], top[1]], [top[37]]]


def test_a_tie_in_the_softmax_that_the_scores_break_goes_the_plain_decode_way():
    # exp(-1e-8) rounds to 1.0 in float32: the softmax ties tokens 0 and 1, the scores do not (token 1)
    scores = torch.full((4, 8), -5.0)
    scores[0, 0], scores[0, 1] = -1e-8, 0.0
    assert scores[0].softmax(-1)[0] == scores[0].softmax(-1)[1]
    assert _plain(scores)[0] == 1
    draft = [Candidate([1], [], [], 0, True)]
    assert verify(scores, draft)[0].tokens == [1, _plain(scores)[1]]
    mixed = verify(scores, draft + [Candidate([2], [], [], 2, False, torch.Generator().manual_seed(0))])
    assert mixed[0].tokens == [1, _plain(scores)[1]]
