"""Sinks for the router's state: Prometheus collectors and the JSON spec-decode report.

Spec-decode counters (names after vLLM's ``spec_decode_*``; ``prometheus_client`` adds ``_total``)::

    tandem_spec_decode_num_drafts_total{target, draft}
    tandem_spec_decode_num_draft_tokens_total{target, draft}
    tandem_spec_decode_num_accepted_tokens_total{target, draft}
    tandem_spec_decode_num_accepted_tokens_per_pos_total{target, draft, position}

The PromQL for acceptance rate, mean accepted length and per-position acceptance is in
:mod:`runtime.spec_stats` (series ``tandem_spec_decode_*``, labels ``target``, ``draft``, ``position``).

The router's own sliding-window view is exported as gauges
``tandem_spec_decode_window_acceptance_rate{target}`` and
``tandem_spec_decode_window_mean_accepted_length{target}``; a target with no drafts in the window has
no sample (the rates are undefined, see :mod:`runtime.spec_stats`), and the JSON report leaves those
keys out. Counters are read from the aggregate at scrape time (custom collectors), so there is one
source of truth and no double bookkeeping.
"""

from __future__ import annotations

import dataclasses

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.histogram import histogram_family
from runtime.spec_stats import SpecCounters

from .spec_stats import SpecDecodeStats


class SpecDecodeCollector(Collector):
    """Prometheus view of a :class:`SpecDecodeStats`."""

    def __init__(self, stats: SpecDecodeStats):
        self.stats = stats

    def collect(self):
        labels = ["target", "draft"]
        drafts = CounterMetricFamily("tandem_spec_decode_num_drafts", "Speculative verification steps with a draft", labels=labels)
        tokens = CounterMetricFamily("tandem_spec_decode_num_draft_tokens", "Draft tokens proposed", labels=labels)
        accepted = CounterMetricFamily("tandem_spec_decode_num_accepted_tokens", "Draft tokens accepted", labels=labels)
        per_pos = CounterMetricFamily("tandem_spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at each position",
                                      labels=[*labels, "position"])
        for (target, draft), pair in sorted(self.stats.pairs.items()):
            c = pair.lifetime
            drafts.add_metric([target, draft], c.num_drafts)
            tokens.add_metric([target, draft], c.num_draft_tokens)
            accepted.add_metric([target, draft], c.num_accepted_tokens)
            for pos, n in enumerate(c.accepted_per_pos):
                per_pos.add_metric([target, draft, str(pos)], n)
        rate = GaugeMetricFamily("tandem_spec_decode_window_acceptance_rate",
                                 f"Accepted / draft tokens over the last {self.stats.window:g}s", labels=["target"])
        length = GaugeMetricFamily("tandem_spec_decode_window_mean_accepted_length",
                                   f"1 + accepted tokens / drafts over the last {self.stats.window:g}s", labels=["target"])
        for target in self.stats.targets():
            window = self.stats.target_window(target)
            if window.acceptance_rate is not None:
                rate.add_metric([target], window.acceptance_rate)
            if window.mean_accepted_length is not None:
                length.add_metric([target], window.mean_accepted_length)
        yield from (drafts, tokens, accepted, per_pos, rate, length)


class KvRouterCollector(Collector):
    """Prometheus view of a KV router: decisions, index size, in-flight selections, event handling."""

    def __init__(self, router):
        self.router = router

    def collect(self):
        r = self.router
        decisions = CounterMetricFamily("tandem_router_decisions", "Routing decisions made")
        decisions.add_metric([], r.decisions)
        blocks = GaugeMetricFamily("tandem_router_kv_blocks", "Blocks indexed per worker", labels=["worker"])
        for worker in sorted(r.index.workers()):
            blocks.add_metric([worker], r.index.num_blocks(worker))
        inflight = GaugeMetricFamily("tandem_router_in_flight", "Selections not released yet", labels=["worker"])
        for worker, n in sorted(r.in_flight.items()):
            inflight.add_metric([worker], n)
        events = CounterMetricFamily("tandem_router_kv_events", "KV events by outcome", labels=["outcome"])
        for outcome, n in dataclasses.asdict(r.index.counters).items():
            events.add_metric([outcome], n)
        yield from (decisions, blocks, inflight, events)
        yield from RouterQueueCollector(r).collect()


