"""The draft worker's metrics (``/metrics`` of its health port), read from the service at scrape time.

Counters: propose calls and the sequences and tokens they proposed, verdicts and the draft tokens the
targets accepted, draft-ahead passes, hidden-state bytes received. Histograms: sequences per propose
call (the batch the draft model runs) and seconds per propose call. Gauge: target streams connected.
Every series carries ``model`` (the target model served) and ``method`` (ngram, eagle3, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from runtime.histogram import Histogram

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class DraftStats:
    propose_calls: int = 0
    proposals: int = 0  # sequences proposed for
    draft_tokens: int = 0  # tokens (tree nodes) proposed
    verdicts: int = 0
    accepted_tokens: int = 0
    drafted_ahead: int = 0  # draft-ahead passes run
    hidden_bytes: int = 0  # hidden-state bytes received from targets
    batch_size: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))
    latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))


class DraftCollector(Collector):
    """Reads a :class:`workers.draft.service.DraftService` at scrape time."""

    def __init__(self, service, model: str, method: str):
        self.service = service
        self.labels = ["model", "method"]
        self.values = [model, method]

    def collect(self):
        stats: DraftStats = self.service.stats

        def family(kind, name: str, doc: str, value: float | None = None):
            f = kind(f"tandem_draft_{name}", doc, labels=self.labels)
            if value is not None:
                f.add_metric(self.values, value)
            return f

        yield family(GaugeMetricFamily, "target_streams", "Target workers streaming to this draft worker.",
                     len(self.service.streams))
        for name, doc, value in (
                ("propose_calls", "Propose calls run (each one batch over every waiting sequence).", stats.propose_calls),
                ("proposals", "Sequences proposed for.", stats.proposals),
                ("draft_tokens", "Draft tokens (tree nodes) proposed.", stats.draft_tokens),
                ("verdicts", "Verification outcomes received from targets.", stats.verdicts),
                ("accepted_tokens", "Draft tokens accepted, as verdicts report them (a sequence's last round "
                 "ends in a release, not a verdict).", stats.accepted_tokens),
                ("drafted_ahead", "Draft-ahead passes run while targets verified.", stats.drafted_ahead),
                ("hidden_state_bytes", "Hidden-state bytes received from targets.", stats.hidden_bytes)):
            yield family(CounterMetricFamily, name, doc, value)
        for name, doc, hist in (("batch_size", "Sequences per propose call.", stats.batch_size),
                                ("proposal_seconds", "Seconds per propose call.", stats.latency)):
            h = family(HistogramMetricFamily, name, doc)
            h.add_metric(self.values, hist.buckets(), hist.total)
            yield h
