"""The pipelined seam's reconciliation (pure): which streamed proposal fits a sequence's committed tokens."""

from __future__ import annotations

import pytest

from workers.speculation.payloads import DraftOutput, SparseDist
from workers.speculation.staging import Staged, overlap, position_problem, trimmed

pytestmark = pytest.mark.unit

COMMITTED = [5, 6, 7, 8, 9]


def prop(start, tokens, assumed, seq="s", parents=()):
    return DraftOutput(seq, 0, list(tokens), start=start, assumed=list(assumed), parents=list(parents))


def test_an_exact_fit_starts_where_the_sequence_ends_and_names_its_last_tokens():
    assert overlap(prop(5, [10, 11], [8, 9]), COMMITTED) == 0
    assert overlap(prop(5, [10, 11], []), COMMITTED) == 0  # nothing assumed past the position
    assert overlap(prop(5, [10, 11], [7, 8, 99]), COMMITTED) is None  # a wrong assumed token
    assert overlap(prop(4, [10, 11], [8]), COMMITTED) is None  # the right tokens, the wrong place
    assert overlap(prop(6, [10, 11], [9, 1]), COMMITTED) is None  # assumes a token not committed
    assert overlap(prop(5, [], [9]), COMMITTED) is None  # nothing to verify


def test_a_partial_overlap_is_trimmed_to_what_follows_the_committed_tokens():
    p = DraftOutput("s", 3, [8, 9, 10, 11], [SparseDist([t], [1.0]) for t in (8, 9, 10, 11)], start=3,
                    assumed=[6, 7])
    assert overlap(p, COMMITTED) == 2
    t = trimmed(p, 2)
    assert (t.start, t.token_ids, [d.ids for d in t.distributions], t.round) == (5, [10, 11], [[10], [11]], 3)
    assert overlap(t, COMMITTED) == 0
    # the draft's cumulative confidence, now conditional on the committed tokens
    c = trimmed(DraftOutput("s", 3, [8, 9, 10, 11], start=3, assumed=[6, 7], confidence=[0.8, 0.4, 0.2, 0.1]), 2)
    assert c.confidence == pytest.approx([0.5, 0.25])
    assert overlap(prop(3, [8, 99, 10], [7]), COMMITTED) is None  # the target committed something else
    assert overlap(prop(3, [8, 9], [7]), COMMITTED) is None  # all of it committed: nothing left
    assert overlap(prop(3, [8, 9, 10], [7], parents=[-1, -1, 0]), COMMITTED) is None  # trees fit only exactly
    assert overlap(prop(5, [10, 11, 12], [9], parents=[-1, -1, 0]), COMMITTED) == 0


def test_position_problems():
    assert position_problem(prop(0, [1], []), 100) == "position"
    assert position_problem(prop(2, [1], [1, 2, 3]), 100) == "assumed"  # more assumed than precede it
    assert position_problem(prop(5, [1], [100]), 100) == "assumed"
    assert position_problem(prop(5, [1], [1, 2]), 100) is None


def test_the_buffer_hands_out_the_fitting_proposal_with_most_tokens_and_drops_what_cannot_fit():
    staged = Staged(keep=8)
    staged.offer(prop(5, [10], [9]))
    staged.offer(prop(5, [10, 11, 12], [9]))
    staged.offer(prop(4, [9, 10, 11, 12, 13], [8]))  # overlaps by one, four left
    staged.offer(prop(5, [20, 21, 22, 23], [99]))  # wrong assumed token
    staged.offer(prop(7, [30], [10, 11]))  # for later
    best = staged.take("s", COMMITTED)
    assert (best.start, best.token_ids) == (5, [10, 11, 12, 13])
    assert staged.dropped == {"stale": 1}
    assert len(staged) == 4  # kept: a step that does not verify it may use it next time
    assert staged.take("s", COMMITTED + [10, 11]).token_ids == [12, 13]  # both ways fit; the longest wins
    assert staged.take("other", COMMITTED) is None


def test_the_buffer_is_bounded_per_sequence():
    drops = []
    staged = Staged(keep=2, on_drop=drops.append)
    for t in (10, 11, 12):
        staged.offer(prop(5, [t], [9]))
    assert len(staged) == 2 and drops == ["overflow"]
    assert staged.take("s", COMMITTED).token_ids == [12]  # ties: the freshest
    staged.drop("s")
    assert len(staged) == 0
