"""The planner's arithmetic: percentiles of a histogram over a time window, rates of counters, and
an online fit of latency against load.

- :func:`quantile` is PromQL's ``histogram_quantile``: find the bucket holding the q-th observation
  and interpolate linearly inside it (the ``+Inf`` bucket answers with the largest finite bound).
- :class:`Window` keeps timed snapshots of cumulative values (bucket counts or counters) and answers
  the difference between now and the newest snapshot at least ``span`` seconds old, so a percentile
  covers the last ``span`` seconds rather than the process's whole life.
- :class:`LoadFit` is ordinary least squares of ``latency ≈ a + b · load`` over recent ticks, where
  load is requests in flight per worker. Removing one of ``n`` workers spreads the same requests over
  ``n - 1``, so the estimate after a scale-down is ``a + b · load · n / (n - 1)``. With too few or too
  similar loads to fit, :meth:`LoadFit.after_removal` assumes latency proportional to load
  (``observed · n / (n - 1)``): an overestimate whenever a > 0, so it errs towards keeping workers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


def quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The ``q``-quantile of observations in buckets with upper ``bounds`` (ascending, finite) and
    per-bucket (not cumulative) ``counts``; ``counts`` has one more entry, the ``+Inf`` bucket.
    None with no observations."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if len(counts) != len(bounds) + 1:
        raise ValueError(f"{len(bounds)} bounds need {len(bounds) + 1} counts, got {len(counts)}")
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(counts):
        if n > 0 and seen + n >= rank:
            if i == len(bounds):  # the +Inf bucket: nothing better than the largest finite bound
                return bounds[-1] if bounds else None
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * (rank - seen) / n
        seen += n
    return bounds[-1] if bounds else None


class Window:
    """Timed snapshots of a vector of cumulative values; :meth:`delta` is their growth over ``span`` s."""

    def __init__(self, span: float):
        if span <= 0:
            raise ValueError(f"window span must be > 0 seconds, got {span}")
        self.span = span
        self._snaps: deque[tuple[float, tuple[float, ...]]] = deque()

    def add(self, now: float, values: Sequence[float]) -> None:
        values = tuple(values)
        if self._snaps and len(self._snaps[-1][1]) != len(values):
            self._snaps.clear()  # the series changed shape (e.g. new buckets): start over
        if self._snaps and any(v < old for v, old in zip(values, self._snaps[-1][1])):
            self._snaps.clear()  # a counter went back (the process restarted): start over
        self._snaps.append((now, values))
        while len(self._snaps) >= 2 and self._snaps[1][0] <= now - self.span:
            self._snaps.popleft()

    def delta(self) -> tuple[float, tuple[float, ...]] | None:
        """(seconds covered, growth of each value) from the oldest kept snapshot to the newest; None
        before two snapshots."""
        if len(self._snaps) < 2:
            return None
        (t0, v0), (t1, v1) = self._snaps[0], self._snaps[-1]
        return t1 - t0, tuple(b - a for a, b in zip(v0, v1))


@dataclass(frozen=True)
class Fit:
    a: float  # seconds at no load
    b: float  # seconds per request in flight per worker
    samples: int

    def at(self, load: float) -> float:
        return self.a + self.b * load


class LoadFit:
    """``latency ≈ a + b · load`` over the latest ``size`` (load, latency) samples."""

    def __init__(self, size: int = 60, min_samples: int = 6, min_spread: float = 1.0):
        self._samples: deque[tuple[float, float]] = deque(maxlen=size)
        self.min_samples = min_samples
        self.min_spread = min_spread  # loads must span at least this many requests per worker

    def add(self, load: float, latency: float) -> None:
        if math.isfinite(load) and math.isfinite(latency) and load >= 0 and latency >= 0:
            self._samples.append((load, latency))

    def fit(self) -> Fit | None:
        """The least-squares line, or None with too few samples, too narrow a load range, or a
        slope that says latency falls with load (noise, not a model to plan with)."""
        n = len(self._samples)
        if n < self.min_samples:
            return None
        xs = [x for x, _ in self._samples]
        if max(xs) - min(xs) < self.min_spread:
            return None
        mx = sum(xs) / n
        my = sum(y for _, y in self._samples) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (y - my) for x, y in self._samples)
        b = sxy / sxx
        if b <= 0:
            return None
        return Fit(my - b * mx, b, n)

    def after_removal(self, observed: float | None, load: float, workers: int) -> float | None:
        """Latency estimate with one worker fewer at the same total load; None for one worker (it
        cannot be removed) or without an observation to scale."""
        if workers <= 1:
            return None
        grown = load * workers / (workers - 1)
        fit = self.fit()
        if fit is not None:
            return fit.at(grown)
        if observed is None:
            return None
        return observed * workers / (workers - 1)
