"""A runtime's close ends every task it started, whatever moment it lands on (real etcd and NATS).

Close cancels the lease keep-alive and each snapshot's watch task once. Under Python 3.11's
``asyncio.wait_for``, a cancel that arrives after the awaited call finished but before the waiting
task resumed is swallowed: ``wait_for`` returns the result instead. A task that loops on such a call
then runs for ever, and close, which waits for it, never returns (a worker that never exits on
SIGTERM). These tests land the cancel in exactly that window, with the awaited call a real one,
and bound the close so that a hang fails instead of waiting for pytest's timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from runtime import Runtime
from runtime.discovery import Snapshot
from runtime.etcd import EtcdClient
from runtime.messages import InstanceRecord
from runtime.names import instances_prefix

pytestmark = pytest.mark.integration

CLOSE_BOUND_S = 10.0  # a close takes milliseconds here; a hung one never ends


async def registered(etcd: EtcdClient, namespace: str) -> list[bytes]:
    return [kv.key for kv in await etcd.get_prefix(instances_prefix(namespace).encode())]


async def test_close_as_a_lease_refresh_returns_ends(runtime_config):
    cfg = dataclasses.replace(runtime_config, lease_ttl=2)  # a refresh every 2/3 s
    refreshed = asyncio.Event()

    async def open_then_close() -> asyncio.Task:
        async with Runtime.connect(cfg) as rt:
            await rt.register("worker", "generate")
            assert len(await registered(rt.etcd, cfg.namespace)) == 1
            real_refresh = rt.etcd.refresh_lease

            async def refresh_lease(lease_id):
                reply = await real_refresh(lease_id)  # etcd answered
                refreshed.set()  # wakes this task on the loop's next turn: the close lands as the refresh returns
                return reply

            rt.etcd.refresh_lease = refresh_lease
            await refreshed.wait()  # awaited directly: a wait_for here would resume a turn too late
            keep_alive = rt._registrar._task
        return keep_alive  # leaving the block closed the runtime: its first step cancels the keep-alive

    keep_alive = await asyncio.wait_for(open_then_close(), CLOSE_BOUND_S)
    assert keep_alive.done()
    etcd = EtcdClient(*cfg.etcd_host_port, cfg.etcd_security())
    try:  # the close went on to revoke the lease: the instance is gone at once
        assert await registered(etcd, cfg.namespace) == []
    finally:
        await etcd.close()


async def test_stopping_a_snapshot_as_its_watch_is_created_ends(rt):
    prefix = instances_prefix(rt.namespace)
    snapshot: Snapshot[InstanceRecord] = Snapshot(rt.etcd, prefix, InstanceRecord)
    watcher = rt.etcd._watcher  # aetcd's one watch stream of this client
    real_handle = watcher._handle_response
    created = asyncio.Event()

    async def handle_response(response):
        await real_handle(response)  # a "created" answer wakes the snapshot's task, waiting for its watch
        if response.created:
            created.set()  # wakes the test on the loop's next turn, before that task resumes

    watcher._handle_response = handle_response

    async def start_then_stop() -> None:
        await snapshot.start()
        await created.wait()  # awaited directly: a wait_for here would resume a turn too late
        await snapshot.stop()

    await asyncio.wait_for(start_then_stop(), CLOSE_BOUND_S)
    assert snapshot._task.done() and snapshot.syncs == 1
