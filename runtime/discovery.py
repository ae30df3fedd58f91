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
- etcd that comes back without its data (killed, data directory lost, started again: its revision
  went back) has lost every live process's registration, not only dead ones'. Entries missing from
  that first read are then held for ``hold`` seconds, or until their key is written or deleted again:
  the processes behind them re-register at their next lease refresh, and meanwhile stay routable.
  A process that died in the outage is found by the request plane (NATS has no responders for it),
  which drops its held entries (:meth:`Snapshot.drop_held`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import aetcd
import msgspec
from tenacity import AsyncRetrying, RetryCallState, wait_exponential

from .messages import decode

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_MIN, RETRY_MAX = 0.2, 2.0
# How long entries etcd lost with its data stay in a snapshot unless written again: longer than a
# process takes to notice that its lease is gone (a third of a default 10 s TTL) and register again.
DATA_LOSS_HOLD_S = 30.0


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
        while not self._revoked:
            await asyncio.sleep(interval)
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that lands as the
                # refresh returns, and this loop would outlive revoke(), which waits for it (a close that
                # never ends). The loop's condition ends it too, should a library swallow the cancel.
                async with asyncio.timeout(interval):
                    reply = await self._lease.refresh()
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

    def __init__(self, client: aetcd.Client, prefix: str, type_: type[T], hold: float = DATA_LOSS_HOLD_S):
        self._client = client
        self._prefix = prefix
        self._type = type_
        self._hold = hold
        self._items: dict[str, T] = {}
        self._held: dict[str, float] = {}  # key -> when it expires (monotonic): kept across an etcd data loss
        self._expiry: asyncio.TimerHandle | None = None
        self._revision = 0  # the newest etcd revision seen; a read below it means etcd lost its data
        self._term = 0
        self._task: asyncio.Task | None = None
        self._watch = None
        self._stopped = False
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

    def held(self) -> list[str]:
        """Keys kept from before etcd lost its data that have not been written again yet."""
        return list(self._held)

    def drop_held(self, instance_id: str) -> int:
        """Drop the held entries of ``instance_id`` (keys end with it): the request plane found the
        process gone. Returns how many were dropped."""
        gone = [k for k in self._held if k.rsplit("/", 1)[-1] == instance_id]
        for key in gone:
            del self._held[key]
            self._items.pop(key, None)
        if gone:
            asyncio.ensure_future(self._notify())
        return len(gone)

    def add_listener(self, callback: Callable[[dict[str, T]], None]) -> None:
        """Call ``callback(items)`` after every change (synchronously, on the event loop)."""
        self._listeners.append(callback)

    async def start(self, timeout: float = 10.0) -> None:
        self._task = asyncio.create_task(self._run(), name=f"etcd-watch {self._prefix}")
        await asyncio.wait_for(self.ready.wait(), timeout)

    async def stop(self) -> None:
        self._stopped = True
        if self._expiry is not None:
            self._expiry.cancel()
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
        retrying = AsyncRetrying(wait=wait_exponential(RETRY_MIN, max=RETRY_MAX), before_sleep=self._watch_failed)
        # a watch that ends is re-read at once; one that fails, after a backoff (from RETRY_MIN again)
        while not self._stopped:
            await retrying(self._sync_and_watch)

    def _watch_failed(self, retry_state: RetryCallState) -> None:
        if self.ready.is_set():
            log.warning("etcd watch on %s failed (%r); will re-read the prefix", self._prefix,
                        retry_state.outcome.exception())
        self.ready.clear()

    async def _sync_and_watch(self) -> None:
        result = await self._client.get_prefix(self._prefix.encode())
        revision, term = result.header.revision, result.header.raft_term
        items = {}
        for kv in result:
            value = self._decode(kv.key, kv.value)
            if value is not None:
                items[kv.key.decode()] = value
        data_lost = revision < self._revision or term < self._term
        kept = self._carry_held(items, data_lost)
        if kept:
            log.warning("etcd came back without its data (revision %d, was %d): keeping %d entries under %s for up "
                        "to %.0fs while they register again", revision, self._revision, kept, self._prefix, self._hold)
        elif data_lost:  # everything under the prefix registered again before this re-read: nothing to hold
            log.warning("etcd came back without its data (revision %d, was %d); every entry under %s is back",
                        revision, self._revision, self._prefix)
        self._revision, self._term = revision, term
        self._items = items
        self.syncs += 1
        self.ready.set()
        await self._notify()
        self._watch = await self._client.watch_prefix(self._prefix.encode(), start_revision=revision + 1)
        if self._stopped:  # aetcd waits for the watch with Python 3.11's wait_for, which swallows a cancel
            return  # that lands as the watch is created: this task would then wait on it for ever
        async for event in self._watch:
            key = event.kv.key.decode()
            self._revision = max(self._revision, event.kv.mod_revision)
            self._held.pop(key, None)  # written or deleted since: etcd knows about it again
            if event.kind == aetcd.EventKind.PUT:
                value = self._decode(event.kv.key, event.kv.value)
                if value is None:
                    continue
                self._items[key] = value
            else:
                self._items.pop(key, None)
            await self._notify()
        raise ConnectionError("etcd watch ended")

    def _carry_held(self, items: dict[str, T], data_lost: bool) -> int:
        """Add to a fresh read ``items`` the entries held across a data loss (new ones when
        ``data_lost``: every entry the read lacks), dropping those expired or read again; returns
        how many were newly held."""
        now = time.monotonic()
        missing = [k for k in self._items if k not in items and k not in self._held] if data_lost else []
        for key in missing:
            self._held[key] = now + self._hold
        for key, until in list(self._held.items()):
            if key in items or until <= now or key not in self._items:
                del self._held[key]
            else:
                items[key] = self._items[key]
        self._schedule_expiry()
        return len(missing)

    def _schedule_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._held:
            delay = max(0.0, min(self._held.values()) - time.monotonic()) + 0.01
            self._expiry = asyncio.get_running_loop().call_later(delay, self._expire_held)

    def _expire_held(self) -> None:
        self._expiry = None
        now = time.monotonic()
        expired = [k for k, until in self._held.items() if until <= now]
        for key in expired:
            del self._held[key]
            self._items.pop(key, None)
        if expired:
            log.info("%d entries under %s held since etcd lost its data did not register again: dropped",
                     len(expired), self._prefix)
            asyncio.ensure_future(self._notify())
        self._schedule_expiry()
