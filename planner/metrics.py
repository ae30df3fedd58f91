"""The planner's Prometheus metrics (its ``/metrics``, ``--health-port``): every decision, its inputs and its reason.

    tandem_planner_replicas{pool}                  workers asked for (the connector's count)
    tandem_planner_live_replicas{pool}             workers registered in discovery
    tandem_planner_desired_replicas{pool}          the latest decision
    tandem_planner_decisions_total{pool, action, reason}   action: up, down, hold
    tandem_planner_scale_errors_total{pool}        decisions the connector could not enact
    tandem_planner_load_per_worker{pool}           requests in flight (running + queued) per live worker
    tandem_planner_latency_p90_seconds{metric}     observed p90 over the window (ttft, itl)
    tandem_planner_latency_samples{metric}         observations behind it
    tandem_planner_latency_after_removal_seconds{pool, metric}   estimated p90 with one worker fewer
    tandem_planner_sla_seconds{metric}             the SLA targets
    tandem_planner_draft_wait_share                targets' share of busy time spent waiting on proposals
    tandem_planner_draft_busy_share                drafts' mean share of wall time spent proposing
    tandem_planner_draft_late_share                share of proposals that reached the targets too late to use
    tandem_planner_draft_call_seconds              drafting time per propose call
    tandem_planner_target_step_seconds             the targets' busy seconds per engine step
    tandem_planner_draft_batch_size                sequences per propose call (what queued for each call)
    tandem_planner_mean_accepted_length            window mean accepted length over all (target, draft) pairs
    tandem_planner_signal_errors_total             sources that could not be read at a tick

A value that was not measured this tick is NaN (no traffic, no drafts), never a made-up 0.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

P = "tandem_planner_"
NAN = float("nan")


def _value(x: float | None) -> float:
    return NAN if x is None else x


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        r = registry
        self.replicas = Gauge(P + "replicas", "Workers asked for, per pool", ("pool",), registry=r)
        self.live = Gauge(P + "live_replicas", "Workers registered in discovery, per pool", ("pool",), registry=r)
        self.desired = Gauge(P + "desired_replicas", "Replicas the latest decision asked for", ("pool",), registry=r)
        self.decisions = Counter(P + "decisions", "Decisions by pool, action (up, down, hold) and reason",
                                 ("pool", "action", "reason"), registry=r)
        self.scale_errors = Counter(P + "scale_errors", "Decisions the connector could not enact", ("pool",), registry=r)
        self.load = Gauge(P + "load_per_worker", "Requests in flight per live worker", ("pool",), registry=r)
        self.latency = Gauge(P + "latency_p90_seconds", "Observed p90 over the window", ("metric",), registry=r)
        self.samples = Gauge(P + "latency_samples", "Observations in the window", ("metric",), registry=r)
        self.after_removal = Gauge(P + "latency_after_removal_seconds", "Estimated p90 with one worker fewer",
                                   ("pool", "metric"), registry=r)
        self.sla = Gauge(P + "sla_seconds", "SLA targets (p90)", ("metric",), registry=r)
        self.draft_wait = Gauge(P + "draft_wait_share", "Targets' share of busy time waiting on proposals", registry=r)
        self.draft_busy = Gauge(P + "draft_busy_share", "Drafts' mean share of wall time computing proposals", registry=r)
        self.draft_late = Gauge(P + "draft_late_share", "Share of proposals that reached the targets too late to use",
                                registry=r)
        self.draft_call = Gauge(P + "draft_call_seconds", "Drafting time per propose call", registry=r)
        self.target_step = Gauge(P + "target_step_seconds", "Targets' busy seconds per engine step", registry=r)
        self.draft_batch = Gauge(P + "draft_batch_size", "Sequences per propose call (what queued for each call)",
                                 registry=r)
        self.accepted_length = Gauge(P + "mean_accepted_length", "Window mean accepted length over all pairs",
                                     registry=r)
        self.signal_errors = Counter(P + "signal_errors", "Sources that could not be read at a tick", registry=r)

    def observe_sla(self, ttft: float | None, itl: float | None) -> None:
        for metric, value in (("ttft", ttft), ("itl", itl)):
            if value is not None:
                self.sla.labels(metric).set(value)

    def observe(self, observation, replicas: dict[str, int]) -> None:
        for pool, obs in observation.pools.items():
            self.live.labels(pool).set(len(obs.live))
            self.load.labels(pool).set(obs.load)
        for pool, n in replicas.items():
            self.replicas.labels(pool).set(n)
        for metric, stat in (("ttft", observation.ttft), ("itl", observation.itl)):
            self.latency.labels(metric).set(_value(stat.p90))
            self.samples.labels(metric).set(stat.samples)
        d = observation.draft
        self.draft_wait.set(_value(d.wait_share))
        self.draft_busy.set(_value(d.busy))
        self.draft_late.set(_value(d.late_share))
        self.draft_call.set(_value(d.call_seconds))
        self.target_step.set(_value(d.step_seconds))
        self.draft_batch.set(_value(d.batch))
        self.accepted_length.set(_value(d.accepted_length))
        if observation.errors:
            self.signal_errors.inc(len(observation.errors))

    def observe_checks(self, pool: str, checks) -> None:
        for check in checks:
            self.after_removal.labels(pool, check.name).set(_value(check.after_removal))

    def observe_decision(self, decision) -> None:
        self.desired.labels(decision.pool).set(decision.desired)
        self.decisions.labels(decision.pool, decision.action, decision.reason).inc()
