"""The decision rules: SLA scaling with hysteresis and cooldowns, and the draft:target rule."""

from __future__ import annotations

import pytest

from planner.config import Bounds, DraftRule, PlannerConfig, parse_seconds
from planner.policy import DraftSignals, PoolView, SlaCheck, Timing, decide_drafts, decide_latency_pool, draft_cap

pytestmark = pytest.mark.unit

T = Timing(up_cooldown=10, down_cooldown=30, down_ratio=0.7, min_samples=5, start_timeout=60)
B = Bounds(1, 4)
ITL = 0.050


def view(replicas=2, live=None, load=4.0, since=1e9, starting_for=0.0, pool="target"):
    return PoolView(pool, replicas, replicas if live is None else live, load, since, starting_for)


def itl(observed, samples=50, after=None):
    return SlaCheck("itl", ITL, observed, samples, after)


def test_scales_up_by_one_when_the_observed_p90_exceeds_the_sla():
    d = decide_latency_pool(view(), [itl(0.080, after=0.12)], B, T)
    assert (d.action, d.desired, d.reason) == ("up", 3, "itl_over_sla")
    assert "80.0 ms" in d.detail and "SLA 50 ms" in d.detail


def test_too_few_samples_are_not_trusted():
    assert decide_latency_pool(view(), [itl(0.080, samples=2)], B, T).action == "hold"


def test_up_is_held_at_max_during_cooldown_and_while_a_worker_starts():
    assert decide_latency_pool(view(replicas=4), [itl(0.08)], B, T).reason == "at_max"
    assert decide_latency_pool(view(since=3), [itl(0.08)], B, T).reason == "cooldown"
    starting = decide_latency_pool(view(replicas=3, live=2, starting_for=5), [itl(0.08)], B, T)
    assert starting.reason == "starting" and starting.action == "hold"
    # a worker that never registers is not waited for forever
    late = decide_latency_pool(view(replicas=3, live=2, starting_for=61), [itl(0.08)], B, T)
    assert late.action == "up"


def test_down_only_when_the_estimate_after_removal_is_well_below_the_sla():
    # hysteresis: under the SLA but the estimate with one fewer is above 0.7 x SLA -> hold
    assert decide_latency_pool(view(), [itl(0.030, after=0.040)], B, T).reason == "within_sla"
    d = decide_latency_pool(view(), [itl(0.020, after=0.030)], B, T)
    assert (d.action, d.desired, d.reason) == ("down", 1, "below_sla")
    assert decide_latency_pool(view(since=20), [itl(0.020, after=0.030)], B, T).reason == "cooldown"
    assert decide_latency_pool(view(replicas=1), [itl(0.020, after=None)], B, T).reason == "at_min"


def test_every_sla_must_agree_before_scaling_down():
    ttft = SlaCheck("ttft", 1.0, 0.9, 50, 1.4)
    assert decide_latency_pool(view(), [itl(0.02, after=0.03), ttft], B, T).action == "hold"
    over = SlaCheck("ttft", 1.0, 1.2, 50, 1.4)
    d = decide_latency_pool(view(), [itl(0.02, after=0.03), over], B, T)
    assert (d.action, d.reason) == ("up", "ttft_over_sla")


def test_an_idle_pool_shrinks_to_its_minimum():
    d = decide_latency_pool(view(load=0.0), [itl(None, samples=0)], B, T)
    assert (d.action, d.reason) == ("down", "idle")
    # traffic too thin to judge is not idleness
    assert decide_latency_pool(view(load=0.5), [itl(0.01, samples=2)], B, T).action == "hold"


def test_bounds_are_restored_first():
    assert decide_latency_pool(view(replicas=0), [itl(None, 0)], B, T).desired == 1
    assert decide_latency_pool(view(replicas=6), [itl(0.2)], B, T).desired == 4


