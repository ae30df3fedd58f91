"""Speculative-decoding statistics of every target worker, from their ``SpecStatsEvent``s.

Workers publish *cumulative* counters per (target, draft) pair since ``epoch`` (the target's start).
Per pair and epoch the aggregate keeps the largest counters seen (an older event arriving late never
lowers them); a new epoch starts a new entry and the earlier ones stay, so lifetime totals are the
sum over epochs and never go backwards when a target restarts. A target that leaves keeps its totals.

The counters and the definitions of acceptance rate and mean accepted length are
:class:`runtime.spec_stats.SpecCounters`'s (vLLM's; undefined rates are ``None``).

The sliding window (``window`` seconds) is the lifetime value now minus the lifetime value at the last
observation at least ``window`` seconds ago (or when the pair was first seen). A pair whose target
started after this aggregate did counts from zero at its first event.

This is the state and the arithmetic; :mod:`router.metrics` holds the Prometheus and JSON sinks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.events import TOPIC_SPEC_STATS
from runtime.messages import SpecStatsEvent
from runtime.spec_stats import SpecCounters

MAX_EPOCHS = 32  # epochs remembered per pair (their counts stay in the lifetime totals)


@dataclass
class PairStats:
    """Counters of one (target, draft) pair across the target's epochs."""

    target_id: str
    draft_id: str
    method: str = ""
    epochs: dict[float, SpecCounters] = field(default_factory=dict)
    forgotten_until: float = float("-inf")  # epochs up to this one are no longer remembered
    lifetime: SpecCounters = field(default_factory=SpecCounters)
    samples: deque = field(default_factory=deque)  # (time, lifetime) observations

    def observe(self, event: SpecStatsEvent) -> bool:
        """Apply one event; False if it carried nothing new (stale or duplicate)."""
        new = SpecCounters.of(event)
        old = self.epochs.get(event.epoch)
        if old is None and event.epoch <= self.forgotten_until:
            return False  # a late event of an epoch already counted and forgotten
        if old is not None and (not new.covers(old) or new == old):
            return False
        self.epochs[event.epoch] = new
        if len(self.epochs) > MAX_EPOCHS:
            first = min(self.epochs)
            del self.epochs[first]
            self.forgotten_until = max(self.forgotten_until, first)
        self.method = event.method or self.method
        self.lifetime = self.lifetime.add(new).add(old, -1) if old is not None else self.lifetime.add(new)
        return True


class SpecDecodeStats:
    """Aggregates of all workers' spec-decode counters: per pair, per target and in total."""

    def __init__(self, window: float = 60.0, clock: Callable[[], float] = time.monotonic, wall_now: float | None = None):
        """``clock`` times observations and windows; ``wall_now`` (default: now) is compared with
        targets' epochs, which are wall-clock start times."""
        if window <= 0:
            raise ValueError(f"window must be > 0 seconds, got {window}")
        self.window = window
        self.pairs: dict[tuple[str, str], PairStats] = {}
        self.events = 0
        self.stale_events = 0
        self._clock = clock
        self._started_wall = time.time() if wall_now is None else wall_now

    def observe_event(self, event: SpecStatsEvent, now: float | None = None) -> None:
        """Take one cumulative event (any order, duplicates allowed)."""
        now = self._clock() if now is None else now
        self.events += 1
        key = (event.target_id, event.draft_id)
        pair = self.pairs.get(key)
        if pair is None:
            pair = self.pairs[key] = PairStats(event.target_id, event.draft_id, event.method)
            if event.epoch >= self._started_wall:
                # the target started after we did: its whole life is in view, counting from zero
                pair.samples.append((now, SpecCounters()))
        if not pair.observe(event):
            self.stale_events += 1
            return
        pair.samples.append((now, pair.lifetime))
        self._trim(pair, now)

    def _trim(self, pair: PairStats, now: float) -> None:
        """Drop samples older than needed: keep the newest one at or before ``now - window``."""
        samples = pair.samples
        cutoff = now - self.window
        while len(samples) >= 2 and samples[1][0] <= cutoff:
            samples.popleft()

    # ------------------------------------------------------------------ queries

    def pair_window(self, pair: PairStats, now: float | None = None) -> SpecCounters:
        now = self._clock() if now is None else now
        self._trim(pair, now)
        if not pair.samples:
            return SpecCounters()
        return pair.lifetime.add(pair.samples[0][1], -1)

    def targets(self) -> list[str]:
        return sorted({t for t, _ in self.pairs})

    def target_lifetime(self, target_id: str) -> SpecCounters:
        total = SpecCounters()
        for (t, _), pair in self.pairs.items():
            if t == target_id:
                total = total.add(pair.lifetime)
        return total

    def target_window(self, target_id: str, now: float | None = None) -> SpecCounters:
        total = SpecCounters()
        for (t, _), pair in self.pairs.items():
            if t == target_id:
                total = total.add(self.pair_window(pair, now))
        return total

    def total_lifetime(self) -> SpecCounters:
        total = SpecCounters()
        for pair in self.pairs.values():
            total = total.add(pair.lifetime)
        return total

    def total_window(self, now: float | None = None) -> SpecCounters:
        total = SpecCounters()
        for pair in self.pairs.values():
            total = total.add(self.pair_window(pair, now))
        return total


async def follow_spec_stats(rt, stats: SpecDecodeStats):
    """Feed ``stats`` from the runtime's ``TOPIC_SPEC_STATS`` events; returns the subscription."""
    return await rt.subscribe(TOPIC_SPEC_STATS, SpecStatsEvent, stats.observe_event)
