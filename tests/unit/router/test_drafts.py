"""The draft a conversation's next turn goes back to (router/drafts.py)."""

from __future__ import annotations

import pytest

from router.drafts import DraftAffinity

pytestmark = pytest.mark.unit


def test_a_next_turn_finds_the_draft_of_its_conversation_by_tokens_or_session():
    aff = DraftAffinity(block=4)
    system = [1, 2, 3, 4]
    a = system + [10, 11, 12, 13, 14]
    b = system + [20, 21, 22, 23]
    assert aff.choose(a) == ""
    aff.note(a + [15, 16, 17], "d1")  # turn one of a, served by d1
    aff.note(b + [25], "d2")
    assert aff.choose(a + [15, 16, 17, 30, 31]) == "d1"  # its next turn: prompt = history + new message
    assert aff.choose(b + [25, 26, 27]) == "d2"
    assert aff.choose(system + [40, 41, 42, 43, 44]) == ""  # only the system prompt shared: no conversation
    assert aff.choose([9, 9], session_id="s") == ""
    aff.note([9, 9], "d3", session_id="s")  # shorter than a block: known by its session only
    assert aff.choose([7, 7, 7, 7, 7], session_id="s") == "d3"
    assert (aff.hits, aff.misses) == (3, 3)


def test_the_latest_turn_wins_and_the_oldest_conversations_go_first():
    aff = DraftAffinity(capacity=2, block=2)
    aff.note([1, 2, 3], "d1")
    aff.note([1, 2, 3], "d2")
    assert aff.choose([1, 2, 3, 4]) == "d2"
    aff.note([5, 6], "d1")
    aff.note([7, 8], "d1")  # a third conversation: [1, 2]'s is dropped
    assert aff.choose([1, 2, 9]) == "" and aff.choose([7, 8, 9]) == "d1"
    aff.note([1, 2], "")  # a turn that did not speculate teaches nothing
    assert aff.choose([1, 2]) == ""
    with pytest.raises(ValueError):
        DraftAffinity(capacity=0)