RULE = DraftRule(wait_high=0.1, busy_high=0.6, busy_low=0.15, min_accepted_length=1.3, max_ratio=1.0)
DB = Bounds(0, 4)


def drafts(replicas=1, since=1e9):
    return view(replicas=replicas, since=since, pool="draft")


def test_drafts_are_added_when_targets_wait_and_drafting_pays():
    s = DraftSignals(targets=2, wait_share=0.3, busy=0.4, accepted_length=2.1)
    d = decide_drafts(drafts(1), s, DB, RULE, T)
    assert (d.action, d.desired, d.reason) == ("up", 2, "targets_wait")


def test_drafts_are_added_when_saturated_and_drafting_pays():
    s = DraftSignals(targets=3, wait_share=0.02, busy=0.8, accepted_length=1.8)
    assert decide_drafts(drafts(1), s, DB, RULE, T).reason == "drafts_busy"


def test_no_draft_is_added_when_drafting_does_not_pay_or_past_the_ratio():
    waits_but_useless = DraftSignals(targets=2, wait_share=0.5, busy=0.9, accepted_length=1.05)
    assert decide_drafts(drafts(2), waits_but_useless, Bounds(1, 4), RULE, T).action == "hold"
    # with a minimum of 0 the last draft even goes: waiting on drafts that are not accepted costs
    assert decide_drafts(drafts(1), waits_but_useless, DB, RULE, T).reason == "does_not_pay"
    one_target = DraftSignals(targets=1, wait_share=0.5, busy=0.9, accepted_length=2.0)
    assert decide_drafts(drafts(1), one_target, DB, RULE, T).reason == "at_cap"


def test_idle_drafts_are_removed_but_not_when_the_rest_would_saturate():
    idle = DraftSignals(targets=2, wait_share=0.0, busy=0.05, accepted_length=2.0)
    d = decide_drafts(drafts(2), idle, DB, RULE, T)
    assert (d.action, d.reason) == ("down", "drafts_idle")
    # 0.14 busy over 4 drafts -> 0.19 over 3: still idle enough; 0.14 over 2 -> 0.28: fine too
    assert decide_drafts(drafts(2), DraftSignals(2, 0.0, 0.14, 2.0), DB, RULE, T).action == "down"
    # targets waiting: not idle
    assert decide_drafts(drafts(2), DraftSignals(2, 0.2, 0.05, 1.1), DB, RULE, T).action == "hold"
    # the last draft stays while drafting pays, goes when it is measured not to
    assert decide_drafts(drafts(1), DraftSignals(1, 0.0, 0.0, 2.0), DB, RULE, T).action == "hold"
    assert decide_drafts(drafts(1), DraftSignals(1, 0.0, 0.0, 1.02), DB, RULE, T).reason == "does_not_pay"


def test_drafts_beyond_the_ratio_go_and_missing_signals_hold():
    assert decide_drafts(drafts(3), DraftSignals(targets=1), DB, RULE, T).reason == "over_ratio"
    assert decide_drafts(drafts(1), DraftSignals(targets=2), DB, RULE, T).reason == "no_signal"
    assert draft_cap(Bounds(1, 8), DraftRule(max_ratio=0.5), 5) == 3


def test_config_rejects_nonsense():
    assert parse_seconds("50ms") == pytest.approx(0.05) and parse_seconds("2") == 2.0
    for bad in ("fast", "-1ms", "5 m"):
        with pytest.raises(ValueError):
            parse_seconds(bad)
    with pytest.raises(ValueError, match="at least one SLA"):
        PlannerConfig()
    with pytest.raises(ValueError, match="min targets"):
        PlannerConfig(itl_p90=0.05, bounds={"prefill": Bounds(0, 0), "target": Bounds(0, 2), "draft": Bounds(0, 1)})
    with pytest.raises(ValueError, match="busy-low"):
        DraftRule(busy_low=0.7, busy_high=0.6)
    with pytest.raises(ValueError, match="min <= max"):
        Bounds(3, 2)
