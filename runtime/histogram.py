"""A histogram kept as plain bucket counts, exposed through a ``HistogramMetricFamily`` by the
workers' collectors (which read their stats at scrape time rather than updating client metrics)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


# vLLM's bounds (seconds) for a request's latency and its phases (e2e, queue, prefill, decode)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    """Cumulative-at-exposition bucket counts for a HistogramMetricFamily."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times

    def buckets(self) -> list[tuple[str, float]]:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        out, acc = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), counts):
            acc += n
            out.append((bound, acc))
        return out
