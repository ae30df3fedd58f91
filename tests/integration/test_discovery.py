"""Registration against a real etcd when the lease disappears under it (etcd restarted without its
data, or the lease revoked by someone else) before the keep-alive notices."""

from __future__ import annotations

import pytest

from runtime.request_plane import collect

pytestmark = pytest.mark.integration


async def _ping(request, ctx):
    yield b"pong"


async def test_a_registration_on_a_lost_lease_grants_a_new_one_and_registers_everything(rt):
    await rt.serve("first", "ping", _ping)
    registrar = rt._registrar
    lost = registrar.lease_id
    await rt.etcd.revoke_lease(lost)  # the lease is gone; the keep-alive has not looked yet (ttl / 3)
    await rt.serve("second", "ping", _ping)  # used to fail: "etcdserver: requested lease not found"
    assert registrar.lease_id != lost and registrar.lease_changes == 1
    for component in ("first", "second"):  # the earlier key is back too, on the new lease
        client = await rt.client(component, "ping")
        [inst] = await client.wait_for_instances(1, timeout=10)
        assert await collect(await client.call(inst.instance_id, b"")) == [b"pong"]
