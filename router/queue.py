"""The KV router's pending queue: requests held while every worker they may go to is busy.

With ``--router-queue-threshold F`` a worker is *busy* when the requests this router has in flight
on it reach ``F`` × its ``max_num_seqs`` (from its load events; a worker that has not said its
capacity is never busy). A request whose eligible workers are all busy waits here; whenever one
frees up (a release, a load event, a worker joining) the queue is drained in key order::

    key = (-strict_priority, policy key, arrival sequence)

The strict tier is compared first: a higher tier always leaves first. Within a tier, the policy
(Dynamo's ``--router-queue-policy`` names):

- ``fcfs``: earliest effective arrival first, where a request's priority moves its arrival earlier
  by ``priority_bump_s`` seconds per unit (priority in vLLM's polarity, lower is sooner; only the
  sooner side counts, so a positive value cannot push a request behind plain arrival order);
- ``lcfs``: latest arrival first (a comparison baseline: it starves the oldest under load);
- ``wspt``: weighted shortest processing time (Smith's rule): smallest expected work / weight first,
  with work = prompt tokens + expected output tokens (``osl``, else ``default_osl``) and weight =
  1 + the priority's sooner side.

Pure bookkeeping: no asyncio, no clock of its own (times are passed in). The router owns the futures.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from runtime.messages import RoutingHints

QUEUE_POLICIES = ("fcfs", "lcfs", "wspt")


def sooner(priority: int) -> int:
    """How much sooner than the default a priority asks to be served (vLLM's polarity: lower is sooner)."""
    return max(0, -priority)


def policy_key(policy: str, hints: RoutingHints, arrival: float, prompt_tokens: int, *, priority_bump_s: float = 1.0,
               default_osl: int = 256) -> float:
    """The within-tier order of a request (smaller leaves first); see the module docstring."""
    if policy == "fcfs":
        return arrival - priority_bump_s * sooner(hints.priority)
    if policy == "lcfs":
        return -arrival
    if policy == "wspt":
        work = prompt_tokens + (hints.osl or default_osl)
        return work / (1 + sooner(hints.priority))
    raise ValueError(f"queue policy must be one of {QUEUE_POLICIES}, got {policy!r}")


@dataclass(order=True)
class Pending:
    """One held request; ``item`` is the router's (its future and what it needs to route)."""

    key: tuple[float, float, int]
    tier: int = field(compare=False)
    arrival: float = field(compare=False)
    item: Any = field(compare=False)
    done: bool = field(default=False, compare=False)


class PendingQueue:
    """Held requests in key order; entries are taken out by :meth:`take` or dropped by :meth:`drop`."""

    def __init__(self, policy: str = "fcfs", *, priority_bump_s: float = 1.0, default_osl: int = 256):
        if policy not in QUEUE_POLICIES:
            raise ValueError(f"queue policy must be one of {QUEUE_POLICIES}, got {policy!r}")
        self.policy = policy
        self.priority_bump_s = priority_bump_s
        self.default_osl = default_osl
        self._heap: list[Pending] = []
        self._seq = itertools.count()
        self.pending_by_tier: dict[int, int] = {}

    def __len__(self) -> int:
        return sum(self.pending_by_tier.values())

    def push(self, hints: RoutingHints, arrival: float, prompt_tokens: int, item: Any) -> Pending:
        second = policy_key(self.policy, hints, arrival, prompt_tokens, priority_bump_s=self.priority_bump_s,
                            default_osl=self.default_osl)
        entry = Pending((-hints.strict_priority, second, next(self._seq)), hints.strict_priority, arrival, item)
        heapq.heappush(self._heap, entry)
        self.pending_by_tier[entry.tier] = self.pending_by_tier.get(entry.tier, 0) + 1
        return entry

    def ordered(self) -> list[Pending]:
        """The live entries, first to leave first."""
        self._heap = [e for e in self._heap if not e.done]
        heapq.heapify(self._heap)
        return sorted(self._heap)

    def take(self, entry: Pending) -> None:
        """``entry`` leaves the queue (dispatched, failed or abandoned); idempotent."""
        if entry.done:
            return
        entry.done = True
        left = self.pending_by_tier[entry.tier] - 1
        if left:
            self.pending_by_tier[entry.tier] = left
        else:
            del self.pending_by_tier[entry.tier]
