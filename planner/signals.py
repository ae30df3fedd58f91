"""What the planner observes each tick, from what Tandem already publishes.

- **Discovery (etcd):** the live instances of each pool: components ``prefill``, ``target`` (decode or
  aggregated) and ``draft``.
- **Load events (NATS ``{ns}.load``):** each worker's running and queued requests; a pool's load is
  their sum over its live workers divided by their number (requests in flight per worker).
- **Spec-decode statistics (NATS ``{ns}.spec_stats``):** aggregated per (target, draft) pair by the
  router's own :class:`router.spec_stats.SpecDecodeStats`; the planner reads the window's mean
  accepted length over all pairs.
- **Frontends' /metrics:** the TTFT and ITL histograms (``tandem_frontend_time_to_first_token_seconds``,
  ``tandem_frontend_inter_token_latency_seconds``), summed over frontends and models; p90 over the
  last ``window`` seconds (:mod:`planner.estimate`). These are the latencies clients see.
- **Workers' /metrics** (the ``http_address`` their instance records carry), their growth over the
  window (:func:`draft_work`):

  - a target's ``tandem_target_draft_wait_seconds_total`` (time its step loop waited for proposals)
    against ``tandem_target_busy_seconds_total`` (time in steps with work, waiting included): the
    targets' wait share; ``busy_seconds`` per ``tandem_target_engine_steps_total``: seconds per step;
  - late proposals: pipelined seam, ``tandem_target_draft_proposals_late_total`` of
    ``tandem_target_draft_proposals_streamed_total`` (drafted from news two or more rounds old);
    synchronous seam, ``tandem_target_spec_plain_steps_total{reason="draft_late"}`` (a round's proposal
    missed its deadline) of those plus ``vllm:spec_decode_num_drafts_total`` (steps that verified one);
  - a draft's ``tandem_draft_proposal_seconds`` histogram (``_sum``: time spent computing proposals,
    ``_count``: propose calls) and ``tandem_draft_batch_size`` (sequences per call: the batcher takes
    everything queued at once, so its mean is what queued for each call): the drafts' busy share,
    drafting time per call and queueing.

A source that cannot be reached this tick is left out and named in ``Observation.errors``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from router.spec_stats import SpecDecodeStats, follow_spec_stats
from runtime.events import TOPIC_LOAD
from runtime.messages import InstanceRecord, LoadEvent

from .config import POOLS
from .estimate import Window, quantile
from .policy import DraftSignals

log = logging.getLogger(__name__)

FRONTEND_TTFT = "tandem_frontend_time_to_first_token_seconds"
FRONTEND_ITL = "tandem_frontend_inter_token_latency_seconds"
TARGET_WAIT = "tandem_target_draft_wait_seconds"
TARGET_BUSY = "tandem_target_busy_seconds"
TARGET_STEPS = "tandem_target_engine_steps"
TARGET_STREAMED = "tandem_target_draft_proposals_streamed"
TARGET_LATE = "tandem_target_draft_proposals_late"
TARGET_PLAIN = "tandem_target_spec_plain_steps"
TARGET_DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_PROPOSING = "tandem_draft_proposal_seconds"
DRAFT_BATCH = "tandem_draft_batch_size"
LOAD_STALE_S = 10.0  # a load event older than this says nothing about now


def parse_metrics(text: str) -> dict[str, list]:
    """Prometheus text exposition -> family name -> its samples."""
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def histogram(samples: list) -> tuple[list[float], list[float]] | None:
    """(finite upper bounds, cumulative counts incl. +Inf) of a histogram family, summed over label sets."""
    by_le: dict[float, float] = {}
    for s in samples:
        if s.name.endswith("_bucket") and "le" in s.labels:
            le = float(s.labels["le"])
            by_le[le] = by_le.get(le, 0.0) + s.value
    if not by_le:
        return None
    les = sorted(by_le)
    return [le for le in les if le != float("inf")], [by_le[le] for le in les]


def total(samples: list, suffix: str, **labels: str) -> float | None:
    """The sum of a family's samples whose name ends with ``suffix`` (``_total``, ``_sum``) and whose
    labels include ``labels``."""
    values = [s.value for s in samples if s.name.endswith(suffix)
              and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def target_counters(families: dict[str, list]) -> tuple[float, ...] | None:
    """A target's cumulative (wait, busy, steps, streamed, late, late plain steps, drafts verified)
    seconds and counts; None when it does not export the wait and busy seconds (a mock, an older
    version). A counter it lacks besides those (no pipelined seam yet, no speculation) reads 0."""
    wait, busy = total(families.get(TARGET_WAIT, []), "_total"), total(families.get(TARGET_BUSY, []), "_total")
    if wait is None or busy is None:
        return None
    rest = (total(families.get(TARGET_STEPS, []), "_total"), total(families.get(TARGET_STREAMED, []), "_total"),
            total(families.get(TARGET_LATE, []), "_total"),
            total(families.get(TARGET_PLAIN, []), "_total", reason="draft_late"),
            total(families.get(TARGET_DRAFTS, []), "_total"))
    return (wait, busy, *(v or 0.0 for v in rest))


def draft_counters(families: dict[str, list]) -> tuple[float, ...] | None:
    """A draft's cumulative (proposal seconds, propose calls, sequences proposed for in those calls,
    calls counted by the batch histogram); None when it does not export proposal seconds."""
    seconds = families.get(DRAFT_PROPOSING, [])
    spent, calls = total(seconds, "_sum"), total(seconds, "_count")
    if spent is None:
        return None
    batch = families.get(DRAFT_BATCH, [])
    return spent, calls or 0.0, total(batch, "_sum") or 0.0, total(batch, "_count") or 0.0


@dataclass(frozen=True)
class DraftWork:
    """The draft signals the workers' counters give over a window (None: not measured)."""

    wait_share: float | None = None
    busy: float | None = None
    late_share: float | None = None
    call_seconds: float | None = None
    step_seconds: float | None = None
    batch: float | None = None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def draft_work(targets: list[tuple[float, ...]], drafts: list[tuple[float, tuple[float, ...]]]) -> DraftWork:
    """The window's draft signals from each target's growth of :func:`target_counters` and each
    draft's (seconds covered, growth of :func:`draft_counters`). Sums before ratios, so a busy worker
    weighs more than an idle one; the busy share alone is a mean over drafts (each is a share of its
    own wall time). A target whose streamed proposals grew is on the pipelined seam and counts its
    late streamed proposals; one whose did not counts the rounds that missed their deadline."""
    wait = busy = steps = late = seen = 0.0
    for t_wait, t_busy, t_steps, streamed, late_streamed, plain_late, verified in targets:
        wait, busy, steps = wait + t_wait, busy + t_busy, steps + t_steps
        if streamed > 0:
            late, seen = late + late_streamed, seen + streamed
        else:
            late, seen = late + plain_late, seen + plain_late + verified
    spent = calls = batched = batch_calls = 0.0
    shares = []
    for seconds, (d_spent, d_calls, d_batched, d_batch_calls) in drafts:
        if seconds > 0:
            shares.append(min(1.0, d_spent / seconds))
        spent, calls, batched, batch_calls = spent + d_spent, calls + d_calls, batched + d_batched, batch_calls + d_batch_calls
    return DraftWork(_ratio(wait, busy), sum(shares) / len(shares) if shares else None, _ratio(late, seen),
                     _ratio(spent, calls), _ratio(busy, steps), _ratio(batched, batch_calls))


