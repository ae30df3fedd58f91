"""The benchmarking oracle draft proposes the reference continuation with a set error rate."""

from __future__ import annotations

import pytest

from workers.draft.oracle import OracleProposer
from workers.draft.drafter import Branch, DraftInput, VerifyResult

pytestmark = pytest.mark.unit


def test_oracle_follows_the_reference_and_errs_at_the_set_rate():
    ref = list(range(100, 400))
    exact = OracleProposer([ref], 0.0, 1000)
    assert exact.propose([DraftInput("s", 0, ref[:10], 4)])[0].token_ids == ref[10:14]
    exact.verified([VerifyResult("s", 0, 4, ref[10:15])])
    assert exact.propose([DraftInput("s", 1, [], 3)])[0].token_ids == ref[15:18]
    assert exact.propose([DraftInput("t", 0, [1, 2], 3)])[0].token_ids == []  # unknown sequence

    noisy = OracleProposer([ref], 0.3, 10_000, seed=1)
    tokens = noisy.propose([DraftInput("s", 0, ref[:1], 299)])[0].token_ids
    wrong = sum(a != b for a, b in zip(tokens, ref[1:]))
    assert 0.2 < wrong / len(tokens) < 0.4
    with pytest.raises(ValueError):
        OracleProposer([ref], 1.5, 10)


def test_oracle_drafting_ahead_is_paid_once_and_dropped_on_rejection():
    ref = list(range(100, 400))
    oracle = OracleProposer([ref], 0.0, 1000, token_cost_s=0.001)
    assert oracle.propose([DraftInput("s", 0, ref[:10], 4)])[0].token_ids == ref[10:14]
    oracle.draft([Branch("s", (), 9, sampled=True)])  # the service drafts 2γ+1 ahead while the target verifies
    assert oracle.drafted_tokens == 9
    oracle.verified([VerifyResult("s", 0, 4, ref[10:15])])  # all accepted + bonus: the tail holds
    out = oracle.propose([DraftInput("s", 1, [], 4)])[0]
    assert out.token_ids == ref[15:19] and oracle.drafted_tokens == 9  # nothing new to draft
    oracle.draft([Branch("s", (), 9, sampled=True)])
    oracle.verified([VerifyResult("s", 1, 1, [ref[15], 7])])  # the target disagreed at the second token
    assert oracle.propose([DraftInput("s", 2, [], 4)])[0].token_ids == []  # 7 left the reference
    oracle.release(["s"])
    assert len(oracle) == 0

    slow = OracleProposer([ref], 0.0, 1000, token_cost_s=0.01)
    import time

    start = time.perf_counter()
    slow.propose([DraftInput("a", 0, ref[:5], 4), DraftInput("b", 0, ref[:9], 4)])
    assert 0.04 <= time.perf_counter() - start < 0.075  # a batch costs as much as its longest proposal
