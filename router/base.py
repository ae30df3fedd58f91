"""The router interface and the two load-blind modes, ``round_robin`` and ``random``.

Contract (what the frontend relies on):
- ``await router.select(model, token_ids, exclude)`` returns a :class:`Selection` for a live
  target instance serving ``model`` and not in ``exclude``, or raises :class:`runtime.NoInstances`.
  ``lora`` names the request's LoRA adapter: the KV router hashes its prompt from the adapter's
  chain root (:func:`runtime.kv_hash.chain_root`), as the workers do; the caller excludes the
  instances that do not hold the adapter. ``hints`` (priority, queue tier, expected output length,
  session) are read by the KV router (its queue and session affinity); the others ignore them.
- ``router.release(selection)`` is called exactly once when that request ends (any way), so the
  router's own in-flight accounting stays right.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runtime import NoInstances
from runtime.messages import InstanceRecord, RoutingHints

ROUTER_MODES = ("kv", "round_robin", "random")


@dataclass(frozen=True)
class Selection:
    """The instance chosen for one request, and how many of its prompt blocks it already holds."""

    instance_id: str
    overlap_blocks: int = 0
    request_id: str = ""
    ticket: int = 0  # names this selection for release (unique per router)
    router_id: str = ""  # set by RemoteRouter: the shared router service that made the choice


class Router:
    """Base router over the live ``target.generate`` instances of a runtime."""

    mode = "base"

    def __init__(self, instances: Callable[[str | None], list[InstanceRecord]], seed: int | None = None):
        self._instances = instances
        self._rng = random.Random(seed)
        self._tickets = itertools.count(1)
        self.in_flight: dict[str, int] = {}

    def candidates(self, model: str, exclude: frozenset[str] | set[str] = frozenset()) -> list[InstanceRecord]:
        found = [r for r in self._instances(model) if r.instance_id not in exclude]
        if not found:
            raise NoInstances("target", "generate", model)
        return found

    async def start(self) -> None:
        """Start background work (event subscriptions); the base router has none."""

    async def stop(self) -> None:
        """Stop background work."""

    async def select(self, model: str, token_ids: Sequence[int], exclude=frozenset(), request_id: str = "",
                     lora: str = "", hints: RoutingHints | None = None) -> Selection:
        raise NotImplementedError

    def _selected(self, instance_id: str, overlap: int = 0, request_id: str = "") -> Selection:
        self.in_flight[instance_id] = self.in_flight.get(instance_id, 0) + 1
        return Selection(instance_id, overlap, request_id, next(self._tickets))

    def release(self, selection: Selection) -> None:
        left = self.in_flight.get(selection.instance_id, 0) - 1
        if left > 0:
            self.in_flight[selection.instance_id] = left
        else:
            self.in_flight.pop(selection.instance_id, None)


class RoundRobinRouter(Router):
    mode = "round_robin"

    def __init__(self, instances, seed: int | None = None):
        super().__init__(instances, seed)
        self._counter = itertools.count()

    async def select(self, model: str, token_ids: Sequence[int], exclude=frozenset(), request_id: str = "",
                     lora: str = "", hints: RoutingHints | None = None) -> Selection:
        found = self.candidates(model, exclude)
        return self._selected(found[next(self._counter) % len(found)].instance_id, 0, request_id)


class RandomRouter(Router):
    mode = "random"

    async def select(self, model: str, token_ids: Sequence[int], exclude=frozenset(), request_id: str = "",
                     lora: str = "", hints: RoutingHints | None = None) -> Selection:
        return self._selected(self._rng.choice(self.candidates(model, exclude)).instance_id, 0, request_id)
