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

Draft pool (sized by its own load; ``T`` targets, ``D`` drafts, ``cap = max``, or with a ratio bound
``min(max, max(min, ceil(max_ratio·T)))``):

- **up** when drafting pays (window mean accepted length ≥ ``min_accepted_length``) and the drafts hold
  the targets back or are full, ``D < cap``. In order: targets wait on proposals (share of their busy
  time spent waiting ≥ ``wait_high``: ``targets_wait``); drafts are saturated (mean share of wall time
  proposing ≥ ``busy_high``: ``drafts_busy``); proposals arrive too late to use (share ≥ ``late_high``:
  ``proposals_late``); a draft's call takes longer than a target step (seconds per propose call
  ≥ ``step_high`` × the targets' seconds per step: ``drafts_slow``); sequences queue on the drafts (mean
  sequences per propose call ≥ ``batch_high``: ``drafts_queued``). Lateness, slowness and queueing
  count only while the drafts work (busy > ``busy_low``): from idle drafts they come from something
  another draft would not fix (a draft slower than a step on its own);
- **down** when a ratio bound is set and ``D > cap`` (targets were removed), or drafts idle: busy ≤
  ``busy_low``, targets do not wait, proposals are not late, and the same work spread over ``D - 1``
  drafts (busy · D / (D - 1), sequences per call · D / (D - 1)) stays below ``busy_high`` and
  ``batch_high``; the last draft goes (with a minimum of 0) only when drafting is measured not to pay;
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
    late_share: float | None = None  # of the proposals the targets received, the share too late to use
    call_seconds: float | None = None  # drafting time per propose call, over all drafts
    step_seconds: float | None = None  # the targets' busy seconds per engine step
    batch: float | None = None  # sequences per propose call, over all drafts (what queued for each call)

    def describe(self) -> str:
        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{100 * x:.0f}%"

        def num(x: float | None, fmt: str) -> str:
            return "n/a" if x is None else format(x, fmt)

        def ms(x: float | None) -> str:
            return "n/a" if x is None else f"{1e3 * x:.1f} ms"

        return (f"{self.targets} targets, targets wait {pct(self.wait_share)} of busy time, drafts busy "
                f"{pct(self.busy)}, {pct(self.late_share)} of proposals late, {ms(self.call_seconds)} per draft "
                f"call against {ms(self.step_seconds)} per target step, {num(self.batch, '.1f')} sequences per "
                f"call, mean accepted length {num(self.accepted_length, '.2f')}")


def draft_cap(bounds: Bounds, rule: DraftRule, targets: int) -> int:
    """Most drafts the rule may ask for: ``max``, or with a ratio bound
    ``min(max, max(min, ceil(max_ratio · targets)))``."""
    if rule.max_ratio is None:
        return bounds.high
    return min(bounds.high, max(bounds.low, math.ceil(rule.max_ratio * targets)))


def draft_pressure(signals: DraftSignals, rule: DraftRule) -> str | None:
    """Why the drafts need help (the first reason in the module docstring's order), or None."""
    s = signals
    if s.wait_share is not None and s.wait_share >= rule.wait_high:
        return "targets_wait"
    if s.busy is not None and s.busy >= rule.busy_high:
        return "drafts_busy"
    working = s.busy is not None and s.busy > rule.busy_low
    if working and s.late_share is not None and s.late_share >= rule.late_high:
        return "proposals_late"
    if (working and s.call_seconds is not None and s.step_seconds is not None and s.step_seconds > 0
            and s.call_seconds >= rule.step_high * s.step_seconds):
        return "drafts_slow"
    if working and rule.batch_high > 0 and s.batch is not None and s.batch >= rule.batch_high:
        return "drafts_queued"
    return None


def _idle(n: int, signals: DraftSignals, rule: DraftRule) -> bool:
    """Whether ``n > 1`` drafts idle and ``n - 1`` would carry the same work without pressure."""
    s, spread = signals, n / (n - 1)
    return (s.busy is not None and s.busy <= rule.busy_low and s.busy * spread < rule.busy_high
            and not (s.wait_share is not None and s.wait_share >= rule.wait_high)
            and not (s.late_share is not None and s.late_share >= rule.late_high)
            and not (rule.batch_high > 0 and s.batch is not None and s.batch * spread >= rule.batch_high))


def decide_drafts(view: PoolView, signals: DraftSignals, bounds: Bounds, rule: DraftRule, timing: Timing) -> Decision:
    """The draft pool's rule (see the module docstring)."""
    n = view.replicas
    cap = draft_cap(bounds, rule, signals.targets)
    detail = signals.describe() + ("" if rule.max_ratio is None else f"; ratio cap {cap}")
    if n < bounds.low:
        return Decision(view.pool, n, bounds.low, "below_min", detail)
    if n > bounds.high:
        return Decision(view.pool, n, bounds.high, "above_max", detail)
    if n > cap:
        if view.since_change < timing.down_cooldown:
            return _hold(view, "cooldown", f"over_ratio, changed {view.since_change:.0f}s ago: {detail}")
        return Decision(view.pool, n, n - 1, "over_ratio", detail)
    pays = signals.accepted_length is not None and signals.accepted_length >= rule.min_accepted_length
    pressure = draft_pressure(signals, rule)
    if pays and pressure is not None:
        at_limit = "at_cap" if cap < bounds.high else "at_max"
        return _up(view, cap, at_limit, pressure, detail, timing)
    if n == 1 and signals.accepted_length is not None and not pays:
        reason = "does_not_pay"  # the last draft goes only when drafting is measured not to pay
    elif signals.busy is None:
        return _hold(view, "no_signal", detail)
    elif n > 1 and _idle(n, signals, rule):
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
