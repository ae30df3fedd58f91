"""Per-worker load as the KV router sees it: workers' load events plus its own in-flight requests.

A worker's *active decode blocks* are the KV blocks its running requests read at every decode step:
each request reads its whole context, so a prefix shared by ten requests is read ten times and counts
ten times (it is stored once, but routing balances work, not memory).

Load events arrive every fraction of a second and include requests that other routers sent; the
router's own accounting changes at once, so a burst of selections does not all land on the worker
that looked idle at the last event. The router uses the larger of the two.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from runtime.messages import LoadEvent


@dataclass
class _InFlight:
    worker_id: str
    blocks: int
    since: float


class LoadTracker:
    """Reported load per worker and the router's own in-flight selections, keyed by ticket."""

    def __init__(self, queue_weight: float = 0.0) -> None:
        self.queue_weight = queue_weight
        self._reported: dict[str, LoadEvent] = {}
        self._own_blocks: dict[str, int] = {}
        self._own_requests: dict[str, int] = {}
        self._inflight: dict[int, _InFlight] = {}
        # worker -> decode_blocks + queue_weight * queued, kept current so a decision reads one dict
        self.pressure: dict[str, float] = {}

    def observe(self, event: LoadEvent) -> None:
        self._reported[event.worker_id] = event
        self._update(event.worker_id)

    def add(self, ticket: int, worker_id: str, blocks: int, now: float | None = None) -> None:
        """Count a new selection of a request with ``blocks`` prompt blocks."""
        self._own_blocks[worker_id] = self._own_blocks.get(worker_id, 0) + blocks
        self._own_requests[worker_id] = self._own_requests.get(worker_id, 0) + 1
        self._inflight[ticket] = _InFlight(worker_id, blocks, time.monotonic() if now is None else now)
        self._update(worker_id)

    def remove(self, ticket: int) -> bool:
        """The selection ended; False if it was unknown (already released, expired or its worker left)."""
        item = self._inflight.pop(ticket, None)
        if item is None:
            return False
        wid = item.worker_id
        requests = self._own_requests[wid] - 1
        if requests > 0:
            self._own_requests[wid] = requests
            self._own_blocks[wid] -= item.blocks
        else:
            del self._own_requests[wid]
            del self._own_blocks[wid]
        self._update(wid)
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
        self._own_blocks.pop(worker_id, None)
        self._own_requests.pop(worker_id, None)
        self.pressure.pop(worker_id, None)
        for ticket in [t for t, item in self._inflight.items() if item.worker_id == worker_id]:
            del self._inflight[ticket]

    def _update(self, worker_id: str) -> None:
        value = self.decode_blocks(worker_id) + self.queue_weight * self.queued(worker_id)
        if value:
            self.pressure[worker_id] = value
        else:
            self.pressure.pop(worker_id, None)

    def decode_blocks(self, worker_id: str) -> int:
        reported = self._reported.get(worker_id)
        return max(self._own_blocks.get(worker_id, 0), reported.active_blocks if reported else 0)

    def queued(self, worker_id: str) -> int:
        reported = self._reported.get(worker_id)
        return reported.queued if reported else 0

    def capacity(self, worker_id: str) -> int:
        """The most requests the worker runs at once, as its load events say (0: not said)."""
        reported = self._reported.get(worker_id)
        return reported.max_num_seqs if reported else 0

    def own_requests(self, worker_id: str) -> int:
        return self._own_requests.get(worker_id, 0)

    def in_flight(self) -> int:
        return len(self._inflight)

    def workers(self) -> list[str]:
        return sorted(set(self._reported) | set(self._own_blocks))