async def fetch(url: str, timeout: float = 2.0) -> str:
    """GET ``url`` (in a thread); ``OSError`` when it cannot be read."""

    def get() -> str:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode("utf-8", errors="replace")

    return await asyncio.to_thread(get)


@dataclass(frozen=True)
class LatencyStat:
    p90: float | None  # seconds; None: no observation in the window
    samples: int = 0


@dataclass
class PoolObservation:
    live: list[InstanceRecord] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)  # instance id -> running + queued

    @property
    def load(self) -> float:
        """Requests in flight per live worker."""
        return sum(self.in_flight.values()) / len(self.live) if self.live else 0.0

    def least_loaded(self) -> list[InstanceRecord]:
        """Live workers, the ones with least in flight first (the newest first among equals)."""
        return sorted(self.live, key=lambda r: (self.in_flight.get(r.instance_id, 0), -r.started_at))


@dataclass
class Observation:
    pools: dict[str, PoolObservation]
    ttft: LatencyStat
    itl: LatencyStat
    draft: DraftSignals
    errors: list[str] = field(default_factory=list)


class Signals:
    """Follows discovery, load and spec-stats events, and scrapes /metrics when asked to observe."""

    def __init__(self, rt, frontends: tuple[str, ...], window: float, clock: Callable[[], float] = time.monotonic,
                 scrape_timeout: float = 2.0):
        self._rt = rt
        self.frontends = tuple(u.rstrip("/") for u in frontends)
        self.window = window
        self._clock = clock
        self._timeout = scrape_timeout
        self._instances = None
        self.loads: dict[str, tuple[float, LoadEvent]] = {}  # worker id -> (when received, latest event)
        self.spec = SpecDecodeStats(window)
        self._latency: dict[tuple[str, str], Window] = {}  # (frontend, metric) -> cumulative buckets
        self._workers: dict[str, Window] = {}  # instance id -> cumulative counters

    async def start(self) -> None:
        self._instances = await self._rt.instances()
        await self._rt.subscribe(TOPIC_LOAD, LoadEvent, self._on_load)
        await follow_spec_stats(self._rt, self.spec)

    def _on_load(self, event: LoadEvent) -> None:
        self.loads[event.worker_id] = (self._clock(), event)

    def live(self) -> dict[str, list[InstanceRecord]]:
        """Live instances per pool (one per process: a worker may register several endpoints)."""
        out: dict[str, dict[str, InstanceRecord]] = {pool: {} for pool in POOLS}
        for record in self._instances.values() if self._instances is not None else ():
            if record.component in out:
                out[record.component].setdefault(record.instance_id, record)
        return {pool: sorted(found.values(), key=lambda r: r.instance_id) for pool, found in out.items()}

    async def observe(self) -> Observation:
        now = self._clock()
        live = self.live()
        pools = {}
        for pool, records in live.items():
            obs = pools[pool] = PoolObservation(records)
            for r in records:
                got = self.loads.get(r.instance_id)
                fresh = got is not None and now - got[0] <= LOAD_STALE_S
                obs.in_flight[r.instance_id] = got[1].running + got[1].queued if fresh else 0
        errors: list[str] = []
        ttft, itl = await self._latencies(now, errors)
        work = await self._draft_work(now, live, errors)
        window = self.spec.total_window()
        draft = DraftSignals(len(live["target"]), work.wait_share, work.busy, window.mean_accepted_length,
                             work.late_share, work.call_seconds, work.step_seconds, work.batch)
        self._forget(live)
        return Observation(pools, ttft, itl, draft, errors)

    async def _latencies(self, now: float, errors: list[str]) -> tuple[LatencyStat, LatencyStat]:
        texts = await asyncio.gather(*(fetch(f"{u}/metrics", self._timeout) for u in self.frontends),
                                     return_exceptions=True)
        deltas: dict[str, tuple[list[float], list[float]]] = {}
        for url, text in zip(self.frontends, texts):
            if isinstance(text, BaseException):
                errors.append(f"frontend {url}: {text!r}")
                continue
            families = parse_metrics(text)
            for metric in (FRONTEND_TTFT, FRONTEND_ITL):
                hist = histogram(families.get(metric, []))
                if hist is None:
                    continue
                bounds, cumulative = hist
                window = self._latency.setdefault((url, metric), Window(self.window))
                window.add(now, cumulative)
                grown = window.delta()
                if grown is None:
                    continue
                per_bucket = [c - (grown[1][i - 1] if i else 0.0) for i, c in enumerate(grown[1])]
                old = deltas.get(metric)
                if old is None or old[0] != bounds:
                    deltas[metric] = (bounds, per_bucket)
                else:
                    deltas[metric] = (bounds, [a + b for a, b in zip(old[1], per_bucket)])
        out = []
        for metric in (FRONTEND_TTFT, FRONTEND_ITL):
            if metric not in deltas:
                out.append(LatencyStat(None, 0))
                continue
            bounds, counts = deltas[metric]
            out.append(LatencyStat(quantile(0.9, bounds, counts), int(round(sum(counts)))))
        return out[0], out[1]

    async def _draft_work(self, now: float, live: dict[str, list[InstanceRecord]], errors: list[str]) -> DraftWork:
        """The draft signals over the window (:func:`draft_work`), from the workers' /metrics."""
        workers = [r for r in (*live["target"], *live["draft"]) if r.http_address]
        texts = await asyncio.gather(*(fetch(f"http://{r.http_address}/metrics", self._timeout) for r in workers),
                                     return_exceptions=True)
        targets: list[tuple[float, ...]] = []
        drafts: list[tuple[float, tuple[float, ...]]] = []
        for record, text in zip(workers, texts):
            if isinstance(text, BaseException):
                errors.append(f"{record.component} {record.instance_id}: {text!r}")
                continue
            families = parse_metrics(text)
            values = target_counters(families) if record.component == "target" else draft_counters(families)
            if values is None:
                continue  # a worker that does not export these (a mock, an older version)
            window = self._workers.setdefault(record.instance_id, Window(self.window))
            window.add(now, values)
            grown = window.delta()
            if grown is None or grown[0] <= 0:
                continue
            if record.component == "target":
                targets.append(grown[1])
            else:
                drafts.append(grown)
        return draft_work(targets, drafts)

    def _forget(self, live: dict[str, list[InstanceRecord]]) -> None:
        ids = {r.instance_id for records in live.values() for r in records}
        for gone in [i for i in self._workers if i not in ids]:
            del self._workers[gone]
        for gone in [i for i in self.loads if i not in ids and self._clock() - self.loads[i][0] > LOAD_STALE_S]:
            del self.loads[gone]
