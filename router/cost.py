"""The KV router's choice: a cost per candidate worker, the cheapest wins.

For a request of ``n`` blocks and a worker that already holds its first ``overlap`` blocks::

    prefill_blocks = n - overlap                  # blocks the worker would have to compute
    cost = overlap_weight * prefill_blocks        # time to first token
         + decode_blocks                          # KV blocks of requests already running there
         + queue_weight * queued                  # requests waiting there

A worker that keeps KV blocks below its device pool (host memory, disk: ``tier`` KV events) may
hold more of the prompt there, after its device overlap: ``lower`` blocks. Loading a block back
costs a fraction of computing it (a memory or disk read against a forward pass), so::

    prefill_blocks = n - overlap - tier_hit_weight * lower

``tier_hit_weight`` (0..1, default 0.75: a lower-tier hit costs a quarter of a miss) puts a
lower-tier hit between a device hit (weight 1) and a miss (weight 0).

All terms are in blocks, so ``overlap_weight`` trades cache hits against load: with weight w, a worker
that holds k more of the prompt's blocks may carry w*k more active blocks and still win. The lowest
cost wins and ties are broken at random; with ``temperature > 0`` the choice is a softmax over the
costs scaled to [0, 1], so that equal ``temperature`` means the same spread at any load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from .queue import QUEUE_POLICIES


@dataclass(frozen=True)
class KvRouterConfig:
    """Knobs of the KV-aware router (one frozen value, built from flags or keyword options)."""

    block_size: int = 16  # used for workers whose KV events have not told theirs yet
    overlap_weight: float = 2.0
    tier_hit_weight: float = 0.75  # a lower-tier (host, disk) hit saves this fraction of a miss's prefill
    queue_weight: float = 16.0  # cost of one queued request, in blocks
    temperature: float = 0.0
    seed: int | None = None
    request_dump: bool = True  # ask workers for their cache state when the router starts
    gap_timeout: float = 2.0  # seconds an out-of-order gap in a worker's events may stay open
    resync_interval: float = 5.0  # least seconds between dump requests caused by lost events
    resync_window: float = 3.0  # seconds a dump has to confirm a worker's blocks after lost events
    inflight_ttl: float = 600.0  # selections never released are forgotten after this long
    unregistered_grace: float = 30.0  # events of a never-registered worker are kept this long
    maintenance_interval: float = 0.5
    # the pending queue (router/queue.py): None: off; else hold a request while every worker it may go
    # to has at least this fraction of its max_num_seqs in flight from this router
    queue_threshold: float | None = None
    queue_policy: str = "fcfs"  # fcfs, lcfs or wspt, within a strict tier
    queue_priority_bump_s: float = 1.0  # fcfs: seconds earlier a request counts as arrived per unit of priority
    max_sessions: int = 65536  # agent sessions whose last worker is remembered (least recently used go)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 <= self.tier_hit_weight <= 1:
            raise ValueError(f"tier_hit_weight must be in [0, 1], got {self.tier_hit_weight}")
        if self.overlap_weight < 0 or self.queue_weight < 0:
            raise ValueError("overlap_weight and queue_weight must be >= 0")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.queue_threshold is not None and (not math.isfinite(self.queue_threshold) or self.queue_threshold <= 0):
            raise ValueError(f"queue_threshold must be a finite number > 0, got {self.queue_threshold}")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy must be one of {QUEUE_POLICIES}, got {self.queue_policy!r}")
        if self.queue_priority_bump_s < 0 or self.max_sessions <= 0:
            raise ValueError("queue_priority_bump_s must be >= 0 and max_sessions > 0")
        for name in ("gap_timeout", "resync_interval", "resync_window", "inflight_ttl", "unregistered_grace",
                     "maintenance_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_options(cls, options: dict) -> KvRouterConfig:
        """Build from ``create_router`` keyword options; unknown names raise ``ValueError``."""
        known = set(cls.__dataclass_fields__)
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown kv router options {sorted(unknown)}; known: {sorted(known)}")
        return cls(**options)


def choose(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Index of the chosen candidate: the cheapest (ties at random), or a softmax draw if ``temperature > 0``."""
    if not costs:
        raise ValueError("no candidates to choose from")
    low = min(costs)
    if temperature <= 0:
        best = [i for i, c in enumerate(costs) if c == low]
        return best[0] if len(best) == 1 else rng.choice(best)
    span = max(costs) - low
    if span == 0:
        return rng.randrange(len(costs))
    weights = [math.exp(-(c - low) / span / temperature) for c in costs]
    return rng.choices(range(len(costs)), weights)[0]


def request_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks a prompt of ``num_tokens`` occupies (a partial last block counts)."""
    return -(-num_tokens // block_size)
