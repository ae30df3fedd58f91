"""Prometheus metrics of a target worker, read from the engine and the handler at scrape time.

Registered on the process's registry, so the runtime's ``/metrics`` (``--health-port``) serves
them. Gauges: running / queued requests, KV blocks (total, free, cached). Counters: requests
finished by reason, prompt / cached prompt / generated tokens, preemptions, engine steps.

The same numbers under vLLM's names and labels (``model_name``, ``engine``), so vLLM's Grafana
dashboards and Dynamo's planner queries work unchanged: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0–1), ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, the histograms ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``, and the spec-decode
counters ``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_per_pos_total``
(label ``position``). vLLM's PromQL then reads, for acceptance rate and mean acceptance length::

    rate(vllm:spec_decode_num_accepted_tokens_total[5m]) / rate(vllm:spec_decode_num_draft_tokens_total[5m])
    1 + rate(vllm:spec_decode_num_accepted_tokens_total[5m]) / rate(vllm:spec_decode_num_drafts_total[5m])
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from runtime.histogram import REQUEST_LATENCY_BUCKETS, histogram, histogram_family, samples
from runtime.messages import TokenDelta
from runtime.spec_stats import SpecCounters
from workers.target.flags import gpu_memory_utilization_ignored

# vLLM's bucket bounds (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = REQUEST_LATENCY_BUCKETS
# our finish reasons as vLLM's request_success labels them (others keep their names)
VLLM_FINISH_REASONS = {"cancelled": "abort"}


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


@dataclass
class RequestStats:
    """Per-worker request counters, fed with every delta the handler streams."""

    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: Counter = field(default_factory=Counter)
    ttft: Histogram = field(default_factory=lambda: histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: histogram(E2E_BUCKETS))

    def observe_timing(self, started: float, last: float | None, delta: TokenDelta, now: float | None = None) -> float:
        """Latency histograms for one delta of a request started at ``started`` whose previous delta
        came at ``last`` (None: this is its first); returns now. A delta of n tokens (a verify step)
        counts n inter-token gaps of (gap / n) each, as vLLM counts the tokens of one iteration."""
        now = time.monotonic() if now is None else now
        n = len(delta.token_ids)
        if n:
            if last is None:
                self.ttft.observe(now - started)
                for _ in range(n - 1):
                    self.itl.observe(0.0)
            else:
                for _ in range(n):
                    self.itl.observe((now - last) / n)
        if delta.finish_reason:
            self.e2e.observe(now - started)
        return now

    def observe_delta(self, delta: TokenDelta) -> None:
        self.generated_tokens += len(delta.token_ids)
        if delta.finish_reason:
            self.finished[delta.finish_reason] += 1
            if delta.usage is not None:
                self.prompt_tokens += delta.usage.prompt_tokens
                self.cached_tokens += delta.usage.cached_tokens

    def observe_cancel(self) -> None:
        self.finished["cancelled"] += 1


def utilization_in_force(engine) -> str:
    """``--gpu-memory-utilization`` as a label: its value where it sized the KV cache, else empty (not
    given, or ignored: on a CPU or under ``--num-blocks``), so that a metric never reports it in force
    where it did nothing."""
    cfg = engine.config
    given = cfg.gpu_memory_utilization
    if given is None or gpu_memory_utilization_ignored(given, engine.runner.device.type, cfg.num_blocks):
        return ""
    return f"{given:g}"


class TargetCollector(Collector):
    """Reads ``worker`` (a :class:`workers.target.worker.TargetWorker`) at scrape time."""

    def __init__(self, worker, model: str, aliases: tuple[str, ...] = ()):
        self.worker = worker
        self.model = model
        self.names = (model, *aliases)

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
        yield counter("priority_preemptions", "Running requests preempted for a waiting one of higher priority "
                      "(--scheduling-policy priority).", engine.scheduler.num_priority_preemptions)
        yield counter("engine_steps", "Engine forward steps.", w.loop.steps)
        yield counter("busy_seconds", "Seconds the step loop spent on iterations with work (waiting for "
                      "proposals included).", w.loop.busy_seconds)
        yield counter("draft_wait_seconds", "Seconds the step loop waited for rounds of draft proposals "
                      "(the planner's draft:target rule reads its share of busy_seconds).", w.loop.drafting.wait_seconds)
        yield counter("draft_flush_seconds", "Seconds the step loop spent, before its steps, handing the previous "
                      "step's news to the draft stream (pipelined seam; part of busy_seconds, not of draft_wait).",
                      w.loop.drafting.flush_seconds)
        spec = engine.spec  # speculation budgets and the step-cost model behind load-aware ones
        fixed, per_token, per_seq, speculating = spec.cost.coefficients()
        yield gauge("spec_planned_draft_tokens", "Draft tokens asked for in the latest step.", spec.planned_draft_tokens)
        yield counter("spec_unplanned_steps", "Steps load-aware speculation chose to run without drafts.",
                      spec.unplanned_steps)
        yield counter("spec_evidence_steps", "Steps that verified drafts on a proposal's calibrated confidence, "
                      "above its request's acceptance so far (pipelined seam).", spec.evidence_steps)
        yield gauge("step_cost_fixed_seconds", "Fitted seconds per step (a in a + b*tokens + c*verified + d*[verified]).", fixed)
        yield gauge("step_cost_per_token_seconds", "Fitted seconds per query token (b).", per_token)
        yield gauge("step_cost_per_verify_seconds", "Fitted seconds per sequence verifying drafts (c).", per_seq)
        yield gauge("step_cost_speculating_seconds", "Fitted seconds a step pays for speculating at all (d).",
                    speculating)
        loop = w.loop
        yield counter("engine_step_failures", "Engine steps that raised (their requests failed or moved).",
                      loop.step_failures)
        yield counter("step_loop_errors", "Step-loop iterations that failed outside the engine step.", loop.loop_errors)
        yield gauge("engine_broken", "1 while engine steps keep failing (the worker reports unhealthy).",
                    1 if loop.broken else 0)
        plain = CounterMetricFamily("tandem_target_spec_plain_steps",
                                    "Decode steps of speculating requests that ran without a draft, by why "
                                    "(runtime.messages.PLAIN_STEP_REASONS).", labels=["model", "reason"])
        for reason, count in sorted(dict(spec.plain_steps).items()):
            plain.add_metric([self.model, reason], count)
        yield plain
        dropped = CounterMetricFamily("tandem_target_draft_proposals_dropped",
                                      "Draft proposals refused before verification, by reason.", labels=["model", "reason"])
        for reason, count in sorted(dict(spec.dropped).items()):
            dropped.add_metric([self.model, reason], count)
        yield dropped
        watch = loop.drafting.watch
        yield counter("draft_rounds_late", "Proposal rounds most of whose proposals missed the deadline.",
                      watch.late_rounds)
        yield counter("draft_backoffs", "Times the draft was put on a backoff (slow, silent or malformed; "
                      "pipelined: its proposals fit no step, coming late or reading hidden states).",
                      watch.backoffs_total)
        yield counter("draft_proposals_streamed", "Sound proposals streamed ahead and kept (pipelined seam).",
                      spec.staged_use.arrived)
        yield counter("draft_proposals_late", "Of those, the ones drafted from news two or more rounds old: "
                      "the draft took longer than a target step to answer (pipelined seam).", spec.staged_use.late)
        yield counter("draft_staged_lookups", "Sequence steps that had streamed proposals to look through "
                      "(pipelined seam).", spec.staged_use.looked)
        yield counter("draft_staged_fits", "Of those, the ones that found a proposal that fits (pipelined seam).",
                      spec.staged_use.found)
        yield gauge("draft_backed_off", "1 while the draft worker is backed off (decoding plainly).",
                    1 if watch.backed_off else 0)
        yield gauge("draft_deadline_seconds", "How long a round of proposals is waited for.", watch.deadline())
        if loop.pool is not None:
            yield from self._per_draft(loop, spec)
            refused = CounterMetricFamily("tandem_target_draft_refused",
                                          "Draft workers refused at the handshake, by what did not match.",
                                          labels=["model", "reason"])
            for reason, count in sorted(dict(loop.pool.refused).items()):
                refused.add_metric([self.model, reason], count)
            yield refused
            pool = loop.pool
            yield counter("draft_streams_fenced", "Streams dropped because a newer incarnation of their draft "
                          "worker appeared (restarted under the same worker id).", getattr(pool, "streams_fenced", 0))
            fenced = getattr(pool, "proposals_fenced", None)
            yield counter("draft_proposals_fenced", "Proposals from an older incarnation of their draft worker "
                          "that arrived once a newer one was known: dropped, never applied.",
                          fenced() if fenced is not None else 0)
            hidden = CounterMetricFamily("tandem_target_hidden_state_bytes",
                                         "Hidden-state bytes sent to draft workers, by plane (inline: in the "
                                         "messages; shm: the shared-memory ring; stream: chunked rows).",
                                         labels=["model", "plane"])
            for plane, count in sorted(loop.pool.hidden_bytes().items()):
                hidden.add_metric([self.model, plane], count)
            yield hidden
        yield from self._disagg(w, engine, gauge, counter)
        cfg = engine.config
        info = GaugeMetricFamily("tandem_target_engine_config", "The engine's settings (labels; value 1): "
                                 "--max-model-len as served, --dtype, --max-num-seqs, --gpu-memory-utilization "
                                 "(empty unless it sized the KV cache), the KV cache's bytes, and the names the "
                                 "model is served as.",
                                 labels=["model", "max_model_len", "dtype", "max_num_seqs", "gpu_memory_utilization",
                                         "kv_cache_bytes", "served_model_names"])
        util = utilization_in_force(engine)
        info.add_metric([self.model, str(engine.max_model_len), dtype_name(engine.runner.dtype), str(cfg.max_num_seqs),
                         util, str(engine.kv_cache_bytes), " ".join(self.names)], 1)
        yield info
        if engine.tiers is not None:
            yield from self._tiers(engine.tiers)
        finished = CounterMetricFamily("tandem_target_requests_finished", "Requests ended, by finish reason.",
                                       labels=["model", "reason"])
        for reason, count in sorted(w.stats.finished.items()):
            finished.add_metric([self.model, reason], count)
        yield finished
        next_turn = CounterMetricFamily(
            "tandem_target_next_turn_prefills", "Next-turn prefills (nvext.agent_hints.speculative_prefill) by outcome: "
            "started (computing began), and how each ended: prefilled, or dropped as busy (a real request was open), "
            "memory (too few free blocks), yielded (a real request arrived), invalid or failed.",
            labels=["model", "outcome"])
        for outcome, count in w.next_turn.outcomes.items():
            next_turn.add_metric([self.model, outcome], count)
        yield next_turn
        yield counter("next_turn_prefill_tokens", "Context tokens computed by next-turn prefills.", w.next_turn.tokens)
        yield from self._vllm(w, engine)

    def _disagg(self, w, engine, gauge, counter):
        """Prefill/decode disaggregation (``--role prefill|decode``): handoffs, pulls, failures."""
        d = w.disagg
        yield counter("kv_handoffs", "Prompts this prefill worker computed and handed to a decode worker.", d.handoffs)
        yield counter("kv_handoffs_released", "Handoffs their decode worker released.", d.released)
        yield counter("kv_handoffs_expired", "Handoffs freed unpulled when their ttl ran out.", engine.handoffs.expired)
        yield gauge("kv_parked_blocks", "KV blocks held for decode workers to pull.", engine.handoffs.num_blocks)
        yield counter("kv_remote_prefills", "Requests whose prompt KV was pulled from a prefill worker.",
                      d.remote_prefills)
        yield counter("kv_transfer_bytes", "Bytes of KV and hidden rows pulled from prefill workers.", d.transfer_bytes)
        yield counter("kv_reused_blocks", "Handed-off blocks found in this worker's prefix cache (not pulled).",
                      d.reused_blocks)
        yield gauge("kv_quarantined_blocks", "Blocks taken out of use after a pull that could not be cancelled.",
                    engine.quarantined_blocks)
        for name, doc, by, label in (
                ("kv_local_prefills", "Requests sent with a KV handoff that prefilled here instead, by why.",
                 d.local_prefills, "reason"),
                ("kv_transfer_failures", "KV pulls that failed, by kind (error, timeout).", d.failures, "kind")):
            c = CounterMetricFamily(f"tandem_target_{name}", doc, labels=["model", label])
            for key, count in sorted(by.items()):
                c.add_metric([self.model, key], count)
            yield c
        yield histogram_family("tandem_target_kv_transfer_seconds", "Seconds per KV pull.", d.transfer_seconds,
                               ["model"], [self.model])

    def _per_draft(self, loop, spec):
        """Per draft worker this target streams to: sequences placed on it, its proposals verified and
        their accepted tokens, its streamed proposals that came late (:mod:`workers.target.placement`)."""
        drafting = loop.drafting
        streams = GaugeMetricFamily("tandem_target_draft_streams", "Draft workers this target streams to now.",
                                    labels=["model"])
        streams.add_metric([self.model], drafting.streams)
        yield streams
        method = drafting.methods.get
        held = GaugeMetricFamily("tandem_target_draft_sequences", "Speculating sequences placed on each draft worker.",
                                 labels=["model", "draft", "method"])
        for draft, n in sorted(drafting.sequences_by_draft().items()):
            held.add_metric([self.model, draft, method(draft, "")], n)
        yield held
        families = {name: CounterMetricFamily(f"tandem_target_draft_{name}", doc, labels=["model", "draft", "method"])
                    for name, doc in (("verified_proposals", "Proposals of each draft worker verified."),
                                      ("accepted_tokens", "Draft tokens of each draft worker accepted."),
                                      ("late_proposals", "Streamed proposals of each draft worker drafted from news "
                                                         "two or more rounds old (pipelined seam)."))}
        for draft, counters in sorted(dict(self.worker.engine.counters).items()):
            if draft:
                families["verified_proposals"].add_metric([self.model, draft, method(draft, "")], counters.num_drafts)
                families["accepted_tokens"].add_metric([self.model, draft, method(draft, "")],
                                                       counters.num_accepted_tokens)
        for draft, use in sorted(dict(spec.staged_by).items()):
            if draft:
                families["late_proposals"].add_metric([self.model, draft, method(draft, "")], use.late)
        yield from families.values()
        moved = CounterMetricFamily("tandem_target_draft_sequences_moved", "Sequences moved to another draft worker "
                                    "because theirs went away or backed off.", labels=["model"])
        moved.add_metric([self.model], drafting.placement.moved)
        yield moved

    def _tiers(self, tiers):
        """KV tiers below the device pool (``--kv-offload-*``): ``tandem_target_kv_tier_*{tier=host|disk}``."""
        labels = ["model", "tier"]
        disk = tiers.disk
        used = {"host": len(tiers.host) * tiers.copier.block_bytes, "disk": disk.used_bytes if disk else 0}
        capacity = {"host": tiers.host_bytes, "disk": disk.capacity_bytes if disk else 0}
        evicted = {"host": tiers.stats["host"].evicted, "disk": disk.counters.evicted if disk else 0}
        present = ["host"] + (["disk"] if disk is not None else [])
        for name, kind, doc, value in (
                ("hits", CounterMetricFamily, "Blocks loaded back from this tier (prefix hits below the device).",
                 lambda t: tiers.stats[t].hits),
                ("loaded_bytes", CounterMetricFamily, "Bytes loaded back from this tier.",
                 lambda t: tiers.stats[t].loaded_bytes),
                ("stored_blocks", CounterMetricFamily, "Blocks stored into this tier.", lambda t: tiers.stats[t].stored),
                ("stored_bytes", CounterMetricFamily, "Bytes stored into this tier.",
                 lambda t: tiers.stats[t].stored_bytes),
                ("evicted_blocks", CounterMetricFamily, "Blocks evicted from this tier (LRU, to stay within its size).",
                 lambda t: evicted[t]),
                ("used_bytes", GaugeMetricFamily, "Bytes this tier holds.", lambda t: used[t]),
                ("capacity_bytes", GaugeMetricFamily, "This tier's size.", lambda t: capacity[t]),
                ("disabled", GaugeMetricFamily, "1 when the tier turned itself off (a full disk).",
                 lambda t: float(t == "disk" and disk is not None and disk.disabled))):
            m = kind(f"tandem_target_kv_tier_{name}", doc, labels=labels)
            for t in present:
                m.add_metric([self.model, t], value(t))
            yield m
        h = HistogramMetricFamily("tandem_target_kv_tier_load_seconds",
                                  "Seconds per load from this tier (host: a copy into the device pool at admission; "
                                  "disk: reading a prompt's chain of block files).", labels=labels)
        for t in present:
            h.add_metric([self.model, t], *samples(tiers.stats[t].load_seconds))
        yield h
        if disk is not None:
            c = CounterMetricFamily("tandem_target_kv_tier_bad_blocks",
                                    "Disk-tier block files that failed a check (recomputed), by reason.",
                                    labels=["model", "reason"])
            for reason, count in sorted(dict(disk.counters.bad).items()):
                c.add_metric([self.model, reason], count)
            yield c
            yield self._plain_counter("kv_tier_dropped_writes",
                                      "Disk-tier writes dropped (writer queue full, or the tier off).",
                                      disk.counters.dropped)

    def _plain_counter(self, name: str, doc: str, value: float):
        c = CounterMetricFamily(f"tandem_target_{name}", doc, labels=["model"])
        c.add_metric([self.model], value)
        return c

    def _vllm(self, w, engine):
        """vLLM's names and labels (model_name, engine)."""
        labels, values = ["model_name", "engine"], [self.model, "0"]

        def family(kind, name: str, doc: str, value: float | None = None):
            m = kind(f"vllm:{name}", doc, labels=labels)
            if value is not None:
                m.add_metric(values, value)
            return m

        total = engine.blocks.num_blocks
        yield family(GaugeMetricFamily, "num_requests_running", "Requests running on the engine.", engine.num_running)
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to run.", engine.num_waiting)
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage (1 = full).",
                     (total - engine.blocks.num_free_blocks) / total if total else 0.0)
        yield family(CounterMetricFamily, "prompt_tokens", "Prompt tokens processed.", w.stats.prompt_tokens)
        yield family(CounterMetricFamily, "generation_tokens", "Generation tokens produced.", w.stats.generated_tokens)
        for name, doc, hist in (("time_to_first_token_seconds", "Time to first token.", w.stats.ttft),
                                ("inter_token_latency_seconds", "Time between output tokens.", w.stats.itl),
                                ("e2e_request_latency_seconds", "Request latency end to end.", w.stats.e2e)):
            yield histogram_family(f"vllm:{name}", doc, hist, labels, values)
        success = CounterMetricFamily("vllm:request_success", "Requests finished, by reason (vLLM's: stop, length, "
                                      "abort; a request its client cancelled or left is abort).",
                                      labels=[*labels, "finished_reason"])
        by_reason = Counter()
        for reason, count in w.stats.finished.items():
            by_reason[VLLM_FINISH_REASONS.get(reason, reason)] += count
        for reason, count in sorted(by_reason.items()):
            success.add_metric([*values, reason], count)
        yield success
        sched = engine.scheduler
        yield family(CounterMetricFamily, "num_preemptions", "Preemptions (recomputed requests).", sched.num_preemptions)
        yield family(CounterMetricFamily, "prefix_cache_queries", "Prefix-cache queries, in tokens (each admitted "
                     "request's tokens).", sched.prefix_queries)
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prefix-cache hits, in tokens.", sched.prefix_hits)
        for name, doc, hist in (("request_queue_time_seconds", "Time a request waited to be first scheduled.",
                                 sched.queue_time),
                                ("request_prefill_time_seconds", "Time from a request's first scheduling to its "
                                 "first token.", engine.prefill_time)):
            yield histogram_family(f"vllm:{name}", doc, hist, labels, values)
        cfg = engine.config
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration (labels; value 1).",
                                 labels=["block_size", "num_gpu_blocks", "gpu_memory_utilization", "cache_dtype"])
        util = utilization_in_force(engine)
        info.add_metric([str(cfg.block_size), str(engine.blocks.num_blocks), util, dtype_name(engine.runner.dtype)], 1)
        yield info
        spec = SpecCounters()
        for counters in list(engine.counters.values()):
            spec = spec.add(counters)
        yield family(CounterMetricFamily, "spec_decode_num_drafts", "Verify steps that had a draft.", spec.num_drafts)
        yield family(CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens)
        yield family(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                     spec.num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts whose token at this position was accepted.",
                                      labels=[*labels, "position"])
        for pos, count in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([*values, str(pos)], count)
        yield per_pos
