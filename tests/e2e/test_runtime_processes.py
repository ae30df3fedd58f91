"""The runtime with real worker processes: discovery, kill -9, SIGTERM drain, NATS and etcd restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time

import pytest

from runtime import Runtime
from runtime.messages import GenerateRequest, SamplingParams, TokenDelta
from runtime.request_plane import collect
from tests.support.servers import EtcdServer, NatsServer, env_for

pytestmark = pytest.mark.e2e

PROMPT = list(range(100, 140))


def mock_args(*extra: str) -> list[str]:
    return ["--lease-ttl", "3", "--stats-interval", "0.2", *extra]


async def wait_gone(client, instance_id: str, timeout: float) -> float:
    start = time.monotonic()
    await client.snapshot.wait_for(lambda items: all(r.instance_id != instance_id for r in items.values()), timeout)
    return time.monotonic() - start


async def test_instance_appears_and_disappears_within_ttl_after_kill_9(rt, spawn):
    client = await rt.client("target", "generate")
    proc = spawn("workers.mock", *mock_args())
    [inst] = await client.wait_for_instances(1, timeout=60)
    assert inst.pid == proc.pid and inst.role == "target" and inst.model == "mock"
    models = await rt.models()
    await models.wait_for(lambda cards: any(c.instance_id == inst.instance_id for c in cards.values()), 5)
    proc.kill()
    elapsed = await wait_gone(client, inst.instance_id, timeout=10)
    assert elapsed <= 3 + 1.5  # lease TTL plus etcd's expiry granularity
    await models.wait_for(lambda cards: all(c.instance_id != inst.instance_id for c in cards.values()), 1)


async def test_sigterm_deregisters_at_once_and_finishes_in_flight_streams(rt, spawn):
    client = await rt.client("target", "generate")
    proc = spawn("workers.mock", *mock_args("--token-latency-ms", "50", "--num-speculative-tokens", "0"))
    [inst] = await client.wait_for_instances(1, timeout=60)
    request = GenerateRequest(PROMPT, SamplingParams(temperature=0, max_tokens=40))
    stream = await client.call(inst.instance_id, request, TokenDelta)
    first = await stream.__anext__()
    proc.signal(signal.SIGTERM)
    elapsed = await wait_gone(client, inst.instance_id, timeout=5)
    assert elapsed < 1.0
    rest = [d async for d in stream]
    tokens = first.token_ids + [t for d in rest for t in d.token_ids]
    assert len(tokens) == 40 and rest[-1].finish_reason == "length"
    assert await asyncio.to_thread(proc.wait, 20) == 0
    assert "draining" in proc.logs()


async def test_nats_restart_reconnects_and_serves_again(etcd_server, namespace, spawn):
    nats_ = NatsServer()
    nats_.start()
    try:
        env = env_for(etcd_server, nats_, namespace)
        spawn("workers.mock", *mock_args("--token-latency-ms", "0"), env=env)
        cfg = dataclasses.replace(_config(etcd_server.url, nats_.url, namespace), ack_timeout=2)
        async with Runtime.connect(cfg) as rt:
            client = await rt.client("target", "generate")
            [inst] = await client.wait_for_instances(1, timeout=60)
            request = GenerateRequest(PROMPT, SamplingParams(temperature=0, max_tokens=5))
            before = await collect(await client.call(inst.instance_id, request, TokenDelta))
            assert sum(len(d.token_ids) for d in before) == 5 and before[-1].finish_reason == "length"
            await asyncio.to_thread(nats_.restart)
            deadline = time.monotonic() + 20
            while True:
                try:
                    got = await collect(await client.call(inst.instance_id, request, TokenDelta))
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.3)
            # the same greedy tokens as before the restart
            assert [t for d in got for t in d.token_ids] == [t for d in before for t in d.token_ids]
    finally:
        nats_.cleanup()


async def test_etcd_restart_with_data_loss_registrations_come_back(nats_server, namespace, spawn):
    etcd = EtcdServer()
    etcd.start()
    try:
        env = env_for(etcd, nats_server, namespace)
        proc = spawn("workers.mock", *mock_args(), env=env)
        async with Runtime.connect(_config(etcd.url, nats_server.url, namespace)) as rt:
            client = await rt.client("target", "generate")
            [inst] = await client.wait_for_instances(1, timeout=60)
            syncs = client.snapshot.syncs
            etcd.stop(kill=True)
            etcd.wipe()
            await asyncio.sleep(1)
            await asyncio.to_thread(etcd.start)
            # The worker's lease is gone with the data: it must register again, and our snapshot
            # must re-read the prefix after its watch broke.
            deadline = time.monotonic() + 30
            while client.snapshot.syncs == syncs:
                assert time.monotonic() < deadline, "snapshot never re-read the prefix"
                await asyncio.sleep(0.1)
            # Until it has, its entry is held from before the wipe (it is alive and reachable over NATS).
            await client.snapshot.wait_for(lambda items: any(r.pid == proc.pid for r in items.values())
                                           and not client.snapshot.held(), 30)
            await asyncio.sleep(0.5)
            assert client.snapshot.ready.is_set()
            assert "registering again" in proc.logs()
            # Our own runtime registered nothing, but a fresh registration of ours works too.
            await rt.serve("probe", "ping", _ping)
            probe = await rt.client("probe", "ping")
            [p] = await probe.wait_for_instances(1, timeout=10)
            assert await collect(await probe.call(p.instance_id, b"")) == [b"pong"]
    finally:
        etcd.cleanup()


async def _ping(request, ctx):
    yield b"pong"


def _config(etcd_url: str, nats_url: str, namespace: str):
    from runtime import RuntimeConfig

    return RuntimeConfig(etcd_url=etcd_url, nats_url=nats_url, namespace=namespace, lease_ttl=3,
                         ack_timeout=5, heartbeat_interval=0.5, handle_signals=False)


def _start_failure(args: list[str], env: dict, module: str = "workers.mock") -> tuple[int, str, float]:
    import subprocess
    import sys

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


@pytest.mark.parametrize("missing", ["nats", "etcd"])
def test_an_unreachable_nats_or_etcd_is_one_line_and_exit_1_at_once_when_refused(etcd_server, nats_server, missing):
    from deploy.binaries import free_port

    dead = free_port()
    env = env_for(etcd_server, nats_server, "startfail")
    if missing == "nats":
        env["TANDEM_NATS"] = f"nats://127.0.0.1:{dead}"
    else:
        env["TANDEM_ETCD"] = f"http://127.0.0.1:{dead}"
    code, output, seconds = _start_failure(["--connect-timeout", "20"], env)
    assert code == 1
    assert f"cannot reach {'NATS' if missing == 'nats' else 'etcd'} at " in output and f"127.0.0.1:{dead}" in output
    assert "connection refused" in output and "Traceback" not in output and "TimeoutError" not in output
    assert seconds < 5  # refused is final: no waiting for the connect timeout


def test_a_frontend_on_a_taken_port_is_one_line_and_exit_1(etcd_server, nats_server):
    import socket

    env = env_for(etcd_server, nats_server, "portfail")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output, _ = _start_failure(["--http-port", str(port)], env, module="frontend")
    assert code == 1 and f"cannot listen for HTTP on 127.0.0.1:{port}" in output
    assert "Traceback" not in output and "Errno" not in output
