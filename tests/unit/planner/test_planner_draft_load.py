"""The draft pool follows its own load: late proposals, drafting time per step and queueing scale it up,
the ratio is an optional bound, and the signals are read from the workers' real metrics text."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from planner.__main__ import parse_args, planner_config
from planner.config import Bounds, DraftRule
from planner.policy import DraftSignals, PoolView, Timing, decide_drafts, draft_cap
from planner.signals import draft_counters, draft_work, parse_metrics, target_counters
from workers.draft.metrics import DraftCollector, DraftStats

pytestmark = pytest.mark.unit

T = Timing(up_cooldown=10, down_cooldown=30, down_ratio=0.7, min_samples=5, start_timeout=60)
RULE = DraftRule()  # the defaults: no ratio bound
DB = Bounds(0, 6)


def drafts(replicas=1, since=1e9):
    return PoolView("draft", replicas, replicas, 0.0, since)


def signals(**kw):
    base = dict(targets=2, wait_share=0.0, busy=0.3, accepted_length=2.0)
    return DraftSignals(**{**base, **kw})


@pytest.mark.parametrize("kw, reason", [
    (dict(late_share=0.4), "proposals_late"),
    (dict(call_seconds=0.030, step_seconds=0.020), "drafts_slow"),
    (dict(batch=80.0), "drafts_queued"),
    (dict(wait_share=0.3, late_share=0.4), "targets_wait"),  # the first reason in the docstring's order
    (dict(busy=0.8, late_share=0.4), "drafts_busy"),
])
def test_late_slow_and_queued_drafts_are_each_a_reason_to_add_one(kw, reason):
    d = decide_drafts(drafts(2), signals(**kw), DB, RULE, T)
    assert (d.action, d.desired, d.reason) == ("up", 3, reason)


def test_lateness_slowness_and_queueing_of_idle_drafts_add_nothing():
    # a draft slower than a target step on its own: another draft would not make it faster
    for kw in (dict(late_share=0.4), dict(call_seconds=0.030, step_seconds=0.020), dict(batch=80.0)):
        d = decide_drafts(drafts(2), signals(busy=0.1, **kw), DB, RULE, T)
        assert d.action != "up", kw
    # and nothing is added where drafting does not pay
    assert decide_drafts(drafts(2), signals(late_share=0.9, accepted_length=1.1), DB, RULE, T).action == "hold"
    # batch_high 0: queueing is not read
    assert decide_drafts(drafts(2), signals(batch=500.0), DB, DraftRule(batch_high=0), T).reason == "balanced"


def test_without_a_ratio_bound_the_pool_grows_past_one_draft_per_target_up_to_its_maximum():
    late = signals(targets=1, late_share=0.5)
    assert draft_cap(DB, RULE, 1) == 6
    d = decide_drafts(drafts(3), late, DB, RULE, T)
    assert (d.action, d.desired) == ("up", 4)
    assert decide_drafts(drafts(6), late, DB, RULE, T).reason == "at_max"
    # the optional bound still caps, and still removes drafts beyond it
    bounded = DraftRule(max_ratio=2.0)
    assert decide_drafts(drafts(2), late, DB, bounded, T).reason == "at_cap"
    assert decide_drafts(drafts(3), late, DB, bounded, T).reason == "over_ratio"
    assert "ratio cap 2" in decide_drafts(drafts(2), late, DB, bounded, T).detail


def test_idle_drafts_go_only_when_the_rest_keeps_up():
    idle = signals(busy=0.05)
    assert decide_drafts(drafts(3), idle, DB, RULE, T).reason == "drafts_idle"
    # late proposals are not idleness
    assert decide_drafts(drafts(3), signals(busy=0.05, late_share=0.3), DB, RULE, T).action == "hold"
    # 50 sequences per call over 3 drafts -> 75 over 2: past batch_high (64), so all three stay
    assert decide_drafts(drafts(3), signals(busy=0.05, batch=50.0), DB, RULE, T).action == "hold"
    assert decide_drafts(drafts(3), signals(busy=0.05, batch=30.0), DB, RULE, T).action == "down"


def test_the_detail_names_every_signal():
    detail = decide_drafts(drafts(2), signals(late_share=0.25, call_seconds=0.012, step_seconds=0.02, batch=7.5),
                           DB, RULE, T).detail
    for part in ("25% of proposals late", "12.0 ms per draft call", "20.0 ms per target step",
                 "7.5 sequences per call"):
        assert part in detail


def test_the_ratio_flag_still_works_and_is_off_by_default():
    assert planner_config(parse_args(["--itl-p90", "50ms"])).draft.max_ratio is None
    cfg = planner_config(parse_args(["--itl-p90", "50ms", "--max-draft-ratio", "1.5", "--draft-late-high", "0.3",
                                     "--draft-step-high", "2", "--draft-batch-high", "0"]))
    assert (cfg.draft.max_ratio, cfg.draft.late_high, cfg.draft.step_high, cfg.draft.batch_high) == (1.5, 0.3, 2.0, 0.0)
    for bad in (dict(late_high=1.5), dict(step_high=0), dict(batch_high=-1), dict(max_ratio=0)):
        with pytest.raises(ValueError):
            DraftRule(**bad)


# ---------------------------------------------------------------- signals from metrics text

class _Service:
    """What :class:`DraftCollector` reads of a draft service."""

    def __init__(self, stats):
        self.stats, self.streams, self.distiller = stats, [], None


def draft_text(calls: list[tuple[int, float]]) -> str:
    """A draft worker's /metrics after propose calls of (sequences, seconds), by its own collector."""
    stats = DraftStats()
    for n, seconds in calls:
        stats.propose_calls += 1
        stats.batch_size.observe(n)
        stats.latency.observe(seconds)
    registry = CollectorRegistry()
    registry.register(DraftCollector(_Service(stats), "m", "suffix"))
    return generate_latest(registry).decode()


