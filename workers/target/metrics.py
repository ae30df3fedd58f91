"""Prometheus metrics of a target worker, read from the engine and the handler at scrape time.

Registered on the process's registry, so the runtime's ``/metrics`` (``--health-port``) serves
them. Gauges: running / queued requests, KV blocks (total, free, cached). Counters: requests
finished by reason, prompt / cached prompt / generated tokens, preemptions, engine steps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.messages import TokenDelta


@dataclass
class RequestStats:
    """Per-worker request counters, fed with every delta the handler streams."""

    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: Counter = field(default_factory=Counter)

    def observe_delta(self, delta: TokenDelta) -> None:
        self.generated_tokens += len(delta.token_ids)
        if delta.finish_reason:
            self.finished[delta.finish_reason] += 1
            if delta.usage is not None:
                self.prompt_tokens += delta.usage.prompt_tokens
                self.cached_tokens += delta.usage.cached_tokens

    def observe_cancel(self) -> None:
        self.finished["cancelled"] += 1


class TargetCollector(Collector):
    """Reads ``worker`` (a :class:`workers.target.worker.TargetWorker`) at scrape time."""

    def __init__(self, worker, model: str):
        self.worker = worker
        self.model = model

    def collect(self):
        w, engine = self.worker, self.worker.engine
        labels = ["model"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"tandem_target_{name}", doc, labels=labels)
            g.add_metric([self.model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"tandem_target_{name}", doc, labels=labels)
            c.add_metric([self.model], value)
            return c

        yield gauge("running_requests", "Requests with blocks in the KV cache.", engine.num_running)
        yield gauge("queued_requests", "Requests waiting for blocks or a batch slot.", engine.num_waiting)
        yield gauge("kv_blocks_total", "KV cache blocks.", engine.blocks.num_blocks)
        yield gauge("kv_blocks_free", "KV cache blocks held by no request.", engine.blocks.num_free_blocks)
        yield gauge("kv_blocks_cached", "KV cache blocks known to the prefix cache.", engine.blocks.num_cached_blocks)
        yield counter("generated_tokens", "Tokens streamed to clients.", w.stats.generated_tokens)
        yield counter("prompt_tokens", "Prompt tokens of finished requests.", w.stats.prompt_tokens)
        yield counter("cached_prompt_tokens", "Prompt tokens served from the prefix cache.", w.stats.cached_tokens)
        yield counter("preemptions", "Requests preempted (recomputed) for lack of blocks.",
                      engine.scheduler.num_preemptions)
        yield counter("engine_steps", "Engine forward steps.", w.loop.steps)
        finished = CounterMetricFamily("tandem_target_requests_finished", "Requests ended, by finish reason.",
                                       labels=["model", "reason"])
        for reason, count in sorted(w.stats.finished.items()):
            finished.add_metric([self.model, reason], count)
        yield finished
