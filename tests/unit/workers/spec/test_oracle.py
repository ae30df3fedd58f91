"""The benchmarking oracle draft proposes the reference continuation with a set error rate."""

from __future__ import annotations

import pytest

from workers.spec.oracle import OracleProposer
from workers.spec.proposer import DraftInput, VerifyResult

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
