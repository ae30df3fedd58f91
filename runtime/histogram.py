"""prometheus_client's Histogram (its buckets, sums and locking), unregistered, for the workers'
collectors, which read their stats at scrape time and expose each under their own name and labels."""

from __future__ import annotations

from prometheus_client import Histogram
from prometheus_client.core import HistogramMetricFamily

# vLLM's bounds (seconds) for a request's latency and its phases (e2e, queue, prefill, decode)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


def histogram(buckets: tuple[float, ...]) -> Histogram:
    return Histogram("h", "", buckets=buckets, registry=None)


def samples(hist: Histogram) -> tuple[list[tuple[str, float]], float]:
    """``hist``'s cumulative buckets (upper bound, count) and its sum, as a family's ``add_metric`` takes them."""
    [metric] = hist.collect()
    return ([(s.labels["le"], s.value) for s in metric.samples if s.name == "h_bucket"],
            next(s.value for s in metric.samples if s.name == "h_sum"))


def histogram_family(name: str, doc: str, hist: Histogram, labels: list[str], values: list[str]) -> HistogramMetricFamily:
    """``hist``'s buckets and sum as the family ``name`` with ``labels`` set to ``values``."""
    family = HistogramMetricFamily(name, doc, labels=labels)
    family.add_metric(values, *samples(hist))
    return family

