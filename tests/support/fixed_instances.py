"""A fixed set of instance records standing in for a live etcd view (``runtime.discovery.Snapshot``),
for unit tests of code that reads one (the dispatcher); the real snapshot is tested against etcd."""

from __future__ import annotations

import asyncio


class FixedSnapshot:
    """The records given, never changing: listeners are never called, waits time out."""

    def __init__(self, records=()):
        self.records = list(records)

    def values(self) -> list:
        return list(self.records)

    def add_listener(self, callback) -> None:
        pass

    async def wait_for(self, predicate, timeout: float):
        if not predicate({r.instance_id: r for r in self.records}):
            await asyncio.sleep(timeout)
            raise asyncio.TimeoutError
        return {r.instance_id: r for r in self.records}
