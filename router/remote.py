"""A router shared by several frontends: the ``router.select`` service and its client.

Contract:
- :class:`RouterService` serves ``router.select``: a :class:`RouteRequest` in, exactly one
  :class:`RouteResponse` out (or a typed error: ``no_instances`` when no target serves the model,
  ``invalid_request`` with a field for bad input). The response's ``ticket`` names the selection.
- A frontend ends a selection by publishing :class:`RouteRelease` (``router_id`` and tickets) on the
  event topic :data:`TOPIC_ROUTE_RELEASE`; the service that made it releases it in its router, so the
  in-flight accounting covers every frontend. Selections never released expire after ``ttl``.
- :class:`RemoteRouter` is the client with the :class:`router.base.Router` interface; releases are
  batched, one message per router instance per event-loop turn. With a ``fallback`` router it never
  depends on the service alone: when no router instance is registered, or none answers (gone, stuck,
  all recently failed), the fallback routes in this process until a router instance answers again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from runtime import InstanceGone, InstanceTimeout, InvalidRequest, NoInstances, RemoteError
from runtime.messages import RouteRelease, RouteRequest, RouteResponse, RoutingHints
from runtime.request_plane import collect

from .base import Router, Selection

log = logging.getLogger(__name__)

TOPIC_ROUTE_RELEASE = "route_release"
COMPONENT, ENDPOINT = "router", "select"


class RouterService:
    """The ``router.select`` handler over a local router; plain values in."""

    def __init__(self, router: Router, router_id: str, ttl: float = 600.0):
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        self.router = router
        self.router_id = router_id
        self.ttl = ttl
        self._outstanding: dict[int, tuple[Selection, float]] = {}

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    async def select(self, request: RouteRequest, ctx):
        """Choose an instance for ``request``; yields one :class:`RouteResponse`."""
        if not request.model:
            raise InvalidRequest("model must be set", field="model")
        if request.token_ids and not (0 <= min(request.token_ids) and max(request.token_ids) < 2**32):
            raise InvalidRequest("token ids must be integers in [0, 2**32)", field="token_ids")
        selection = await self.router.select(request.model, request.token_ids, frozenset(request.exclude),
                                             request.request_id or ctx.request_id, request.lora, request.hints)
        self._outstanding[selection.ticket] = (selection, time.monotonic())
        yield RouteResponse(selection.instance_id, selection.overlap_blocks, selection.ticket, self.router_id)

    def on_release(self, message: RouteRelease) -> None:
        if message.router_id != self.router_id:
            return
        for ticket in message.tickets:
            item = self._outstanding.pop(ticket, None)
            if item is not None:
                self.router.release(item[0])

    def expire(self, now: float | None = None) -> int:
        """Release selections older than ``ttl`` (their frontend never released them)."""
        now = time.monotonic() if now is None else now
        old = [t for t, (_, since) in self._outstanding.items() if now - since >= self.ttl]
        for ticket in old:
            selection, _ = self._outstanding.pop(ticket)
            log.warning("selection %d (%s) was never released; releasing it", ticket, selection.instance_id)
            self.router.release(selection)
        return len(old)


class RemoteRouter(Router):
    """The :class:`Router` interface over the shared ``router.select`` service."""

    mode = "remote"

    def __init__(self, client, publish: Callable[[str, object], Awaitable[None]], timeout: float = 2.0,
                 suspect_for: float = 10.0, fallback: Router | None = None):
        """``timeout``: seconds to wait for one router instance's answer before asking the next;
        an instance that failed is asked last for ``suspect_for`` seconds, and not at all while a
        ``fallback`` (an in-process router) can answer instead."""
        if timeout <= 0 or suspect_for < 0:
            raise ValueError("timeout must be > 0 and suspect_for >= 0")
        super().__init__(lambda model: [])
        self.fallback = fallback
        self.fallbacks = 0  # selections the fallback made
        self._falling_back = False
        self._client = client
        self._publish = publish
        self.timeout = timeout
        self.suspect_for = suspect_for
        self._suspects: dict[str, float] = {}  # instance id -> when it last failed
        self._next = itertools.count()
        self._pending: dict[str, list[int]] = {}
        self._flush_handle: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    async def create(cls, rt, fallback: Router | None = None, **options) -> RemoteRouter:
        if options:
            raise ValueError(f"a remote router takes no options (the service has them), got {sorted(options)}")
        return cls(await rt.client(COMPONENT, ENDPOINT), rt.publish, fallback=fallback)

    def _order(self) -> list[str]:
        """Live router instances, round robin, recently failed ones last (left out when a fallback
        can answer instead)."""
        ids = [r.instance_id for r in self._client.instances()]
        start = next(self._next) % len(ids) if ids else 0
        ids = ids[start:] + ids[:start]
        now = time.monotonic()
        self._suspects = {i: t for i, t in self._suspects.items() if now - t < self.suspect_for}
        if self.fallback is not None:
            ids = [i for i in ids if i not in self._suspects]
        if not ids and self.fallback is None:
            raise NoInstances(COMPONENT, ENDPOINT)
        return sorted(ids, key=lambda i: i in self._suspects)

    async def start(self) -> None:
        if self.fallback is not None:
            await self.fallback.start()

    async def _fall_back(self, model: str, token_ids: Sequence[int], exclude, request_id: str,
                         why: str, lora: str = "", hints: RoutingHints | None = None) -> Selection:
        if not self._falling_back:
            self._falling_back = True
            log.warning("the router service is unreachable (%s): routing in this process (%s) until it answers",
                        why, self.fallback.mode)
        self.fallbacks += 1
        selection = await self.fallback.select(model, token_ids, exclude, request_id, lora, hints)
        return selection  # router_id "": released in the fallback

    async def _ask(self, instance_id: str, request: RouteRequest) -> RouteResponse:
        stream = await self._client.call(instance_id, request, RouteResponse)
        try:
            [response] = await asyncio.wait_for(collect(stream), self.timeout)
        except asyncio.TimeoutError:
            await stream.aclose()
            raise InstanceTimeout(instance_id, self.timeout) from None
        return response

    async def select(self, model: str, token_ids: Sequence[int], exclude=frozenset(), request_id: str = "",
                     lora: str = "", hints: RoutingHints | None = None) -> Selection:
        request = RouteRequest(model, list(token_ids), sorted(exclude), request_id, lora, hints)
        error: Exception | None = None
        order = self._order()
        if not order:
            return await self._fall_back(model, token_ids, exclude, request_id, "no router instance", lora, hints)
        for instance_id in order:  # a router instance that is gone or stuck: ask the next one
            try:
                response = await self._ask(instance_id, request)
                break
            except (InstanceGone, InstanceTimeout) as exc:
                log.warning("router %s did not answer (%s); trying another", instance_id, exc)
                self._suspects[instance_id] = time.monotonic()
                error = exc
            except RemoteError as exc:
                if exc.kind == NoInstances.kind:
                    raise NoInstances("target", "generate", model) from None
                raise
        else:
            if self.fallback is not None:
                return await self._fall_back(model, token_ids, exclude, request_id, str(error), lora, hints)
            raise error
        if self._falling_back:
            self._falling_back = False
            log.info("the router service answers again: routing through it")
        self.in_flight[response.instance_id] = self.in_flight.get(response.instance_id, 0) + 1
        return Selection(response.instance_id, response.overlap_blocks, request_id, response.ticket, response.router_id)

    def release(self, selection: Selection) -> None:
        if not selection.router_id and self.fallback is not None:  # made in this process
            self.fallback.release(selection)
            return
        super().release(selection)
        self._pending.setdefault(selection.router_id, []).append(selection.ticket)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        pending, self._pending = self._pending, {}
        for router_id, tickets in pending.items():
            task = asyncio.ensure_future(self._send(RouteRelease(router_id, tickets)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, message: RouteRelease) -> None:
        try:
            await self._publish(TOPIC_ROUTE_RELEASE, message)
        except Exception as exc:  # the service expires what it never hears about
            log.warning("could not release %d selections at router %s: %r", len(message.tickets), message.router_id, exc)

    async def stop(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.fallback is not None:
            await self.fallback.stop()
