"""Spec-decode aggregates: cumulative events, stale and duplicate events, restarts, windows, sinks."""

from __future__ import annotations

import pytest

from router.metrics import SpecDecodeCollector, spec_stats_json
from router.spec_stats import SpecDecodeStats
from runtime.messages import SpecStatsEvent
from runtime.spec_stats import SpecCounters
from tests.support.metrics import assert_exposed, exposition

pytestmark = pytest.mark.unit

T0 = 1_000.0  # wall-clock epoch of targets that started before the aggregate


def ev(target, draft, epoch, drafts, tokens, accepted, per_pos, method="mock"):
    return SpecStatsEvent(target, draft, epoch, drafts, tokens, accepted, per_pos, method)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fresh(window=60.0, clock=None) -> SpecDecodeStats:
    return SpecDecodeStats(window, clock or Clock(), wall_now=2_000.0)


def test_per_pair_per_target_and_total():
    s = fresh()
    s.observe_event(ev("t1", "d1", T0, 10, 40, 20, [8, 6, 4, 2]), now=1.0)
    s.observe_event(ev("t1", "d2", T0, 5, 10, 10, [5, 5]), now=1.0)
    s.observe_event(ev("t2", "d1", T0, 1, 4, 0, [0, 0, 0, 0]), now=1.0)
    assert s.target_lifetime("t1") == SpecCounters(15, 50, 30, [13, 11, 4, 2])
    assert s.total_lifetime() == SpecCounters(16, 54, 30, [13, 11, 4, 2])
    assert s.pairs[("t1", "d2")].lifetime == SpecCounters(5, 10, 10, [5, 5])
    assert s.targets() == ["t1", "t2"]


def test_cumulative_updates_replace_and_stale_or_duplicate_events_are_ignored():
    s = fresh()
    s.observe_event(ev("t", "d", T0, 10, 40, 20, [8, 6, 4, 2]), now=1.0)
    s.observe_event(ev("t", "d", T0, 12, 48, 25, [10, 7, 5, 3]), now=2.0)
    s.observe_event(ev("t", "d", T0, 11, 44, 22, [9, 6, 5, 2]), now=3.0)  # late, older
    s.observe_event(ev("t", "d", T0, 12, 48, 25, [10, 7, 5, 3]), now=4.0)  # duplicate
    assert s.total_lifetime() == SpecCounters(12, 48, 25, [10, 7, 5, 3])
    assert s.stale_events == 2 and s.events == 4


def test_a_restarted_target_never_makes_counters_go_backwards():
    s = fresh()
    s.observe_event(ev("t", "d", T0, 100, 400, 300, [90, 80, 70, 60]), now=1.0)
    s.observe_event(ev("t", "d", T0 + 50, 3, 12, 6, [3, 2, 1, 0]), now=2.0)  # restarted: counts from 0
    assert s.total_lifetime() == SpecCounters(103, 412, 306, [93, 82, 71, 60])
    s.observe_event(ev("t", "d", T0, 101, 404, 303, [91, 81, 71, 60]), now=3.0)  # old epoch's last words
    assert s.total_lifetime() == SpecCounters(104, 416, 309, [94, 83, 72, 60])
    s.observe_event(ev("t", "d", T0 + 50, 4, 16, 6, [3, 2, 1, 0]), now=4.0)
    assert s.total_lifetime().num_drafts == 105


def test_sliding_window():
    s = fresh(window=10.0)
    s.observe_event(ev("t", "d", T0, 100, 400, 100, [50, 30, 15, 5]), now=0.0)  # seen late: baseline
    s.observe_event(ev("t", "d", T0, 110, 440, 140, [60, 40, 25, 15]), now=5.0)
    s.observe_event(ev("t", "d", T0, 130, 520, 140, [60, 40, 25, 15]), now=12.0)
    assert s.total_window(now=12.0) == SpecCounters(30, 120, 40, [10, 10, 10, 10])
    # at t=16 the newest sample at or before t-10=6 is t=5
    w = s.total_window(now=16.0)
    assert w == SpecCounters(20, 80, 0, [0, 0, 0, 0]) and w.acceptance_rate == 0 and w.mean_accepted_length == 1
    empty = s.total_window(now=30.0)
    assert empty == SpecCounters(0, 0, 0, [0, 0, 0, 0])
    assert empty.acceptance_rate is None and empty.mean_accepted_length is None
    assert s.total_lifetime().num_drafts == 130


