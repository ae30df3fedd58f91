"""The one spec-decode counters type: vLLM's definitions, undefined rates absent, event round trips."""

from __future__ import annotations

import time

import pytest

from runtime.messages import SpecStatsEvent, decode, encode
from runtime.spec_stats import SpecCounters, acceptance_rate, mean_accepted_length

pytestmark = pytest.mark.unit


def test_rates_follow_vllm_definitions():
    c = SpecCounters(10, 40, 25, [9, 7, 5, 4])
    assert c.acceptance_rate == 25 / 40
    assert c.mean_accepted_length == 1 + 25 / 10  # the 1 is the token the target adds itself
    assert acceptance_rate(25, 40) == 25 / 40 and mean_accepted_length(25, 10) == 1 + 25 / 10


def test_nothing_accepted_is_a_measurement_not_an_absence():
    c = SpecCounters(4, 16, 0, [0, 0, 0, 0])
    assert c.acceptance_rate == 0.0 and c.mean_accepted_length == 1.0


def test_no_drafts_means_the_rates_are_absent_not_zero():
    assert SpecCounters().acceptance_rate is None and SpecCounters().mean_accepted_length is None
    assert acceptance_rate(0, 0) is None and mean_accepted_length(0, 0) is None


def test_observe_draft_counts_accepted_prefixes_per_position():
    c = SpecCounters()
    c.observe_draft(4, 2)
    c.observe_draft(4, 4)
    c.observe_draft(2, 0)
    c.observe_draft(5, 1)  # a longer draft widens the position list
    assert c == SpecCounters(4, 15, 7, [3, 2, 1, 1, 0])
    assert c.mean_accepted_length == 1 + 7 / 4


@pytest.mark.parametrize("draft_tokens, accepted", [(3, 4), (3, -1)])
def test_observe_draft_rejects_impossible_counts(draft_tokens, accepted):
    with pytest.raises(ValueError):
        SpecCounters().observe_draft(draft_tokens, accepted)


def test_event_round_trip_keeps_every_counter():
    c = SpecCounters()
    c.observe_draft(3, 2)
    before = time.time()
    event = c.event("target-1", "draft-1", 123.5, "ngram")
    assert (event.target_id, event.draft_id, event.epoch, event.method) == ("target-1", "draft-1", 123.5, "ngram")
    assert before <= event.timestamp <= time.time()  # wall-clock seconds of the snapshot
    assert SpecCounters.of(decode(encode(event), SpecStatsEvent)) == c
    c.observe_draft(3, 3)
    assert event.accepted_per_pos == [1, 1, 0]  # the event is a snapshot, not a view


def test_add_pads_positions_and_subtracts_with_sign():
    a = SpecCounters(10, 40, 20, [8, 6, 4, 2])
    b = SpecCounters(3, 6, 3, [2, 1])
    assert a.add(b) == SpecCounters(13, 46, 23, [10, 7, 4, 2])
    assert a.add(b).add(b, -1) == a
    assert a.add(b).covers(a) and not a.covers(a.add(b)) and a.covers(a)
