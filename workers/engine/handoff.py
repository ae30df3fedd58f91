"""Prefill/decode disaggregation in the engine: prompts handed off by a prefill worker and pulled in
by a decode worker.

A prefill worker's request ends after its first token (``Engine.add_request(prefill_only=True)``);
its blocks, positions ``[0, num_computed)``, then wait in :class:`Handoffs` until the decode worker
that pulled them releases them, or until their ttl runs out, and :meth:`Handoffs.take` says where
they are (:class:`runtime.messages.KvHandoff`). The decode side's request being pulled in is a
:class:`Receiving` (``Engine.receive`` / ``Engine.finish_receive``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from runtime.messages import KvHandoff

from .block_manager import BlockManager
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class Parked:
    """A handed-off prompt's blocks, freed when pulled or at ``deadline``."""

    blocks: list[int]
    deadline: float  # time.monotonic()


@dataclass
class Receiving:
    """A decode-side request whose prompt KV is being pulled: blocks ``[first_block:]`` of its table
    (``local``) are read from the prefill worker's ``remote`` blocks; the ones before are this
    engine's own prefix-cache hits."""

    seq: Sequence
    num_tokens: int
    first_block: int
    local: list[int]
    remote: list[int]


class Handoffs:
    """The blocks a prefill worker's engine holds for decode workers; plain values in."""

    def __init__(self, blocks: BlockManager, ttl: float = 30.0):
        self._blocks = blocks
        self.ttl = ttl
        self.parked: dict[str, Parked] = {}
        self.expired = 0  # handoffs freed unpulled
        self._new: dict[str, KvHandoff] = {}

    def park(self, seq: Sequence) -> None:
        """Keep ``seq``'s blocks (its table is emptied, so finishing it frees none) and say where."""
        blocks, seq.block_table = seq.block_table, []
        self.parked[seq.request_id] = Parked(blocks, time.monotonic() + self.ttl)
        self._new[seq.request_id] = KvHandoff(self._blocks.worker_id, seq.request_id, list(blocks), seq.num_computed,
                                              self.ttl, max(seq.num_cached_tokens, 0), time.time() + self.ttl)

    def take(self) -> dict[str, KvHandoff]:
        """The handoffs parked since the last call, by request id."""
        out, self._new = self._new, {}
        return out

    def release(self, handoff_ids: list[str]) -> int:
        """Free the blocks of handoffs a decode worker has pulled (or given up on); returns how many
        were still parked (a late or repeated release is a no-op)."""
        released = 0
        for hid in handoff_ids:
            parked = self.parked.pop(hid, None)
            if parked is not None:
                self._blocks.free(parked.blocks)
                released += 1
        return released

    def expire(self, now: float | None = None) -> int:
        """Free handoffs nobody pulled within their ttl (a decode worker that died, a request that
        went elsewhere); returns how many."""
        now = time.monotonic() if now is None else now
        expired = [hid for hid, p in self.parked.items() if p.deadline <= now]
        self.release(expired)
        self.expired += len(expired)
        if expired:
            log.info("freed %d handoffs no decode worker pulled in %gs", len(expired), self.ttl)
        return len(expired)

    @property
    def num_blocks(self) -> int:
        return sum(len(p.blocks) for p in self.parked.values())
