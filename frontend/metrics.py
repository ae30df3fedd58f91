"""Prometheus metrics of the frontend, in a registry of its own (several apps can share a process).

Acceptance in PromQL, over the last five minutes (definitions in :mod:`runtime.spec_stats`)::

    rate(tandem_frontend_spec_decode_num_accepted_tokens_total[5m])
      / rate(tandem_frontend_spec_decode_num_draft_tokens_total[5m])             # acceptance rate
    1 + rate(tandem_frontend_spec_decode_num_accepted_tokens_total[5m])
      / rate(tandem_frontend_spec_decode_num_drafts_total[5m])                   # mean accepted length

Dynamo's dashboards read ``dynamo_frontend_*``: the families Dynamo's frontend exports are exported
under its names too, from the same observations (:class:`Aliases`), except the request counter,
whose labels are Dynamo's own (``endpoint`` chat_completions/completions/responses,
``request_type`` unary/stream, ``status`` success/error).
"""

from __future__ import annotations

import re
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest

from runtime.messages import SpecUsage
from runtime.spec_stats import acceptance_rate

P = "tandem_frontend_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)


SEQ_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

DYNAMO = "dynamo_frontend_"
DYNAMO_ENDPOINTS = {"chat": "chat_completions", "completions": "completions", "responses": "responses"}
MAX_IGNORED_FIELD_LABELS = 64  # distinct field names counted by name; any further ones as "other"
_FIELD_LABEL = re.compile(r"^[A-Za-z0-9_.]{1,64}$")


