"""Per-worker load as the KV router sees it: workers' load events plus its own in-flight requests.

Load events arrive every fraction of a second and include requests other routers sent; the router's
own accounting changes at once, so a burst of selections does not all land on the worker that looked
idle at the last event. A worker's active decode blocks are the larger of the two. Own blocks are
counted as distinct block hashes (requests sharing a prefix share its blocks, as in a paged cache)
plus each request's partial last block.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.messages import LoadEvent


@dataclass
class _Own:
    refs: dict[int, int] = field(default_factory=dict)  # block hash -> in-flight requests using it
    partial: int = 0  # partial last blocks (never shared)
    requests: int = 0

    @property
    def blocks(self) -> int:
        return len(self.refs) + self.partial


@dataclass
class _InFlight:
    worker_id: str
    hashes: Sequence[int]
    partial: int
    since: float


class LoadTracker:
    """Reported load per worker and the router's own in-flight selections, keyed by ticket."""

    def __init__(self, queue_weight: float = 0.0) -> None:
        self.queue_weight = queue_weight
        self._reported: dict[str, LoadEvent] = {}
        self._own: dict[str, _Own] = {}
        self._inflight: dict[int, _InFlight] = {}
        # worker -> decode_blocks + queue_weight * queued, kept current so a decision reads one dict
        self.pressure: dict[str, float] = {}

    def observe(self, event: LoadEvent) -> None:
        self._reported[event.worker_id] = event
        self._update(event.worker_id)

    def _update(self, worker_id: str) -> None:
        value = self.decode_blocks(worker_id) + self.queue_weight * self.queued(worker_id)
        if value:
            self.pressure[worker_id] = value
        else:
            self.pressure.pop(worker_id, None)

    def add(self, ticket: int, worker_id: str, hashes: Sequence[int], partial: int, now: float | None = None) -> None:
        """Count a new selection: the prompt's full-block ``hashes`` and ``partial`` extra blocks."""
        own = self._own.get(worker_id)
        if own is None:
            own = self._own[worker_id] = _Own()
        refs = own.refs
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
        own.partial += partial
        own.requests += 1
        self._inflight[ticket] = _InFlight(worker_id, hashes, partial, time.monotonic() if now is None else now)
        self._update(worker_id)

    def remove(self, ticket: int) -> bool:
        """The selection ended; False if it was unknown (already released, expired or its worker left)."""
        item = self._inflight.pop(ticket, None)
        if item is None:
            return False
        own = self._own.get(item.worker_id)
        if own is None:  # cannot happen: drop_worker removes the in-flight items too
            return True
        refs = own.refs
        for h in item.hashes:
            left = refs.get(h, 0) - 1
            if left > 0:
                refs[h] = left
            else:
                refs.pop(h, None)
        own.partial -= item.partial
        own.requests -= 1
        if own.requests <= 0:
            del self._own[item.worker_id]
        self._update(item.worker_id)
        return True

    def expire(self, older_than: float, now: float | None = None) -> list[tuple[int, str]]:
        """Forget selections in flight longer than ``older_than`` seconds; returns (ticket, worker id)."""
        now = time.monotonic() if now is None else now
        old = [(t, item.worker_id) for t, item in self._inflight.items() if now - item.since >= older_than]
        for ticket, _ in old:
            self.remove(ticket)
        return old

    def drop_worker(self, worker_id: str) -> None:
        self._reported.pop(worker_id, None)
        self._own.pop(worker_id, None)
        self.pressure.pop(worker_id, None)
        for ticket in [t for t, item in self._inflight.items() if item.worker_id == worker_id]:
            del self._inflight[ticket]

    def decode_blocks(self, worker_id: str) -> int:
        own = self._own.get(worker_id)
        reported = self._reported.get(worker_id)
        return max(own.blocks if own else 0, reported.active_blocks if reported else 0)

    def queued(self, worker_id: str) -> int:
        reported = self._reported.get(worker_id)
        return reported.queued if reported else 0

    def own_requests(self, worker_id: str) -> int:
        own = self._own.get(worker_id)
        return own.requests if own else 0

    def in_flight(self) -> int:
        return len(self._inflight)

    def workers(self) -> list[str]:
        return sorted(set(self._reported) | set(self._own))
