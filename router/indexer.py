"""The KV index: which worker holds which prompt blocks, kept from the workers' KV events.

Block hashes are chained (:mod:`runtime.kv_hash`): a block's hash covers every token before it, so a
flat map ``hash -> workers`` answers exactly what a radix tree over token blocks answers. A request's
block *i* is held by a worker iff its hash is in that worker's set, and "how many leading blocks does
each worker hold" is a walk down the request's hashes that stops when no worker is left. Worker sets
are bitmasks (one bit per worker), so each step of the walk is one dict lookup and one AND.

Event order, per worker: ``event_id`` grows by one per event.
- an id already applied is a duplicate and is dropped;
- an id ahead of the next expected one waits in a buffer until the gap fills; a gap that stays open
  for ``gap_timeout`` seconds, or while ``max_pending`` events wait, is skipped (the buffered events
  are applied in order) and :attr:`KvIndex.resync_needed` is set so the owner can ask for a dump;
- a dump repairs such a worker both ways: :meth:`KvIndex.begin_resync` marks its blocks unconfirmed,
  the dump's ``stored`` events confirm what it still holds, and :meth:`KvIndex.sweep` drops the rest
  (blocks whose ``removed`` event was lost) once the window has passed, if the worker answered;
- the first event seen from a worker sets the sequence (a router that starts late has missed the
  earlier ones and recovers them from a dump: workers answer ``KvDumpRequest`` with ``stored`` events).

A worker that left is dropped with all its blocks and remembered, so late events of it are ignored;
a restarted worker has a new instance id and starts empty.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from runtime.messages import KvEvent, KvEventKind

log = logging.getLogger(__name__)

MAX_DEPARTED = 10_000  # departed worker ids remembered (to ignore their stragglers)


@dataclass
class _Worker:
    bit: int
    first_seen: float
    blocks: set[int] = field(default_factory=set)
    next_id: int | None = None  # next event id expected; None until the first event
    pending: dict[int, KvEvent] = field(default_factory=dict)
    gap_since: float | None = None
    block_size: int = 0
    gap_skipped: bool = False  # events were lost: the next dump should also retract stale blocks
    unconfirmed: set[int] | None = None  # during a resync: blocks no event has confirmed yet
    resync_until: float = 0.0
    answered: bool = False  # an event arrived since the resync began


@dataclass
class IndexCounters:
    """What happened to incoming events (exported as router metrics)."""

    applied: int = 0
    duplicates: int = 0
    reordered: int = 0  # events that arrived early and waited for a gap to fill
    gaps_skipped: int = 0  # missing events given up on
    departed_dropped: int = 0  # events of workers that had left


class KvIndex:
    """``block hash -> workers`` with per-worker event sequencing; plain values in."""

    def __init__(self, max_pending: int = 256, gap_timeout: float = 2.0):
        if max_pending < 1 or gap_timeout <= 0:
            raise ValueError("max_pending must be >= 1 and gap_timeout > 0")
        self.max_pending = max_pending
        self.gap_timeout = gap_timeout
        self._blocks: dict[int, int] = {}  # hash -> bitmask of workers holding it
        self._workers: dict[str, _Worker] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._departed: OrderedDict[str, None] = OrderedDict()
        self._sizes: dict[int, int] = {}  # block size -> workers using it
        self._masks: dict[tuple[str, ...], tuple[int, dict[int, str]]] = {}  # candidate sets seen
        self.counters = IndexCounters()
        self.resync_needed = False

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        """Distinct block hashes held by any worker."""
        return len(self._blocks)

    def workers(self) -> list[str]:
        return list(self._workers)

    def num_blocks(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return len(w.blocks) if w else 0

    def holds(self, worker_id: str, block_hash: int) -> bool:
        """Whether the worker holds the block."""
        w = self._workers.get(worker_id)
        return w is not None and block_hash in w.blocks

    def block_size(self, worker_id: str) -> int:
        """The block size of the worker's last event (0: unknown)."""
        w = self._workers.get(worker_id)
        return w.block_size if w else 0

    def block_sizes(self) -> list[int]:
        """Distinct block sizes of the indexed workers (one, normally)."""
        return list(self._sizes)

    def overlaps(self, hashes: Iterable[int], worker_ids: Sequence[str]) -> dict[str, int]:
        """For each of ``worker_ids``: how many leading blocks of ``hashes`` it holds.

        ``hashes`` is consumed only until no candidate holds a block, so it may be a lazy iterator.
        """
        out = dict.fromkeys(worker_ids, 0)
        key = tuple(worker_ids)
        found = self._masks.get(key)
        if found is None:
            found = self._candidate_mask(key)
        mask, by_bit = found
        if not mask:
            return out
        get = self._blocks.get
        active = mask
        depth = 0
        for h in hashes:
            held = get(h, 0) & active
            if held != active:
                dropped = active ^ held
                while dropped and depth:  # workers dropped at depth 0 keep their 0
                    low = dropped & -dropped
                    out[by_bit[low.bit_length() - 1]] = depth
                    dropped ^= low
                active = held
                if not active:
                    return out
            depth += 1
        while active:
            low = active & -active
            out[by_bit[low.bit_length() - 1]] = depth
            active ^= low
        return out

    def _candidate_mask(self, key: tuple[str, ...]) -> tuple[int, dict[int, str]]:
        """(bitmask, bit -> worker id) of the indexed workers among ``key``; cached until membership changes."""
        mask, by_bit = 0, {}
        for wid in key:
            w = self._workers.get(wid)
            if w is not None:
                mask |= 1 << w.bit
                by_bit[w.bit] = wid
        if len(self._masks) >= 1024:
            self._masks.clear()
        self._masks[key] = (mask, by_bit)
        return mask, by_bit

    # ------------------------------------------------------------------ events

    def apply(self, event: KvEvent, now: float | None = None) -> None:
        """Take one event of any worker, in whatever order it arrived."""
        now = time.monotonic() if now is None else now
        wid = event.worker_id
        if wid in self._departed:
            self.counters.departed_dropped += 1
            return
        w = self._workers.get(wid)
        if w is None:
            w = self._add_worker(wid, now)
        if w.next_id is None:
            w.next_id = event.event_id
        if event.event_id < w.next_id or event.event_id in w.pending:
            self.counters.duplicates += 1
            return
        if event.event_id > w.next_id:
            self.counters.reordered += 1
            w.pending[event.event_id] = event
            if w.gap_since is None:
                w.gap_since = now
            if len(w.pending) >= self.max_pending:
                self._skip_gap(wid, w)
            return
        self._apply_in_order(w, event)
        self._drain(w)

    def flush_gaps(self, now: float | None = None) -> int:
        """Skip gaps older than ``gap_timeout``; returns how many workers had one."""
        now = time.monotonic() if now is None else now
        stale = [(wid, w) for wid, w in self._workers.items() if w.gap_since is not None and now - w.gap_since >= self.gap_timeout]
        for wid, w in stale:
            self._skip_gap(wid, w)
        return len(stale)

    def begin_resync(self, window: float, now: float | None = None) -> int:
        """A dump was requested: mark the blocks of workers that lost events as unconfirmed.

        Returns how many workers are resyncing; :meth:`sweep` finishes them after ``window`` seconds.
        """
        now = time.monotonic() if now is None else now
        n = 0
        for w in self._workers.values():
            if w.gap_skipped:
                w.gap_skipped = False
                w.unconfirmed = set(w.blocks)
                w.resync_until = now + window
                w.answered = False
                n += 1
        return n

    def sweep(self, now: float | None = None) -> int:
        """Drop blocks a resyncing worker's dump did not confirm; returns how many were dropped."""
        now = time.monotonic() if now is None else now
        dropped = 0
        for wid, w in self._workers.items():
            if w.unconfirmed is None or now < w.resync_until:
                continue
            if w.answered and w.unconfirmed:
                bit = 1 << w.bit
                for h in w.unconfirmed:
                    if h in w.blocks:
                        w.blocks.discard(h)
                        self._unset(h, bit)
                        dropped += 1
                log.info("kv index: worker %s's dump did not confirm %d blocks; dropped them", wid, len(w.unconfirmed))
            w.unconfirmed = None
        return dropped

    def _skip_gap(self, wid: str, w: _Worker) -> None:
        first = min(w.pending)
        self.counters.gaps_skipped += first - w.next_id
        log.warning("kv index: worker %s events %d..%d missing; skipping them", wid, w.next_id, first - 1)
        w.next_id = first
        w.gap_skipped = True
        self.resync_needed = True
        self._drain(w)

    def _drain(self, w: _Worker) -> None:
        while w.next_id in w.pending:
            self._apply_in_order(w, w.pending.pop(w.next_id))
        w.gap_since = None if not w.pending else w.gap_since

    def _apply_in_order(self, w: _Worker, event: KvEvent) -> None:
        w.next_id = event.event_id + 1
        if w.block_size != event.block_size:
            self._count_size(w.block_size, -1)
            self._count_size(event.block_size, +1)
            w.block_size = event.block_size
        self.counters.applied += 1
        bit = 1 << w.bit
        blocks = self._blocks
        if w.unconfirmed is not None:
            w.answered = True
            if event.kind == KvEventKind.CLEARED:
                w.unconfirmed.clear()
            else:
                w.unconfirmed.difference_update(event.block_hashes)
        if event.kind == KvEventKind.STORED:
            for h in event.block_hashes:
                if h not in w.blocks:
                    w.blocks.add(h)
                    blocks[h] = blocks.get(h, 0) | bit
        elif event.kind == KvEventKind.REMOVED:
            for h in event.block_hashes:
                if h in w.blocks:
                    w.blocks.discard(h)
                    self._unset(h, bit)
        elif event.kind == KvEventKind.CLEARED:
            self._clear_blocks(w)
        else:
            log.warning("kv index: ignoring event of unknown kind %r from %s", event.kind, event.worker_id)

    # ------------------------------------------------------------------ membership

    def remove_worker(self, worker_id: str) -> None:
        """The worker left: drop its blocks and ignore anything it still sends."""
        self._departed[worker_id] = None
        while len(self._departed) > MAX_DEPARTED:
            self._departed.popitem(last=False)
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        self._clear_blocks(w)
        self._count_size(w.block_size, -1)
        self._masks.clear()
        self._free_bits.append(w.bit)
        log.info("kv index: dropped worker %s", worker_id)

    def is_departed(self, worker_id: str) -> bool:
        return worker_id in self._departed

    def unregistered(self, live: set[str], older_than: float, now: float | None = None) -> list[str]:
        """Workers that sent events but have not been live for ``older_than`` seconds since."""
        now = time.monotonic() if now is None else now
        return [wid for wid, w in self._workers.items() if wid not in live and now - w.first_seen >= older_than]

    def _add_worker(self, worker_id: str, now: float) -> _Worker:
        bit = self._free_bits.pop() if self._free_bits else self._take_bit()
        w = self._workers[worker_id] = _Worker(bit, now)
        self._masks.clear()
        return w

    def _take_bit(self) -> int:
        self._next_bit += 1
        return self._next_bit - 1

    def _count_size(self, size: int, delta: int) -> None:
        if size <= 0:
            return
        left = self._sizes.get(size, 0) + delta
        if left > 0:
            self._sizes[size] = left
        else:
            self._sizes.pop(size, None)

    def _clear_blocks(self, w: _Worker) -> None:
        bit = 1 << w.bit
        for h in w.blocks:
            self._unset(h, bit)
        w.blocks = set()

    def _unset(self, h: int, bit: int) -> None:
        left = self._blocks.get(h, 0) & ~bit
        if left:
            self._blocks[h] = left
        else:
            self._blocks.pop(h, None)
