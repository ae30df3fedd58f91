"""Discovery over etcd: one lease per process, keys registered on it, and live prefix snapshots.

Contract:
- :class:`Registrar` grants a lease (TTL ``ttl``), refreshes it every ``ttl/3`` and remembers every
  key it put. If the lease is lost (etcd restarted without its data, or the process was cut off
  longer than the TTL) it grants a new lease and puts every key again. A clean shutdown revokes the
  lease, which deletes all keys at once.
- :class:`Snapshot` keeps ``key -> decoded value`` for one prefix from a read plus a watch that
  starts right after the read's revision. After any watch failure it marks itself not ``ready``,
  re-reads the whole prefix (replacing, not merging, so deletes missed meanwhile are seen) and
  watches again. While etcd is unreachable it keeps the last snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import aetcd
import msgspec

from .messages import decode

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_MIN, RETRY_MAX = 0.2, 2.0


def lease_gone(exc: BaseException) -> bool:
    """True for etcd's answer to a put or refresh on a lease it no longer has."""
    return "requested lease not found" in str(exc)


class Registrar:
    """Owns one etcd lease and the keys registered on it."""

    def __init__(self, client: aetcd.Client, ttl: int):
        self._client = client
        self._ttl = ttl
        self._lease: aetcd.Lease | None = None
        self._keys: dict[str, bytes] = {}
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._revoked = False
        self.lease_changes = 0  # how many times the lease was lost and re-granted

    @property
    def lease_id(self) -> int | None:
        return self._lease.id if self._lease else None

    async def start(self) -> None:
        self._lease = await self._client.lease(self._ttl)
        log.info("etcd lease %x granted (ttl %ss)", self._lease.id, self._ttl)
        self._task = asyncio.create_task(self._keep_alive(), name="etcd-lease-keepalive")

    async def put(self, key: str, value: bytes) -> None:
        async with self._lock:
            self._keys[key] = value
            try:
                await self._client.put(key.encode(), value, lease=self._lease)
                return
            except Exception as exc:
                if not lease_gone(exc):
                    raise
        # etcd lost the lease (restarted without its data) before the keep-alive noticed
        log.warning("etcd lease %x is gone; registering again", self._lease.id)
        await self._regrant()  # puts every key, this one included

    async def delete(self, key: str) -> None:
        async with self._lock:
            self._keys.pop(key, None)
            await self._client.delete(key.encode())

    async def revoke(self) -> None:
        """Delete every registered key at once by revoking the lease; idempotent."""
        if self._revoked:
            return
        self._revoked = True
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._lease is not None:
            try:
                await asyncio.wait_for(self._lease.revoke(), timeout=3)
                log.info("etcd lease %x revoked", self._lease.id)
            except Exception as exc:  # etcd down: the lease expires on its own
                log.warning("could not revoke etcd lease %x: %r", self._lease.id, exc)

    async def _keep_alive(self) -> None:
        interval = self._ttl / 3
        while True:
            await asyncio.sleep(interval)
            try:
                reply = await asyncio.wait_for(self._lease.refresh(), timeout=interval)
                if reply is not None and reply.TTL > 0:
                    continue
                log.warning("etcd lease %x is gone; registering again", self._lease.id)
                await self._regrant()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # etcd unreachable: keep trying; once it answers, a lost lease is re-granted.
                log.warning("etcd lease refresh failed: %r", exc)
                await asyncio.sleep(min(1.0, interval))

    async def _regrant(self) -> None:
        async with self._lock:
            self._lease = await self._client.lease(self._ttl)
            for key, value in self._keys.items():
                await self._client.put(key.encode(), value, lease=self._lease)
            self.lease_changes += 1
            log.info("etcd lease %x granted; %d keys registered again", self._lease.id, len(self._keys))


class Snapshot(Generic[T]):
    """A live, decoded view of one etcd prefix."""

    def __init__(self, client: aetcd.Client, prefix: str, type_: type[T]):
        self._client = client
        self._prefix = prefix
        self._type = type_
        self._items: dict[str, T] = {}
        self._task: asyncio.Task | None = None
        self._watch = None
        self._changed = asyncio.Condition()
        self._listeners: list[Callable[[dict[str, T]], None]] = []
        self.ready = asyncio.Event()
        self.syncs = 0  # full reads of the prefix: 1 after start, +1 after every watch failure

    @property
    def prefix(self) -> str:
        return self._prefix

    def items(self) -> dict[str, T]:
        """The current key -> value map (a copy)."""
        return dict(self._items)

    def values(self) -> list[T]:
        return list(self._items.values())

    def add_listener(self, callback: Callable[[dict[str, T]], None]) -> None:
        """Call ``callback(items)`` after every change (synchronously, on the event loop)."""
        self._listeners.append(callback)

    async def start(self, timeout: float = 10.0) -> None:
        self._task = asyncio.create_task(self._run(), name=f"etcd-watch {self._prefix}")
        await asyncio.wait_for(self.ready.wait(), timeout)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._watch is not None:
            try:  # the watch stream may already be gone with etcd: do not wait on it forever
                await asyncio.wait_for(self._watch.cancel(), timeout=2)
            except Exception:
                pass

    async def wait_for(self, predicate: Callable[[dict[str, T]], bool], timeout: float) -> dict[str, T]:
        """Wait until ``predicate(items)`` holds; returns the items then."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self._items)), timeout)
            return dict(self._items)

    async def _notify(self) -> None:
        for callback in self._listeners:
            try:
                callback(self._items)
            except Exception:
                log.exception("snapshot listener failed")
        async with self._changed:
            self._changed.notify_all()

    def _decode(self, key: bytes, value: bytes) -> T | None:
        try:
            return decode(value, self._type)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring undecodable etcd value at %s: %s", key.decode(errors="replace"), exc)
            return None

    async def _run(self) -> None:
        delay = RETRY_MIN
        while True:
            try:
                await self._sync_and_watch()
                delay = RETRY_MIN
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.ready.is_set():
                    log.warning("etcd watch on %s failed (%r); will re-read the prefix", self._prefix, exc)
                self.ready.clear()
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX, delay * 2)

    async def _sync_and_watch(self) -> None:
        result = await self._client.get_prefix(self._prefix.encode())
        revision = result.header.revision
        items = {}
        for kv in result:
            value = self._decode(kv.key, kv.value)
            if value is not None:
                items[kv.key.decode()] = value
        self._items = items
        self.syncs += 1
        self.ready.set()
        await self._notify()
        self._watch = await self._client.watch_prefix(self._prefix.encode(), start_revision=revision + 1)
        async for event in self._watch:
            key = event.kv.key.decode()
            if event.kind == aetcd.EventKind.PUT:
                value = self._decode(event.kv.key, event.kv.value)
                if value is None:
                    continue
                self._items[key] = value
            else:
                self._items.pop(key, None)
            await self._notify()
        raise ConnectionError("etcd watch ended")
