"""Event plane: typed publish/subscribe over NATS on ``{ns}.{topic}``.

Events are fire-and-forget: a subscriber that is not connected misses them. Publishers that need
late subscribers to catch up publish cumulative state (spec stats) or answer dump requests (KV).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec
from nats.aio.client import Client as NATS

from .errors import PayloadTooLarge
from .messages import decode, encode
from .names import event_subject

log = logging.getLogger(__name__)

T = TypeVar("T")

TOPIC_KV = "kv_events"
TOPIC_KV_DUMP = "kv_dump"
TOPIC_LOAD = "load"
TOPIC_SPEC_STATS = "spec_stats"


class Subscription(Generic[T]):
    """Decoded events of one topic, as an async iterator or through a callback."""

    def __init__(self, type_: type[T], callback: Callable[[T], None] | None):
        self._type = type_
        self._callback = callback
        self._queue: asyncio.Queue[T] = asyncio.Queue()
        self._sub = None

    async def _on_msg(self, msg) -> None:
        try:
            event = decode(msg.data, self._type)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring undecodable %s on %s: %s", self._type.__name__, msg.subject, exc)
            return
        if self._callback is None:
            self._queue.put_nowait(event)
            return
        try:
            self._callback(event)
        except Exception:
            log.exception("event callback for %s failed", msg.subject)

    def __aiter__(self):
        return self

    async def __anext__(self) -> T:
        return await self._queue.get()

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
            self._sub = None


class EventPlane:
    def __init__(self, nc: NATS, namespace: str):
        self._nc = nc
        self._ns = namespace

    async def publish(self, topic: str, event) -> None:
        data = encode(event)
        if len(data) > self._nc.max_payload:
            raise PayloadTooLarge(len(data), self._nc.max_payload)
        await self._nc.publish(event_subject(self._ns, topic), data)

    async def subscribe(self, topic: str, type_: type[T], callback: Callable[[T], None] | None = None) -> Subscription[T]:
        """Subscribe to ``topic``; events arrive through ``callback`` if given, else by iterating."""
        sub: Subscription[T] = Subscription(type_, callback)
        sub._sub = await self._nc.subscribe(event_subject(self._ns, topic), cb=sub._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
        await self._nc.flush()
        return sub
