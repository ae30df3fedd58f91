"""Snapshots across etcd restarts (real etcd): after a restart that lost the data, entries the first
read lacks are held until written again or for ``hold`` seconds; after a restart that kept the data,
a key deleted meanwhile is gone at once (nothing is held)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from runtime.discovery import Snapshot
from runtime.etcd import EtcdClient
from runtime.messages import InstanceRecord, encode
from tests.support.servers import EtcdServer
from tests.support.wait import eventually

pytestmark = pytest.mark.integration

PREFIX = "tandem/loss/instances/"


def record(name: str) -> bytes:
    return encode(InstanceRecord(instance_id=name, namespace="loss", component="target", endpoint="generate",
                                  subject=f"loss.{name}"))


async def restart(etcd: EtcdServer, wipe: bool) -> None:
    await asyncio.to_thread(etcd.stop, True)
    if wipe:
        etcd.wipe()
    await asyncio.to_thread(etcd.start)


@contextlib.asynccontextmanager
async def watching_a_and_b(hold: float, other_writes: int = 0):
    """A fresh etcd with instances "a" and "b" (and ``other_writes`` writes of another key after
    them), and a started snapshot of the prefix that lists both; yields the server, a client and the
    snapshot, and tears all three down."""
    etcd = EtcdServer()
    etcd.start()
    client = EtcdClient("127.0.0.1", etcd.port, timeout=2)
    snap: Snapshot[InstanceRecord] = Snapshot(client, PREFIX, InstanceRecord, hold=hold)
    try:
        await client.connect()
        for name in ("a", "b"):
            await client.put((PREFIX + name).encode(), record(name))
        for i in range(other_writes):
            await client.put(b"tandem/loss/other", str(i).encode())
        await snap.start()
        await snap.wait_for(lambda items: len(items) == 2, 5)
        yield etcd, client, snap
    finally:
        await snap.stop()
        await client.close()
        etcd.cleanup()


async def test_entries_lost_with_the_data_are_held_until_written_again_or_expired():
    # 20 other writes: a revision well above what the empty etcd starts from
    async with watching_a_and_b(hold=3.0, other_writes=20) as (etcd, client, snap):
        syncs = snap.syncs
        await restart(etcd, wipe=True)
        await eventually(lambda: snap.syncs > syncs, timeout=15, what="a resync after the wipe")
        assert sorted(r.instance_id for r in snap.values()) == ["a", "b"] and sorted(snap.held()) == [PREFIX + "a",
                                                                                                  PREFIX + "b"]
        await client.put((PREFIX + "a").encode(), record("a"))  # "a" registers again: no longer held
        await eventually(lambda: snap.held() == [PREFIX + "b"], timeout=15, what=lambda: f"only b held (held: {snap.held()})")
        await eventually(lambda: [r.instance_id for r in snap.values()] == ["a"], timeout=6, what="b expired")
        assert snap.held() == []
        # held again after a second wipe, then found gone by the request plane
        await client.put((PREFIX + "b").encode(), record("b"))
        await eventually(lambda: len(snap.values()) == 2, timeout=15, what="b registered again")
        syncs = snap.syncs
        await restart(etcd, wipe=True)
        await eventually(lambda: snap.syncs > syncs and len(snap.held()) == 2, timeout=15,
                         what=lambda: f"a resync holding both (held: {snap.held()})")
        assert snap.drop_held("b") == 1
        assert [r.instance_id for r in snap.values()] == ["a"] and snap.held() == [PREFIX + "a"]


async def test_a_restart_that_kept_the_data_holds_nothing():
    async with watching_a_and_b(hold=30.0) as (etcd, client, snap):
        await restart(etcd, wipe=False)
        await client.delete((PREFIX + "b").encode())  # gone while the watch was down, or right after
        await eventually(lambda: [r.instance_id for r in snap.values()] == ["a"], timeout=15,
                         what=lambda: f"only a listed (listed: {[r.instance_id for r in snap.values()]})")
        assert snap.held() == []
