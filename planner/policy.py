"""The planner's decision rules: pure functions of plain values, one :class:`Decision` per pool per tick.

Latency pools (prefill: TTFT; target: ITL, and TTFT too when there is no prefill pool):

- **up** by one when any SLA's observed p90 over the window exceeds it (with at least ``min_samples``
  observations), unless the pool is at its maximum, a worker asked for earlier has not registered
  yet (``starting``), or the pool changed less than ``up_cooldown`` ago;
- **down** by one when every SLA's estimate *after removing one worker* (:mod:`planner.estimate`) is
  below ``down_ratio`` × the SLA, or the pool had no traffic at all over the window (``idle``), and
  the pool is above its minimum and changed at least ``down_cooldown`` ago;
- otherwise **hold**.

The gap between "above the SLA" and "below down_ratio × SLA after the removal" is the hysteresis:
a pool that just scaled up is not scaled back down by the next tick's better numbers.

Draft pool (the draft:target rule; ``T`` targets, ``D`` drafts, ``cap = min(max, ceil(max_ratio·T))``):

- **up** when drafting pays (window mean accepted length ≥ ``min_accepted_length``) and either targets
  wait on proposals (share of their busy time spent waiting ≥ ``wait_high``) or drafts are saturated
  (mean share of wall time proposing ≥ ``busy_high``), and ``D < cap``;
- **down** when ``D > cap`` (targets were removed), or drafts idle: busy ≤ ``busy_low``, targets do not
  wait, and the same proposal work spread over ``D - 1`` drafts (busy · D / (D - 1)) stays below ``busy_high``;
  the last draft goes (with a minimum of 0) only when drafting is measured not to pay;
- otherwise **hold**. Without draft measurements the pool holds (``no_signal``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import Bounds, DraftRule

INF = float("inf")


@dataclass(frozen=True)
class Decision:
    """What to do with one pool, and why (``reason``: a short code; ``detail``: the numbers)."""

    pool: str
    current: int
    desired: int
    reason: str
    detail: str = ""

    @property
    def action(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


@dataclass(frozen=True)
class Timing:
    """Cooldowns and patience, from :class:`planner.config.PlannerConfig`."""

    up_cooldown: float = 10.0
    down_cooldown: float = 30.0
    down_ratio: float = 0.7
    min_samples: int = 5
    start_timeout: float = 180.0


@dataclass(frozen=True)
class PoolView:
    """One pool as the planner sees it this tick."""

    pool: str
    replicas: int  # what was asked for (the connector's count)
    live: int  # registered in discovery now
    load: float = 0.0  # requests in flight (running + queued) per live worker
    since_change: float = INF  # seconds since this planner last changed the pool
    starting_for: float = 0.0  # seconds the pool has had fewer live workers than asked for (0: none missing)

    def starting(self, timing: Timing) -> bool:
        return self.live < self.replicas and self.starting_for < timing.start_timeout


@dataclass(frozen=True)
class SlaCheck:
    """One SLA of a pool: its target, what the window observed and the estimate after a removal."""

    name: str  # "ttft" or "itl"
    sla: float  # seconds, p90
    observed: float | None  # p90 over the window, seconds (None: nothing observed)
    samples: int = 0  # observations in the window
    after_removal: float | None = None  # estimated p90 with one worker fewer (None: unknown)

    def describe(self) -> str:
        seen = "none" if self.observed is None else f"{1e3 * self.observed:.1f} ms"
        after = "" if self.after_removal is None else f", {1e3 * self.after_removal:.1f} ms with one fewer"
        return f"{self.name} p90 {seen} of SLA {1e3 * self.sla:g} ms ({self.samples} samples{after})"


def _hold(view: PoolView, reason: str, detail: str) -> Decision:
    return Decision(view.pool, view.replicas, view.replicas, reason, detail)


def _up(view: PoolView, limit: int, at_limit: str, reason: str, detail: str, timing: Timing) -> Decision:
    """One more worker for ``reason``, unless the pool is at ``limit`` (held as ``at_limit``), a worker
    asked for earlier has not registered yet, or the pool changed within the up cooldown."""
    n = view.replicas
    if n >= limit:
        return _hold(view, at_limit, f"{reason}: {detail}")
    if view.starting(timing):
        return _hold(view, "starting", f"{reason}, {n - view.live} asked for not registered yet: {detail}")
    if view.since_change < timing.up_cooldown:
        return _hold(view, "cooldown", f"{reason}, changed {view.since_change:.0f}s ago: {detail}")
    return Decision(view.pool, n, n + 1, reason, detail)


def decide_latency_pool(view: PoolView, checks: list[SlaCheck], bounds: Bounds, timing: Timing) -> Decision:
    """Scale a prefill or target pool against its SLAs (see the module docstring)."""
    n = view.replicas
    detail = "; ".join(c.describe() for c in checks) + f"; {view.load:.2f} in flight per worker"
    if n < bounds.low:
        return Decision(view.pool, n, bounds.low, "below_min", detail)
    if n > bounds.high:
        return Decision(view.pool, n, bounds.high, "above_max", detail)
    trusted = [c for c in checks if c.observed is not None and c.samples >= timing.min_samples]
    over = [c for c in trusted if c.observed > c.sla]
    if over:
        return _up(view, bounds.high, "at_max", f"{over[0].name}_over_sla", detail, timing)
    if n <= bounds.low:
        return _hold(view, "at_min", detail)
    idle = view.load == 0 and all(c.samples == 0 for c in checks)
    if idle:
        reason = "idle"
    elif checks and all(c in trusted and c.after_removal is not None
                        and c.after_removal < timing.down_ratio * c.sla for c in checks):
        reason = "below_sla"
    else:
        return _hold(view, "within_sla", detail)
    if view.starting(timing):
        return _hold(view, "starting", f"{reason}, {n - view.live} asked for not registered yet: {detail}")
    if view.since_change < timing.down_cooldown:
        return _hold(view, "cooldown", f"{reason}, changed {view.since_change:.0f}s ago: {detail}")
    return Decision(view.pool, n, n - 1, reason, detail)


@dataclass(frozen=True)
class DraftSignals:
    """What the draft rule reads (None: not measured this window)."""

    targets: int  # live target (decode) workers
    wait_share: float | None = None  # of the targets' busy time, the share spent waiting on proposals
    busy: float | None = None  # mean share of wall time the drafts spent computing proposals
    accepted_length: float | None = None  # window mean accepted length (tokens per verify step)

    def describe(self) -> str:
        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{100 * x:.0f}%"

        length = "n/a" if self.accepted_length is None else f"{self.accepted_length:.2f}"
        return (f"{self.targets} targets, targets wait {pct(self.wait_share)} of busy time, drafts busy "
                f"{pct(self.busy)}, mean accepted length {length}")


def draft_cap(bounds: Bounds, rule: DraftRule, targets: int) -> int:
    """Most drafts worth having for ``targets`` targets: ``min(max, max(min, ceil(max_ratio · targets)))``."""
    return min(bounds.high, max(bounds.low, math.ceil(rule.max_ratio * targets)))


def decide_drafts(view: PoolView, signals: DraftSignals, bounds: Bounds, rule: DraftRule, timing: Timing) -> Decision:
    """The draft:target rule (see the module docstring)."""
    n = view.replicas
    cap = draft_cap(bounds, rule, signals.targets)
    detail = f"{signals.describe()}; cap {cap}"
    if n < bounds.low:
        return Decision(view.pool, n, bounds.low, "below_min", detail)
    if n > cap:
        if view.since_change < timing.down_cooldown:
            return _hold(view, "cooldown", f"over_ratio, changed {view.since_change:.0f}s ago: {detail}")
        return Decision(view.pool, n, n - 1, "over_ratio", detail)
    pays = signals.accepted_length is not None and signals.accepted_length >= rule.min_accepted_length
    waits = signals.wait_share is not None and signals.wait_share >= rule.wait_high
    busy = signals.busy is not None and signals.busy >= rule.busy_high
    if pays and (waits or busy):
        return _up(view, cap, "at_cap", "targets_wait" if waits else "drafts_busy", detail, timing)
    if n == 1 and signals.accepted_length is not None and not pays:
        reason = "does_not_pay"  # the last draft goes only when drafting is measured not to pay
    elif signals.busy is None:
        return _hold(view, "no_signal", detail)
    elif n > 1 and signals.busy <= rule.busy_low and not waits and signals.busy * n / (n - 1) < rule.busy_high:
        reason = "drafts_idle"
    else:
        return _hold(view, "balanced", detail)
    if n <= bounds.low:
        return _hold(view, "at_min", f"{reason}: {detail}")
    if view.starting(timing):
        return _hold(view, "starting", f"{reason}, {n - view.live} asked for not registered yet: {detail}")
    if view.since_change < timing.down_cooldown:
        return _hold(view, "cooldown", f"{reason}, changed {view.since_change:.0f}s ago: {detail}")
    return Decision(view.pool, n, n - 1, reason, detail)