class RouterQueueCollector(Collector):
    """The KV router's pending queue (router/queue.py) and session affinity, under Dynamo's stems::

        tandem_router_queue_pending_requests{strict_priority}   requests held now, per tier
        tandem_router_queue_wait_seconds{strict_priority}       how long dispatched requests were held
        tandem_router_queue_max_wait_seconds{strict_priority}   the longest any of them was held
        tandem_router_session_affinity_total                    choices that kept a session on its worker

    Registered by the router service (with :class:`KvRouterCollector`) and by a frontend's embedded
    router; there (``dynamo=True``) the pending gauge is exported under Dynamo's frontend name too,
    ``dynamo_frontend_router_queue_pending_requests{strict_priority}``, for Dynamo's dashboards.
    """

    def __init__(self, router, dynamo: bool = False):
        self.router = router
        self.dynamo = dynamo

    def collect(self):
        r = self.router
        pending = GaugeMetricFamily("tandem_router_queue_pending_requests", "Requests held in the router queue",
                                    labels=["strict_priority"])
        for tier, n in sorted(r.queue.pending_by_tier.items()):
            pending.add_metric([str(tier)], n)
        yield pending
        if self.dynamo:
            alias = GaugeMetricFamily("dynamo_frontend_router_queue_pending_requests",
                                      "Requests pending in the router queue", labels=["strict_priority"])
            for tier, n in sorted(r.queue.pending_by_tier.items()):
                alias.add_metric([str(tier)], n)
            yield alias
        for tier, hist in sorted(r.queue_wait.items()):
            yield histogram_family("tandem_router_queue_wait_seconds", "Seconds requests were held in the router queue",
                                   hist, ["strict_priority"], [str(tier)])
        worst = GaugeMetricFamily("tandem_router_queue_max_wait_seconds", "The longest a request was held, per tier",
                                  labels=["strict_priority"])
        for tier, wait in sorted(r.queue_max_wait.items()):
            worst.add_metric([str(tier)], wait)
        yield worst
        affinity = CounterMetricFamily("tandem_router_session_affinity", "Choices that kept a session on its worker")
        affinity.add_metric([], r.session_hits)
        yield affinity


# --------------------------------------------------------------------------- JSON report


class CountersReport(msgspec.Struct, omit_defaults=True):
    """Counters and their rates; a rate that is undefined (no drafts) is left out."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None


class SpanReport(msgspec.Struct):
    lifetime: CountersReport
    window: CountersReport


class PairReport(msgspec.Struct):
    target: str
    draft: str
    method: str
    lifetime: CountersReport
    window: CountersReport


class TargetReport(msgspec.Struct):
    target: str
    lifetime: CountersReport
    window: CountersReport


class SpecStatsReport(msgspec.Struct):
    """What ``GET /v1/spec_stats`` returns."""

    window_s: float
    total: SpanReport
    targets: list[TargetReport]
    pairs: list[PairReport]


def counters_report(c: SpecCounters) -> CountersReport:
    return CountersReport(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, list(c.accepted_per_pos),
                          c.acceptance_rate, c.mean_accepted_length)


def spec_stats_report(stats: SpecDecodeStats, now: float | None = None) -> SpecStatsReport:
    """Lifetime and sliding-window aggregates in total, per target and per (target, draft) pair."""
    pairs = [PairReport(t, d, p.method, counters_report(p.lifetime), counters_report(stats.pair_window(p, now)))
             for (t, d), p in sorted(stats.pairs.items())]
    targets = [TargetReport(t, counters_report(stats.target_lifetime(t)), counters_report(stats.target_window(t, now)))
               for t in stats.targets()]
    total = SpanReport(counters_report(stats.total_lifetime()), counters_report(stats.total_window(now)))
    return SpecStatsReport(stats.window, total, targets, pairs)


def spec_stats_json(stats: SpecDecodeStats, now: float | None = None) -> dict:
    """The report as plain JSON-ready values."""
    return msgspec.to_builtins(spec_stats_report(stats, now))