def test_a_target_started_after_the_aggregate_counts_from_zero_in_the_window():
    s = fresh(window=10.0)
    s.observe_event(ev("t", "d", 2_500.0, 7, 28, 14, [5, 4, 3, 2]), now=3.0)
    assert s.total_window(now=3.0) == SpecCounters(7, 28, 14, [5, 4, 3, 2])


def test_window_must_be_positive():
    with pytest.raises(ValueError):
        SpecDecodeStats(0)


def test_prometheus_sink_uses_vllm_names_and_labels():
    clock = Clock()
    s = fresh(clock=clock)
    s.observe_event(ev("t1", "d1", T0, 10, 40, 20, [8, 6, 4, 2]), now=1.0)
    s.observe_event(ev("t1", "d1", T0, 12, 48, 26, [10, 8, 5, 3]), now=2.0)
    clock.now = 3.0
    assert_exposed(exposition(SpecDecodeCollector(s)),
                   'tandem_spec_decode_num_drafts_total{draft="d1",target="t1"} 12.0',
                   'tandem_spec_decode_num_draft_tokens_total{draft="d1",target="t1"} 48.0',
                   'tandem_spec_decode_num_accepted_tokens_total{draft="d1",target="t1"} 26.0',
                   'tandem_spec_decode_num_accepted_tokens_per_pos_total{draft="d1",position="2",target="t1"} 5.0',
                   "# TYPE tandem_spec_decode_num_drafts_total counter",
                   # the window gauge covers the change since the first (baseline) observation: 6 of 8 accepted
                   'tandem_spec_decode_window_acceptance_rate{target="t1"} 0.75',
                   'tandem_spec_decode_window_mean_accepted_length{target="t1"} 4.0')


def test_prometheus_window_gauges_have_no_sample_without_drafts():
    clock = Clock()
    s = fresh(window=10.0, clock=clock)
    s.observe_event(ev("t1", "d1", T0, 10, 40, 20, [8, 6, 4, 2]), now=0.0)  # seen late: the baseline
    clock.now = 30.0
    text = exposition(SpecDecodeCollector(s))
    assert 'tandem_spec_decode_num_drafts_total{draft="d1",target="t1"} 10.0' in text
    assert "tandem_spec_decode_window_acceptance_rate{" not in text
    assert "tandem_spec_decode_window_mean_accepted_length{" not in text
    assert "NaN" not in text


def test_json_sink():
    s = fresh()
    s.observe_event(ev("t1", "d1", T0, 10, 40, 20, [8, 6, 4, 2]), now=1.0)
    report = spec_stats_json(s, now=1.0)
    assert report["window_s"] == 60.0
    assert report["total"]["lifetime"] == {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 20,
                                           "accepted_per_pos": [8, 6, 4, 2], "acceptance_rate": 0.5,
                                           "mean_accepted_length": 3.0}
    [pair] = report["pairs"]
    assert (pair["target"], pair["draft"], pair["method"]) == ("t1", "d1", "mock")
    # no drafts in the window: the rates are undefined, so the keys are absent (not 0, not null)
    assert pair["window"] == {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                              "accepted_per_pos": [0, 0, 0, 0]}
    assert report["targets"][0]["target"] == "t1"


def test_many_restarts_keep_totals_and_ignore_late_events_of_forgotten_epochs():
    from router.spec_stats import MAX_EPOCHS

    s = fresh()
    for i in range(MAX_EPOCHS + 5):
        s.observe_event(ev("t", "d", T0 + i, 1, 4, 2, [1, 1]), now=float(i))
    assert s.total_lifetime() == SpecCounters(MAX_EPOCHS + 5, 4 * (MAX_EPOCHS + 5), 2 * (MAX_EPOCHS + 5), [MAX_EPOCHS + 5] * 2)
    s.observe_event(ev("t", "d", T0, 9, 36, 18, [9, 9]), now=99.0)  # epoch 0, long forgotten
    assert s.total_lifetime().num_drafts == MAX_EPOCHS + 5 and len(s.pairs[("t", "d")].epochs) == MAX_EPOCHS
