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
  logs each decision at debug level.

A router built without a runtime (``KvRouter(instances, config)``) is fed through ``on_kv_event`` /
``on_load_event`` / ``on_instances``; tests and the benchmark use it that way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence

from runtime import InvalidRequest, NoInstances
from runtime.events import TOPIC_KV, TOPIC_KV_DUMP, TOPIC_LOAD
from runtime.kv_hash import ROOT_HASH, block_hash, block_hashes, chain_root
from runtime.messages import InstanceRecord, KvDumpRequest, KvEvent, LoadEvent

from .base import Router, Selection
from .cost import KvRouterConfig, choose, request_blocks
from .indexer import KvIndex
from .load import LoadTracker

log = logging.getLogger(__name__)

INLINE_HASH_BLOCKS = 1024  # a cached prompt longer than this many blocks has the rest hashed in a thread


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

    def _forget(self, worker_id: str) -> None:
        self.index.remove_worker(worker_id)
        for index in self.tiers.values():
            index.remove_worker(worker_id)
        self.load.drop_worker(worker_id)
        self.in_flight.pop(worker_id, None)

    # ------------------------------------------------------------------ choice

    async def select(self, model: str, token_ids: Sequence[int], exclude=frozenset(), request_id: str = "",
                     lora: str = "") -> Selection:
        cfg = self.config
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
        pressure = self.load.pressure.get
        weight = cfg.overlap_weight
        if prefill is None:
            n = request_blocks(len(token_ids), block_size)
            lower = await self._lower_overlaps(token_ids, block_size, ids, overlaps, root) if self.tiers else {}
            saved = cfg.tier_hit_weight
            costs = [weight * (n - overlaps[w] - saved * lower.get(w, 0)) + pressure(w, 0) for w in ids]
        else:
            costs = [weight * p + pressure(w, 0) for w, p in zip(ids, prefill)]
        chosen = choose(costs, cfg.temperature, self._rng)
        wid = ids[chosen]
        self.decisions += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: chose %s (overlap %d blocks, cost %g); candidates: %s", request_id or "-", wid,
                      overlaps[wid], costs[chosen],
                      ", ".join(f"{c}: overlap={overlaps[c]} cost={cost:g}" for c, cost in zip(ids, costs)))
        selection = self._selected(wid, overlaps[wid], request_id)
        self.load.add(selection.ticket, wid, request_blocks(len(token_ids), self.index.block_size(wid) or block_size))
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

    def _count_down(self, worker_id: str) -> None:
        left = self.in_flight.get(worker_id, 0) - 1
        if left > 0:
            self.in_flight[worker_id] = left
        else:
            self.in_flight.pop(worker_id, None)
