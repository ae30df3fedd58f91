"""The KV-aware router: send each request where its prompt's prefix is cached, weighed against load.

``await create_router(rt, "kv", **options)`` builds one (options: :class:`router.cost.KvRouterConfig`).
Once started it
- keeps a :class:`router.indexer.KvIndex` from the workers' KV events (``TOPIC_KV``) and, if asked,
  publishes a ``KvDumpRequest`` first so that workers republish what they already hold; events of
  lower KV tiers (``KvEvent.tier``: host, disk) go to one more index per tier, and a lower-tier hit
  after the device overlap is scored between a hit and a miss (``tier_hit_weight``, :mod:`router.cost`);
- keeps a :class:`router.load.LoadTracker` from load events (``TOPIC_LOAD``) and its own selections;
- drops a worker from both as soon as it leaves the live instance snapshot (etcd);
- scores every candidate with the cost of :mod:`router.cost` (overlap_weight · blocks to prefill +
  active decode blocks + queue_weight · queued requests, computed in :meth:`KvRouter.select`) and
  logs each decision at debug level;
- keeps an agent session (``RoutingHints.session_id``) on the worker its last turn went to when
  that worker's cost ties the lowest (its cache usually makes it the lowest outright); a session
  whose worker left is scored like any request, lower KV tiers included, and moves to the winner;
- with ``queue_threshold`` set, holds requests while every worker they may go to is busy and
  dispatches them by strict tier and queue policy (:mod:`router.queue`).

A router built without a runtime (``KvRouter(instances, config)``) is fed through ``on_kv_event`` /
``on_load_event`` / ``on_instances``; tests and the benchmark use it that way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from runtime import InvalidRequest, NoInstances
from runtime.events import TOPIC_KV, TOPIC_KV_DUMP, TOPIC_LOAD
from runtime.histogram import histogram
from runtime.kv_hash import ROOT_HASH, block_hash, block_hashes, chain_root
from runtime.messages import InstanceRecord, KvDumpRequest, KvEvent, LoadEvent, RoutingHints

from .base import Router, Selection
from .cost import KvRouterConfig, choose, request_blocks
from .indexer import KvIndex
from .load import LoadTracker
from .queue import PendingQueue

log = logging.getLogger(__name__)

INLINE_HASH_BLOCKS = 1024  # a cached prompt longer than this many blocks has the rest hashed in a thread
NO_HINTS = RoutingHints()
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class _Held:
    """One request's routing inputs, kept while it waits in the queue: the prefill cost per candidate
    (``base``; ``miss_cost`` for a worker that joined since) is computed once, load is read at dispatch."""

    model: str
    exclude: frozenset[str]
    request_id: str
    hints: RoutingHints
    overlaps: dict[str, int]
    base: dict[str, float]
    miss_cost: float
    num_tokens: int
    block_size: int
    future: asyncio.Future | None = None


def lazy_block_hashes(tokens: Sequence[int], block_size: int, root: int = ROOT_HASH) -> Iterator[int]:
    """``runtime.kv_hash.block_hashes`` one block at a time: the index walk stops at the first block
    no candidate holds, so the blocks after it are never hashed (hashing is most of a decision's cost)."""
    parent = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        yield parent


class KvRouter(Router):
    """Routes by prefix overlap and load; see the module docstring."""

    mode = "kv"

    def __init__(self, instances: Callable[[str | None], list[InstanceRecord]], config: KvRouterConfig | None = None):
        self.config = config or KvRouterConfig()
        super().__init__(instances, self.config.seed)
        self.index = KvIndex(gap_timeout=self.config.gap_timeout)
        # blocks workers keep below their device pool, per tier (KvEvent.tier): scored between a hit and a miss
        self.tiers: dict[str, KvIndex] = {}
        self.load = LoadTracker(self.config.queue_weight)
        self._by_model: dict[str, list[str]] | None = None  # live target ids per model, from the snapshot
        self.decisions = 0
        self._live: set[str] | None = None  # live target ids; None until the first snapshot
        self._rt = None
        self._snapshot = None
        self._subs: list = []
        self._task: asyncio.Task | None = None
        self._last_dump = -self.config.resync_interval
        self._stopped = False
        # requests held while every worker they may go to is busy (--router-queue-threshold)
        self.queue = PendingQueue(self.config.queue_policy, priority_bump_s=self.config.queue_priority_bump_s)
        self.queue_wait: dict[int, object] = {}  # strict tier -> histogram of seconds held
        self.queue_max_wait: dict[int, float] = {}  # strict tier -> the longest any request was held
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session id -> the worker its last turn went to
        self.session_hits = 0  # choices that kept a session on its worker by the tie rule

    @classmethod
    async def create(cls, rt, client, **options) -> KvRouter:
        """A KV router over ``client`` (the runtime's ``target.generate`` client); call :meth:`start`."""
        router = cls(client.instances, KvRouterConfig.from_options(options))
        router._rt = rt
        router._snapshot = client.snapshot
        return router

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._rt is None:
            return
        self._subs.append(await self._rt.subscribe(TOPIC_KV, KvEvent, self.on_kv_event))
        self._subs.append(await self._rt.subscribe(TOPIC_LOAD, LoadEvent, self.on_load_event))
        self._snapshot.add_listener(self.on_instances)
        self.on_instances(self._snapshot.items())
        if self.config.request_dump:
            await self.request_dump()
        self._task = asyncio.create_task(self._maintain(), name="kv-router-maintenance")
        log.info("kv router started (overlap_weight %g, temperature %g)", self.config.overlap_weight, self.config.temperature)

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for sub in self._subs:
            await sub.close()
        self._subs.clear()

    async def request_dump(self) -> None:
        """Ask every worker to republish its cached blocks (they arrive as ``stored`` events)."""
        self._last_dump = time.monotonic()
        self.index.resync_needed = False
        self.index.begin_resync(self.config.resync_window)
        await self._rt.publish(TOPIC_KV_DUMP, KvDumpRequest(requester=self._rt.instance_id))
        log.info("kv router: asked workers for a dump of their cache state")

    async def _maintain(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.maintenance_interval)
            try:
                self.maintain()
                self.drain()
                if self.index.resync_needed and time.monotonic() - self._last_dump >= cfg.resync_interval:
                    await self.request_dump()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv router maintenance failed")

    def maintain(self, now: float | None = None) -> None:
        """Skip stale event gaps, forget unreleased selections and workers that never registered."""
        now = time.monotonic() if now is None else now
        self.index.flush_gaps(now)
        for index in self.tiers.values():
            index.flush_gaps(now)
        self.index.sweep(now)
        for ticket, worker_id in self.load.expire(self.config.inflight_ttl, now):
            log.warning("kv router: selection %d on %s was never released; forgetting it", ticket, worker_id)
            self._count_down(worker_id)
        if self._live is not None:
            for worker_id in self.index.unregistered(self._live, self.config.unregistered_grace, now):
                log.info("kv router: worker %s sent events but never registered; dropping it", worker_id)
                self._forget(worker_id)

    # ------------------------------------------------------------------ inputs

    def on_kv_event(self, event: KvEvent) -> None:
        if event.tier:
            index = self.tiers.get(event.tier)
            if index is None:
                index = self.tiers[event.tier] = KvIndex(gap_timeout=self.config.gap_timeout)
            index.apply(event)
        else:
            self.index.apply(event)

    def on_load_event(self, event: LoadEvent) -> None:
        if not self.index.is_departed(event.worker_id):
            self.load.observe(event)
            self.drain()

    def on_instances(self, items: dict[str, InstanceRecord]) -> None:
        """The live target instances changed: forget every worker that left."""
        if self._stopped:
            return
        live = {r.instance_id for r in items.values()}
        for worker_id in (self._live or set()) - live:
            log.info("kv router: worker %s left", worker_id)
            self._forget(worker_id)
        self._live = live
        by_model: dict[str, list[str]] = {}
        for r in sorted(items.values(), key=lambda r: r.instance_id):
            by_model.setdefault(r.model, []).append(r.instance_id)
        self._by_model = by_model
        self.drain()

    def _forget(self, worker_id: str) -> None:
        self.index.remove_worker(worker_id)
        for index in self.tiers.values():
            index.remove_worker(worker_id)
        self.load.drop_worker(worker_id)
        self.in_flight.pop(worker_id, None)

    # ------------------------------------------------------------------ choice

    async def select(self, model: str, token_ids: Sequence[int], exclude=frozenset(), request_id: str = "",
                     lora: str = "", hints: RoutingHints | None = None) -> Selection:
        cfg = self.config
        hints = hints or NO_HINTS
        ids = self._candidate_ids(model, exclude)
        root = chain_root(lora)
        sizes = self.index.block_sizes()
        block_size = sizes[0] if len(sizes) == 1 else cfg.block_size
        try:
            if len(sizes) > 1:  # workers with different block sizes: each is scored with its own hashes
                overlaps, prefill = await self._mixed_sizes(token_ids, ids, root)
            else:
                overlaps = await self._overlaps(token_ids, block_size, ids, root)
                prefill = None
        except (OverflowError, TypeError) as exc:
            raise InvalidRequest(f"token ids must be integers in [0, 2**32): {exc}", field="token_ids") from None
        weight = cfg.overlap_weight
        n = request_blocks(len(token_ids), block_size)
        if prefill is None:
            lower = await self._lower_overlaps(token_ids, block_size, ids, overlaps, root) if self.tiers else {}
            saved = cfg.tier_hit_weight
            base = {w: weight * (n - overlaps[w] - saved * lower.get(w, 0)) for w in ids}
        else:
            base = {w: weight * p for w, p in zip(ids, prefill)}
        held = _Held(model, frozenset(exclude), request_id, hints, overlaps, base, weight * n, len(token_ids), block_size)
        if cfg.queue_threshold is None:
            return self._dispatch(held, ids)
        held.future = asyncio.get_running_loop().create_future()
        entry = self.queue.push(hints, time.monotonic(), len(token_ids), held)
        self.drain()
        if not held.future.done():
            log.debug("request %s: held in the router queue (tier %d, %d pending)", request_id or "-",
                      hints.strict_priority, len(self.queue))
        try:
            return await held.future
        except asyncio.CancelledError:
            self.queue.take(entry)
            if held.future.done() and not held.future.cancelled() and held.future.exception() is None:
                self.release(held.future.result())  # chosen just as its caller left
            raise

    def drain(self, now: float | None = None) -> None:
        """Dispatch held requests, first in queue order, while some worker each may go to is not busy."""
        if not len(self.queue):
            return
        now = time.monotonic() if now is None else now
        for entry in self.queue.ordered():
            held = entry.item
            if held.future.done():
                self.queue.take(entry)
                continue
            try:
                ids = self._candidate_ids(held.model, held.exclude)
            except NoInstances as exc:
                self.queue.take(entry)
                held.future.set_exception(exc)
                continue
            free = [w for w in ids if not self._busy(w)]
            if not free:
                continue
            self.queue.take(entry)
            wait = now - entry.arrival
            if entry.tier not in self.queue_wait:
                self.queue_wait[entry.tier] = histogram(QUEUE_WAIT_BUCKETS)
            self.queue_wait[entry.tier].observe(wait)
            self.queue_max_wait[entry.tier] = max(self.queue_max_wait.get(entry.tier, 0.0), wait)
            held.future.set_result(self._dispatch(held, free))

    def _busy(self, worker_id: str) -> bool:
        """At or above the queue threshold: this router's requests in flight there ≥ threshold × its capacity."""
        capacity = self.load.capacity(worker_id)
        return capacity > 0 and self.load.own_requests(worker_id) >= self.config.queue_threshold * capacity

    def _dispatch(self, held: _Held, ids: list[str]) -> Selection:
        """Choose among ``ids`` by cost (the session's worker on a tie) and count the selection."""
        pressure = self.load.pressure.get
        costs = [held.base.get(w, held.miss_cost) + pressure(w, 0) for w in ids]
        session = held.hints.session_id
        home = self.sessions.get(session) if session else None
        if home in ids and costs[ids.index(home)] <= min(costs):
            chosen = ids.index(home)  # the session stays where it is while that costs no more
            self.session_hits += 1
        else:
            chosen = choose(costs, self.config.temperature, self._rng)
        wid = ids[chosen]
        if session:
            self.sessions[session] = wid
            self.sessions.move_to_end(session)
            if len(self.sessions) > self.config.max_sessions:
                self.sessions.popitem(last=False)
        self.decisions += 1
        overlap = held.overlaps.get(wid, 0)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: chose %s (overlap %d blocks, cost %g); candidates: %s", held.request_id or "-", wid,
                      overlap, costs[chosen],
                      ", ".join(f"{c}: overlap={held.overlaps.get(c, 0)} cost={cost:g}" for c, cost in zip(ids, costs)))
        selection = self._selected(wid, overlap, held.request_id)
        size = self.index.block_size(wid) or held.block_size
        self.load.add(selection.ticket, wid, request_blocks(held.num_tokens, size))
        return selection

    def _candidate_ids(self, model: str, exclude) -> list[str]:
        ids = self._by_model.get(model) if self._by_model is not None else None
        if ids is None:
            return [r.instance_id for r in self.candidates(model, exclude)]
        if exclude:
            ids = [w for w in ids if w not in exclude]
        if not ids:
            raise NoInstances("target", "generate", model)
        return ids

    async def _overlaps(self, token_ids: Sequence[int], block_size: int, ids: list[str],
                        root: int = ROOT_HASH) -> dict[str, int]:
        """How many leading blocks of ``token_ids`` each of ``ids`` holds. Hashing is lazy, and stops
        at the first block no candidate holds; past ``INLINE_HASH_BLOCKS`` blocks that some candidate
        all holds, the rest is hashed in a thread (a cached 500k-token prompt is 31k blocks: about
        0.1 s of hashing, which on the event loop every stream would wait for)."""
        head = INLINE_HASH_BLOCKS * block_size
        if len(token_ids) < head + block_size:
            return self.index.overlaps(lazy_block_hashes(token_ids, block_size, root), ids)
        hashes = block_hashes(token_ids[:head], block_size, root)
        found = self.index.overlaps(hashes, ids)
        if max(found.values(), default=0) < len(hashes):
            return found  # the walk stopped within the head: the rest cannot change it
        rest = await asyncio.to_thread(block_hashes, token_ids[head:], block_size, hashes[-1])
        return self.index.overlaps(itertools.chain(hashes, rest), ids)

    async def _lower_overlaps(self, token_ids: Sequence[int], block_size: int, ids: list[str],
                              overlaps: dict[str, int], root: int = ROOT_HASH) -> dict[str, int]:
        """Per worker: how many blocks after its device overlap its lower tiers hold, in a row."""
        full = len(token_ids) // block_size
        if full <= min(overlaps.values(), default=0):
            return {}
        if full > INLINE_HASH_BLOCKS:
            hashes = await asyncio.to_thread(block_hashes, token_ids, block_size, root)
        else:
            hashes = block_hashes(token_ids, block_size, root)
        tiers = list(self.tiers.values())
        out = {}
        for w in ids:
            j = overlaps[w]
            while j < len(hashes) and any(t.holds(w, hashes[j]) for t in tiers):
                j += 1
            out[w] = j - overlaps[w]
        return out

    async def _mixed_sizes(self, token_ids: Sequence[int], ids: list[str],
                           root: int = ROOT_HASH) -> tuple[dict[str, int], list[int]]:
        overlaps: dict[str, int] = {}
        prefill = []
        for w in ids:
            size = self.index.block_size(w) or self.config.block_size
            overlaps.update(await self._overlaps(token_ids, size, [w], root))
            prefill.append(request_blocks(len(token_ids), size) - overlaps[w])
        return overlaps, prefill

    def release(self, selection: Selection) -> None:
        if self.load.remove(selection.ticket):
            self._count_down(selection.instance_id)
            self.drain()

    def _count_down(self, worker_id: str) -> None:
        left = self.in_flight.get(worker_id, 0) - 1
        if left > 0:
            self.in_flight[worker_id] = left
        else:
            self.in_flight.pop(worker_id, None)