class Aliases:
    """A collector that exports other metrics again under other names: the same samples, so one
    observation serves both (``tandem_frontend_x`` and ``dynamo_frontend_x`` never disagree)."""

    def __init__(self, names: dict[object, str]):
        self.names = names  # metric -> its other name (a counter's without ``_total``)

    def collect(self):
        for metric, name in self.names.items():
            for family in metric.collect():
                out = Metric(name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    out.add_sample(name + s.name[len(family.name):], s.labels, s.value, s.timestamp, s.exemplar)
                yield out


class FrontendMetrics:
    """All frontend metrics; ``observe_*`` methods take plain values."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(P + "requests", "HTTP requests by model, endpoint and status", ("model", "endpoint", "status"), registry=r)
        self.in_flight = Gauge(P + "inflight_requests", "requests being served", ("model",), registry=r)
        self.queued = Gauge(P + "queued_requests", "requests being served whose first token has not come yet "
                            "(tokenized, routed, waiting or prefilling on a worker)", ("model",), registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "time from request arrival to the first token",
                              ("model",), buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "time between tokens of one choice",
                             ("model",), buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram(P + "request_duration_seconds", "time from request arrival to its last byte",
                                  ("model",), buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens", ("model",), registry=r)
        self.completion_tokens = Counter(P + "completion_tokens", "completion tokens", ("model",), registry=r)
        self.cached_tokens = Counter(P + "cached_prompt_tokens", "prompt tokens found in a worker's prefix cache", ("model",), registry=r)
        self.spec_drafts = Counter(P + "spec_decode_num_drafts", "speculative drafts", ("model",), registry=r)
        self.spec_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "draft tokens proposed", ("model",), registry=r)
        self.spec_accepted = Counter(P + "spec_decode_num_accepted_tokens", "draft tokens accepted", ("model",), registry=r)
        self.spec_acceptance = Histogram(P + "spec_decode_request_acceptance_rate", "acceptance rate of each speculated request",
                                         ("model",), buckets=tuple(i / 10 for i in range(1, 11)), registry=r)
        self.isl = Histogram(P + "input_sequence_tokens", "prompt length of each request (tokens)", ("model",),
                             buckets=SEQ_BUCKETS, registry=r)
        self.osl = Histogram(P + "output_sequence_tokens", "completion length of each request (tokens, all choices)",
                             ("model",), buckets=SEQ_BUCKETS, registry=r)
        self.migrations = Counter(P + "migrations", "requests moved to another worker after theirs failed", registry=r)
        self.prefills = Counter(P + "prefills", "where prompts were prefilled when prefill workers serve the model "
                                "(where: remote or local; reason: ok, short, busy, not_decode, no_prefill, "
                                "prefill_failed)", ("where", "reason"), registry=r)
        self.next_turn_prefills = Counter(P + "next_turn_prefills", "next-turn prefills (nvext.agent_hints."
                                          "speculative_prefill) by outcome: started (sent to the worker that served "
                                          "the turn), prefilled, dropped (not sent, or dropped by the worker)",
                                          ("outcome",), registry=r)
        for outcome in ("started", "prefilled", "dropped"):
            self.next_turn_prefills.labels(outcome)
        self.streams_dropped = Counter(P + "streams_dropped", "streams dropped because their client stopped reading, "
                                       "by reason (write_timeout, buffer: too much output waiting)", ("reason",), registry=r)
        self.ignored_fields = Counter(P + "ignored_fields", "request fields accepted and ignored because this server "
                                      "does not know them (messages[i].x counted as messages.x; more than "
                                      f"{MAX_IGNORED_FIELD_LABELS} names: the rest as other)", ("field",), registry=r)
        self.dynamo_requests = Counter(DYNAMO + "requests", "requests by model, endpoint, request_type (unary, stream) "
                                       "and status (success, error), as Dynamo's frontend counts them",
                                       ("model", "endpoint", "request_type", "status"), registry=r)
        r.register(Aliases({self.in_flight: DYNAMO + "inflight_requests", self.queued: DYNAMO + "queued_requests",
                            self.ttft: DYNAMO + "time_to_first_token_seconds",
                            self.itl: DYNAMO + "inter_token_latency_seconds",
                            self.duration: DYNAMO + "request_duration_seconds",
                            self.isl: DYNAMO + "input_sequence_tokens", self.osl: DYNAMO + "output_sequence_tokens",
                            self.completion_tokens: DYNAMO + "output_tokens"}))
        self._series: dict[str, ModelSeries] = {}
        self._requests: dict[tuple[str, str, int, bool], tuple[object, object]] = {}
        self._field_labels: set[str] = set()

    def series(self, model: str) -> ModelSeries:
        """The label-bound series of one model (built once: ``labels()`` is not free)."""
        found = self._series.get(model)
        if found is None:
            found = self._series[model] = ModelSeries(self, model)
        return found

    def observe_request(self, model: str, endpoint: str, status: int, stream: bool = False) -> None:
        key = (model, endpoint, status, stream)
        children = self._requests.get(key)
        if children is None:
            children = self._requests[key] = (
                self.requests.labels(model, endpoint, str(status)),
                self.dynamo_requests.labels(model, DYNAMO_ENDPOINTS.get(endpoint, endpoint),
                                            "stream" if stream else "unary", "success" if status == 200 else "error"))
        for child in children:
            child.inc()

    def observe_ignored(self, fields: list[str]) -> None:
        """Count fields that were accepted and ignored (``messages[3].refusal`` as ``messages.refusal``)."""
        for field in fields:
            label = re.sub(r"\[\d+\]", "", field)
            if label not in self._field_labels:
                if len(self._field_labels) >= MAX_IGNORED_FIELD_LABELS or not _FIELD_LABEL.match(label):
                    label = "other"
                else:
                    self._field_labels.add(label)
            self.ignored_fields.labels(label).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelSeries:
    """One model's children of every per-model metric."""

    def __init__(self, m: FrontendMetrics, model: str):
        self.in_flight = m.in_flight.labels(model)
        self.queued = m.queued.labels(model)
        self.ttft = m.ttft.labels(model)
        self.itl = m.itl.labels(model)
        self.duration = m.duration.labels(model)
        self.prompt_tokens = m.prompt_tokens.labels(model)
        self.completion_tokens = m.completion_tokens.labels(model)
        self.cached_tokens = m.cached_tokens.labels(model)
        self.spec_drafts = m.spec_drafts.labels(model)
        self.spec_draft_tokens = m.spec_draft_tokens.labels(model)
        self.spec_accepted = m.spec_accepted.labels(model)
        self.spec_acceptance = m.spec_acceptance.labels(model)
        self.isl = m.isl.labels(model)
        self.osl = m.osl.labels(model)

    def observe_tokens(self, prompt: int, completion: int, cached: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)
        self.cached_tokens.inc(cached)
        self.isl.observe(prompt)
        self.osl.observe(completion)

    def observe_spec(self, spec: SpecUsage) -> None:
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted.inc(spec.num_accepted_tokens)
        rate = acceptance_rate(spec.num_accepted_tokens, spec.num_draft_tokens)
        if rate is not None:  # a request with no drafts has no acceptance rate (not 0)
            self.spec_acceptance.observe(rate)


class RequestTimer:
    """Time to first token, inter-token latency (per choice) and duration of one request; the
    request counts as queued from here until its first token (or its end)."""

    __slots__ = ("_s", "start", "first", "_last", "_queued")

    def __init__(self, series: ModelSeries, start: float):
        self._s = series
        self.start = start
        self.first: float | None = None
        self._last: dict[int, float] = {}
        self._queued = True
        series.queued.inc()

    def unqueue(self) -> None:
        """No longer queued (its first token came, or it ended without one); once only."""
        if self._queued:
            self._queued = False
            self._s.queued.dec()

    def tokens(self, count: int, choice: int = 0) -> None:
        """``count`` tokens of choice ``choice`` arrived now."""
        if not count:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self._s.ttft.observe(now - self.start)
            self.unqueue()
        last = self._last.get(choice)
        if last is not None:
            gap = (now - last) / count
            observe = self._s.itl.observe
            for _ in range(count):
                observe(gap)
        self._last[choice] = now

    def done(self) -> None:
        self.unqueue()
        self._s.duration.observe(time.perf_counter() - self.start)
