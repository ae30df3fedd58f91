"""The draft worker's metrics (``/metrics`` of its health port), read from the service at scrape time.

Counters: propose calls and the sequences and tokens they proposed, verdicts and the draft tokens the
targets accepted, draft-ahead passes, hidden-state bytes received. Histograms: sequences per propose
call (the batch the draft model runs) and seconds per propose call. Gauge: target streams connected.
Every series carries ``model`` (the target model served) and ``method`` (ngram, eagle3, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.histogram import histogram, histogram_family

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
    weight_swaps: int = 0  # new head weights taken (online distillation, --distill-config's follow)
    batch_size: Histogram = field(default_factory=lambda: histogram(BATCH_BUCKETS))
    latency: Histogram = field(default_factory=lambda: histogram(LATENCY_BUCKETS))


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
                ("hidden_state_bytes", "Hidden-state bytes received from targets.", stats.hidden_bytes),
                ("weight_swaps", "New head weights taken between proposals (online distillation, "
                 "--distill-config's follow).", stats.weight_swaps)):
            yield family(CounterMetricFamily, name, doc, value)
        distiller = self.service.distiller
        if distiller is not None:
            yield from self._distill(family, distiller.stats)
        for name, doc, hist in (("batch_size", "Sequences per propose call.", stats.batch_size),
                                ("proposal_seconds", "Seconds per propose call.", stats.latency)):
            yield histogram_family(f"tandem_draft_{name}", doc, hist, self.labels, self.values)

    @staticmethod
    def _distill(family, d):
        """Online distillation (``--online-distill``): its work, its cost and what it changed."""
        for name, doc, value in (
                ("distill_samples", "Finished greedy sequences offered to the trainer.", d.samples_offered),
                ("distill_samples_dropped", "Samples dropped because the trainer's queue was full.", d.samples_dropped),
                ("distill_train_steps", "Optimizer steps the trainer took.", d.train_steps),
                ("distill_train_seconds", "Seconds the trainer computed (steps and evaluations).", d.train_seconds),
                ("distill_swaps", "Candidates that accepted more on held-back traffic and were swapped in.", d.swaps),
                ("distill_rejected", "Candidates that did not accept more (the serving weights stayed).", d.rejected),
                ("distill_nonfinite", "Training steps with a non-finite loss (candidate reset).", d.nonfinite),
                ("distill_failures", "Trainer processes that raised or died (serving untouched).", d.failures)):
            yield family(CounterMetricFamily, name, doc, value)
        share = d.train_seconds / d.trainer_seconds if d.trainer_seconds else 0.0
        for name, doc, value in (
                ("distill_compute_share", "Share of its wall time the trainer computed (capped by --distill-config's share).",
                 share),
                ("distill_buffer_tokens", "Tokens of recent traffic the trainer holds.", d.buffer_tokens),
                ("distill_loss", "The latest training step's loss.", d.last_loss),
                ("distill_serving_acceptance", "Held-back acceptance length of the serving weights, at the latest "
                 "evaluation.", d.serving_acceptance),
                ("distill_candidate_acceptance", "Held-back acceptance length of the latest candidate.",
                 d.candidate_acceptance),
                ("distill_version", "Candidates accepted so far (the serving head's version).", d.version)):
            yield family(GaugeMetricFamily, name, doc, value)
