"""Proposal deadlines follow the target's own steps; late or malformed rounds back a draft off."""

from __future__ import annotations

import pytest

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
