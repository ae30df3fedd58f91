"""Proposal deadlines follow the target's own steps; late or malformed rounds back a draft off."""

from __future__ import annotations

import pytest

from workers.speculation.staging import StagedUse
from workers.target.draft_watch import DraftWatch

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_deadline_follows_the_step_time_within_bounds():
    w = DraftWatch(2.0)
    assert w.deadline() == 0.25  # nothing measured yet
    for _ in range(20):
        w.observe_step(0.030)
    assert w.deadline() == pytest.approx(0.090, rel=1e-3)  # three steps
    for _ in range(40):
        w.observe_step(0.001)
    assert w.deadline() == pytest.approx(0.020)  # the floor: a loopback round trip
    for _ in range(40):
        w.observe_step(5.0)
    assert w.deadline() == 2.0  # --propose-timeout caps it


def test_three_bad_rounds_back_off_doubling_and_a_good_round_clears():
    clock = Clock()
    w = DraftWatch(2.0, clock=clock)
    for _ in range(2):
        w.observe_round(4, 0, 0)  # silent
    assert w.allowed()
    w.observe_round(4, 1, 0)  # most proposals late: the third strike
    assert not w.allowed() and w.backoffs_total == 1
    clock.now = 0.51
    assert w.allowed()  # 0.5 s, then a probe
    for _ in range(3):
        w.observe_round(4, 4, 2)  # on time but malformed
    assert not w.allowed()
    clock.now = 0.51 + 0.99
    assert not w.allowed()  # the second backoff in a row lasts 1 s
    clock.now = 0.51 + 1.01
    w.observe_round(4, 4, 0)  # a good round
    for _ in range(3):
        w.observe_round(4, 0, 0)
    assert w.backoffs_total == 3 and not w.allowed()
    clock.now += 0.51
    assert w.allowed()  # the good round reset the doubling: 0.5 s again


def test_a_new_draft_starts_with_a_clean_slate():
    clock = Clock()
    w = DraftWatch(2.0, clock=clock)
    for _ in range(3):
        w.observe_round(2, 0, 0)
    assert not w.allowed()
    w.reset()
    assert w.allowed()


def test_a_pipelined_draft_whose_proposals_come_too_late_to_fit_is_backed_off_by_use():
    """Pipelined seam: nothing is awaited, so a late draft is judged by use. Over each window of 64
    sequence steps that had streamed proposals, under 2 % fitting while at least half the proposals
    that arrived came late backs it off (doubling, as for late rounds); a window at or above 2 %
    clears the doubling. Steps with nothing streamed (an n-gram draft without a match) are not
    judged."""
    clock = Clock()
    w = DraftWatch(2.0, clock=clock)
    for _ in range(1000):
        w.observe_staged(StagedUse(0, 0, 0, 0), False)  # nothing streamed: no opinion
    for _ in range(15):
        w.observe_staged(StagedUse(4, 0, 4, 4), False)  # 60 looked at, none fitted: the window is not full yet
    assert w.allowed()
    w.observe_staged(StagedUse(4, 0, 4, 2), False)  # 62 of 64 arrivals late
    assert not w.allowed() and w.backoffs_total == 1
    clock.now = 0.51
    assert w.allowed()
    for _ in range(16):
        w.observe_staged(StagedUse(4, 0, 4, 4), False)  # the probe finds nothing either: 1 s now
    clock.now += 0.99
    assert not w.allowed()
    clock.now += 0.02
    for _ in range(16):
        w.observe_staged(StagedUse(4, 1 if _ < 2 else 0, 4, 4), False)  # 2 of 64: 3 % fitted, a healthy window
    assert w.allowed() and w.backoffs_total == 2
    for _ in range(16):
        w.observe_staged(StagedUse(4, 0, 4, 4), False)
    clock.now += 0.51
    assert w.backoffs_total == 3 and w.allowed()  # the healthy window reset the doubling: 0.5 s


def test_a_pipelined_draft_that_keeps_up_but_guesses_wrong_is_not_backed_off():
    """Proposals that arrive in time and fit no step guessed wrong (a suffix draft before its tree
    holds anything like the text): no backoff, however long it lasts, unless the draft reads hidden
    states (then asking costs every step, and a head that keeps up yet never fits is broken); nor
    is the doubling cleared, so a late window after them backs off as long as it would have right
    after the last late one."""
    clock = Clock()
    w = DraftWatch(2.0, staged_window=4, clock=clock)
    for _ in range(400):
        w.observe_staged(StagedUse(1, 0, 1, 0), False)
    for _ in range(4):
        w.observe_staged(StagedUse(1, 0, 2, 1), False)  # half the arrivals late: it is judged late
    assert not w.allowed() and w.backoffs_total == 1
    clock.now += 0.51
    for _ in range(40):
        w.observe_staged(StagedUse(1, 0, 3, 1), False)  # a third late: kept up, and no opinion
    for _ in range(4):
        w.observe_staged(StagedUse(1, 0, 1, 1), False)
    assert w.backoffs_total == 2
    clock.now += 0.99
    assert not w.allowed()  # 1 s: the windows in between did not clear the doubling
    clock.now += 0.02
    assert w.allowed()
    for _ in range(4):
        w.observe_staged(StagedUse(1, 0, 1, 0), True)  # on time, never fitting, and it reads hidden states
    assert not w.allowed() and w.backoffs_total == 3


def test_rounds_that_arrive_whole_do_not_clear_the_doubling_for_want_of_use():
    """Every pipelined round arrives whole (nothing is awaited), so it says nothing of use: a draft
    whose proposals never fit is backed off for 0.5 s, then 1 s, then 2 s, whatever rounds arrive."""
    clock = Clock()
    w = DraftWatch(2.0, staged_window=4, clock=clock)
    for wait in (0.5, 1.0, 2.0):
        for _ in range(4):
            w.observe_round(1, 1, 0)
            w.observe_staged(StagedUse(1, 0, 1, 1), False)
        assert not w.allowed()
        clock.now += wait - 0.01
        assert not w.allowed()
        clock.now += 0.02
        assert w.allowed()
