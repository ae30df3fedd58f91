"""Prompt-lookup drafting against a brute-force reference."""

from __future__ import annotations

import random

import pytest

from workers.draft.drafter import Branch, DraftInput, VerifyResult
from workers.draft.ngram import NgramProposer

pytestmark = pytest.mark.unit


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def lookup(tokens: list[int], num_tokens: int) -> list[int]:
    p = NgramProposer(min_n=1, max_n=3)
    p.commit("s", tokens)
    return p.draft([Branch("s", (), num_tokens, sampled=True)])[0].tokens


def test_examples():
    assert lookup([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]
    assert lookup([1, 2, 3, 9, 2, 3], 3) == [9, 2, 3]
    assert lookup([5, 6, 7], 4) == []
    assert lookup([7], 4) == []
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


@pytest.mark.parametrize("seed", range(5))
def test_incremental_index_matches_brute_force(seed):
    rng = random.Random(seed)
    p = NgramProposer(min_n=2, max_n=4)
    tokens = [rng.randrange(4) for _ in range(5)]
    out = p.propose([DraftInput("s", 0, list(tokens), 3)])
    assert out[0].token_ids == reference(tokens, 3, 2, 4)
    for rnd in range(1, 60):
        emitted = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        p.verified([VerifyResult("s", rnd - 1, 0, emitted)])
        tokens += emitted
        new = [rng.randrange(4)] if rnd % 7 == 0 else []  # tokens decoded without speculation
        tokens += new
        [prop] = p.propose([DraftInput("s", rnd, new, 3)])
        assert prop.token_ids == reference(tokens, 3, 2, 4), rnd
        assert prop.distributions == []
    p.release(["s"])
    assert len(p) == 0


def test_tree_merges_the_continuations_of_every_occurrence():
    from workers.speculation.payloads import DraftInput
    # "1 2" occurs three times: followed by 3 4, 5 6 and 3 7 (most recent last)
    history = [1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2, 3, 7, 9, 1, 2]
    proposer = NgramProposer(1, 2, tree_topk=2)
    (out,) = proposer.propose([DraftInput("s", 0, history, 5)])
    # root children: 3 (two occurrences) before 5; under 3: 7 (most recent) then 4; under 5: 6
    assert out.token_ids == [3, 5, 7, 4, 6] and out.parents == [-1, -1, 0, 0, 1]
    (narrow,) = proposer.propose([DraftInput("s", 1, [], 3, tree_topk=1)])  # a chain on request
    assert narrow.token_ids == [3, 7, 9] and not narrow.is_tree
    (budget,) = proposer.propose([DraftInput("s", 2, [], 3)])
    assert budget.token_ids == [3, 5, 7] and budget.parents == [-1, -1, 0]