class _Target:
    """A target's counters under the names and labels :class:`workers.target.metrics.TargetCollector` gives them."""

    def __init__(self, values: dict[str, float]):
        self.values = values

    def collect(self):
        v = self.values
        for name, key in (("tandem_target_busy_seconds", "busy"), ("tandem_target_draft_wait_seconds", "wait"),
                          ("tandem_target_engine_steps", "steps"), ("tandem_target_draft_proposals_streamed", "streamed"),
                          ("tandem_target_draft_proposals_late", "late")):
            c = CounterMetricFamily(name, "", labels=["model"])
            c.add_metric(["m"], v[key])
            yield c
        plain = CounterMetricFamily("tandem_target_spec_plain_steps", "", labels=["model", "reason"])
        plain.add_metric(["m", "draft_late"], v["plain_late"])
        plain.add_metric(["m", "load"], 1000)
        yield plain
        drafts = CounterMetricFamily("vllm:spec_decode_num_drafts", "", labels=["model_name", "engine"])
        drafts.add_metric(["m", "0"], v["drafts"])
        yield drafts


def target(**kw):
    registry = CollectorRegistry()
    registry.register(_Target({**dict(busy=0, wait=0, steps=0, streamed=0, late=0, plain_late=0, drafts=0), **kw}))
    return target_counters(parse_metrics(generate_latest(registry).decode()))


def test_counters_are_read_from_the_workers_metrics_text():
    assert target(busy=10, wait=1, steps=500, streamed=40, late=8, plain_late=3, drafts=90) == (
        1.0, 10.0, 500.0, 40.0, 8.0, 3.0, 90.0)  # only the draft_late plain steps count
    got = draft_counters(parse_metrics(draft_text([(4, 0.004), (12, 0.02)])))
    assert got[1:] == (2.0, 16.0, 2.0) and got[0] == pytest.approx(0.024)
    # a mock target and a draft that exports nothing of this: not measured, not zero
    assert target_counters(parse_metrics("# TYPE x counter\nx_total 1\n")) is None
    assert draft_counters({}) is None


def test_the_window_growth_becomes_the_draft_signals():
    pipelined = (1.0, 10.0, 500.0, 40.0, 8.0, 0.0, 30.0)  # streamed grew: late streamed of streamed
    synchronous = (2.0, 10.0, 500.0, 0.0, 0.0, 12.0, 48.0)  # late rounds of late rounds + verified
    draft = (10.0, (3.0, 200.0, 1600.0, 200.0))
    idle = (10.0, (0.0, 0.0, 0.0, 0.0))
    work = draft_work([pipelined, synchronous], [draft, idle])
    assert work.wait_share == pytest.approx(3 / 20)
    assert work.late_share == pytest.approx((8 + 12) / (40 + 12 + 48))
    assert work.step_seconds == pytest.approx(20 / 1000)
    assert work.busy == pytest.approx((0.3 + 0.0) / 2)
    assert work.call_seconds == pytest.approx(3 / 200) and work.batch == pytest.approx(8.0)
    nothing = draft_work([], [])
    assert (nothing.wait_share, nothing.busy, nothing.late_share, nothing.batch) == (None, None, None, None)
