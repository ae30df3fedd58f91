"""Request plane over a real NATS server: streaming, order, errors, cancellation, payload limits."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from runtime import (InstanceGone, InstanceTimeout, InvalidRequest, PayloadTooLarge, PendingBytes, RemoteError, Runtime,
                     ShuttingDown)
from runtime.messages import GenerateRequest, SamplingParams, TokenDelta
from runtime.request_plane import collect

pytestmark = pytest.mark.integration


async def counting_handler(request: GenerateRequest, ctx):
    for i in range(request.sampling.max_tokens):
        yield TokenDelta(token_ids=[i])


async def test_stream_of_1000_frames_arrives_complete_and_in_order(rt):
    await rt.serve("worker", "generate", counting_handler, GenerateRequest)
    client = await rt.client("worker", "generate")
    [inst] = await client.wait_for_instances(1, timeout=5)
    request = GenerateRequest(token_ids=[1], sampling=SamplingParams(max_tokens=1000))
    items = await collect(await client.call(inst.instance_id, request, TokenDelta))
    assert [d.token_ids[0] for d in items] == list(range(1000))


async def test_unread_frames_are_counted_across_streams_and_freed_on_close(rt):
    await rt.serve("worker", "generate", counting_handler, GenerateRequest)
    client = await rt.client("worker", "generate")
    [inst] = await client.wait_for_instances(1, timeout=5)
    pending = PendingBytes(limit=4000)
    over = []
    pending.on_exceeded(lambda: over.append(pending.value))
    request = GenerateRequest(token_ids=[1], sampling=SamplingParams(max_tokens=300))
    streams = [await client.call(inst.instance_id, request, TokenDelta, pending=pending) for _ in range(2)]
    for _ in range(100):  # nobody reads: the frames wait, counted
        await asyncio.sleep(0.02)
        if pending.value > 2 * 4000:
            break
    assert len(over) == 1 and over[0] > 4000 and pending.value > 4000
    first = await streams[0].__anext__()  # reading takes a frame off the count
    assert first.token_ids == [0]
    await streams[0].aclose()
    await streams[1].aclose()
    assert pending.value == 0 and pending.peak > 4000


async def test_a_silent_stream_is_probed_so_a_sigkilled_server_fails_it_at_once(rt, spawn):
    worker = spawn("workers.mock", "--token-latency-ms", "400", "--num-speculative-tokens", "0")
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=30)
    # a live worker slower than the probe interval (0.25 s here) is probed and ignores it: the stream completes
    slow = GenerateRequest(token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=3, ignore_eos=True), model="mock")
    items = await collect(await client.call(inst.instance_id, slow, TokenDelta))
    assert items[-1].finish_reason is not None
    long = GenerateRequest(token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=100, ignore_eos=True), model="mock")
    streams = [await client.call(inst.instance_id, long, TokenDelta) for _ in range(3)]
    for stream in streams:
        await stream.__anext__()
    worker.kill()
    began = time.monotonic()

    async def fails(stream) -> InstanceGone:
        with pytest.raises(InstanceGone) as err:
            async for _ in stream:
                pass
        return err.value

    errors = await asyncio.gather(*(fails(s) for s in streams))
    # every stream of the dead worker, found by one probe, not by the 2.5 s stall
    assert all(e.unreachable and "no responders to a probe" in str(e) for e in errors), errors
    assert time.monotonic() - began < 1.5


async def test_handler_exception_arrives_as_typed_remote_error(rt):
    async def failing(request, ctx):
        yield b"first"
        raise ValueError("boom at step 2")

    async def invalid(request, ctx):
        raise InvalidRequest("max_tokens must be >= 0", field="max_tokens")
        yield b""  # pragma: no cover

    await rt.serve("worker", "fail", failing)
    await rt.serve("worker", "invalid", invalid)
    fail = await rt.client("worker", "fail")
    [inst] = await fail.wait_for_instances(1, timeout=5)
    stream = await fail.call(inst.instance_id, b"x")
    assert await stream.__anext__() == b"first"
    with pytest.raises(RemoteError) as err:
        await stream.__anext__()
    assert err.value.kind == "ValueError" and "boom at step 2" in err.value.message

    inv = await rt.client("worker", "invalid")
    await inv.wait_for_instances(1, timeout=5)
    with pytest.raises(InvalidRequest) as err2:
        await collect(await inv.call(inst.instance_id, b"x"))
    assert err2.value.field == "max_tokens"


async def test_malformed_request_is_a_typed_error(rt):
    await rt.serve("worker", "generate", counting_handler, GenerateRequest)
    client = await rt.client("worker", "generate")
    [inst] = await client.wait_for_instances(1, timeout=5)
    with pytest.raises(InvalidRequest):
        await collect(await client.call(inst.instance_id, b"\x93not-a-request"))


async def test_cancelling_mid_stream_cancels_the_handler(rt):
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(request, ctx):
        started.set()
        try:
            for i in range(10_000):
                yield TokenDelta(token_ids=[i])
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    await rt.serve("worker", "slow", slow)
    client = await rt.client("worker", "slow")
    [inst] = await client.wait_for_instances(1, timeout=5)
    async with await client.call(inst.instance_id, b"", TokenDelta) as stream:
        got = [await stream.__anext__() for _ in range(3)]
    assert [d.token_ids for d in got] == [[0], [1], [2]]
    await asyncio.wait_for(cancelled.wait(), 5)
    await asyncio.sleep(0.1)
    assert rt.in_flight == 0


async def test_oversized_payload_raises_before_sending(rt):
    sent = []

    async def handler(request, ctx):
        sent.append(request)
        yield b"ok"

    await rt.serve("worker", "echo", handler)
    client = await rt.client("worker", "echo")
    [inst] = await client.wait_for_instances(1, timeout=5)
    limit = rt.nc.max_payload
    with pytest.raises(PayloadTooLarge) as err:
        await client.call(inst.instance_id, b"x" * (limit + 1))
    assert err.value.max_payload == limit and err.value.size > limit
    await asyncio.sleep(0.2)
    assert sent == []
    # A payload that fits still works afterwards.
    assert await collect(await client.call(inst.instance_id, b"y" * 1000)) == [b"ok"]


async def test_oversized_response_frame_becomes_an_error_frame(rt):
    async def handler(request, ctx):
        yield b"z" * (rt.nc.max_payload + 10)

    await rt.serve("worker", "big", handler)
    client = await rt.client("worker", "big")
    [inst] = await client.wait_for_instances(1, timeout=5)
    with pytest.raises(RemoteError) as err:
        await collect(await client.call(inst.instance_id, b""))
    assert err.value.kind == "payload_too_large"


async def test_unknown_instance_is_reported_by_name(rt):
    client = await rt.client("worker", "nobody")
    with pytest.raises(InstanceGone) as err:
        await collect(await client.call("deadbeef00000000", b""))
    assert err.value.instance_id == "deadbeef00000000"


async def test_silent_instance_times_out_naming_it(runtime_config):
    # A raw NATS subscriber that swallows requests and probes (a hung process: its subscriptions live
    # on in the server), so no "no responders", but never acks.
    import dataclasses

    from runtime.names import control_subject

    cfg = dataclasses.replace(runtime_config, ack_timeout=1.0)
    async with Runtime.connect(cfg) as rt:
        async def swallow(msg):
            pass

        subs = [await rt.nc.subscribe(f"{cfg.namespace}.worker.mute.cafe000000000000", cb=swallow),
                await rt.nc.subscribe(control_subject(cfg.namespace, "cafe000000000000"), cb=swallow)]
        client = await rt.client("worker", "mute")
        with pytest.raises(InstanceTimeout) as err:
            await collect(await client.call("cafe000000000000", b""))
        assert err.value.instance_id == "cafe000000000000"
        for sub in subs:
            await sub.unsubscribe()


async def test_a_request_sent_to_an_instance_that_died_meanwhile_fails_at_the_first_probe(runtime_config):
    # The request reached a subscriber that then vanished without answering (a process killed right
    # after NATS delivered it): no "no responders" for the request itself, but the probe of its
    # silent stream finds nobody, long before the acknowledgement timeout.
    import dataclasses

    cfg = dataclasses.replace(runtime_config, ack_timeout=30.0)
    async with Runtime.connect(cfg) as rt:
        async def swallow(msg):
            pass

        sub = await rt.nc.subscribe(f"{cfg.namespace}.worker.mute.dead000000000000", cb=swallow)
        client = await rt.client("worker", "mute")
        started = time.monotonic()
        stream = await client.call("dead000000000000", b"")
        await sub.unsubscribe()
        with pytest.raises(InstanceGone) as err:
            await collect(stream)
        assert err.value.unreachable and time.monotonic() - started < 5.0


async def test_a_drain_that_times_out_ends_its_streams_with_a_shutting_down_frame(runtime_config, rt):
    # The stream outlives the server's drain: at the timeout it must end with an ERROR frame
    # (shutting_down, which the frontend migrates on) at once, not go silent until a probe or the
    # stall timeout finds the instance gone.
    async def endless(request, ctx):
        i = 0
        while True:
            yield TokenDelta(token_ids=[i])
            i += 1
            await asyncio.sleep(0.02)

    serving, stop = asyncio.Event(), asyncio.Event()

    async def server() -> None:  # leaving the block closes the runtime: deregister, drain, close
        async with Runtime.connect(dataclasses.replace(runtime_config, drain_timeout=0.3)) as srv:
            await srv.serve("worker", "generate", endless, GenerateRequest)
            serving.set()
            await stop.wait()

    closing = asyncio.create_task(server())
    await serving.wait()
    client = await rt.client("worker", "generate")
    [inst] = await client.wait_for_instances(1, timeout=5)
    stream = await client.call(inst.instance_id, GenerateRequest(token_ids=[1]), TokenDelta)
    assert (await stream.__anext__()).token_ids == [0]
    stop.set()
    started = time.monotonic()
    with pytest.raises(ShuttingDown, match="drain timed out"):
        async for _ in stream:
            pass
    ended = time.monotonic() - started
    await closing
    assert 0.3 <= ended < 0.3 + 0.2, ended
