"""The KV router against 3 real mock worker processes over real etcd and NATS.

Requests sharing a long prefix go to the worker that holds it (and hit its cache); a burst spreads once
that worker is loaded; a worker that leaves is never chosen again; a router that starts late recovers
the index from the workers' dumps.
"""

from __future__ import annotations

import asyncio

import pytest

from router import create_router
from runtime.events import TOPIC_KV, TOPIC_KV_DUMP
from runtime.kv_hash import block_hashes
from runtime.messages import GenerateRequest, KvDumpRequest, KvEvent, SamplingParams, TokenDelta
from runtime.request_plane import collect
from tests.support.wait import eventually

pytestmark = pytest.mark.integration

PREFIX = list(range(1000, 1512))  # 32 blocks of 16
PREFIX_HASHES = block_hashes(PREFIX, 16)


def prompt(i: int) -> list[int]:
    return PREFIX + [5000 + 37 * i + k for k in range(40)]  # 2 more full blocks and a partial one


async def start_workers(rt, spawn, n: int, *extra: str):
    procs = [spawn("workers.mock", "--lease-ttl", "3", "--stats-interval", "0.2", "--num-speculative-tokens", "0",
                   *extra, name=f"mock{i}") for i in range(n)]
    client = await rt.client("target", "generate")
    records = await client.wait_for_instances(n, timeout=60)
    by_pid = {p.pid: p for p in procs}
    return client, {r.instance_id: by_pid[r.pid] for r in records}


async def generate(client, instance_id: str, tokens: list[int], max_tokens: int = 1) -> list[TokenDelta]:
    return await collect(await client.call(instance_id, GenerateRequest(tokens, SamplingParams(temperature=0, max_tokens=max_tokens)), TokenDelta))


async def routed(router, client, tokens: list[int], max_tokens: int = 1):
    selection = await router.select("mock", tokens)
    try:
        deltas = await generate(client, selection.instance_id, tokens, max_tokens)
    finally:
        router.release(selection)
    return selection, deltas[-1].usage


async def test_prefix_affinity_then_spread_under_load_then_departure(rt, spawn):
    router = await create_router(rt, "kv", seed=3)
    try:
        client, procs = await start_workers(rt, spawn, 3, "--token-latency-ms", "40")
        first, _ = await routed(router, client, prompt(0))
        holder = first.instance_id
        await eventually(lambda: router.index.overlaps(PREFIX_HASHES, [holder])[holder] == 32, what="holder indexed")

        for i in range(1, 6):  # requests sharing the prefix go to the holder and hit its cache
            selection, usage = await routed(router, client, prompt(i))
            assert (selection.instance_id, selection.overlap_blocks) == (holder, 32)
            assert usage.cached_tokens == 512

        # A burst of long requests: the holder takes the first ones, then it counts as loaded.
        async def long_request(i: int) -> str:
            selection = await router.select("mock", prompt(100 + i))
            try:
                await generate(client, selection.instance_id, prompt(100 + i), max_tokens=25)
            finally:
                router.release(selection)
            return selection.instance_id

        tasks = []
        for i in range(24):
            tasks.append(asyncio.create_task(long_request(i)))
            await asyncio.sleep(0)  # each select runs before the next one starts
        chosen = await asyncio.gather(*tasks)
        # 35-block prompts, 32 cached on the holder: it costs 2*3 + 35k with k requests running there,
        # a cold worker 2*35 + 35j. The holder takes two, then the burst spreads over all three.
        assert chosen[:2] == [holder] * 2 and holder not in chosen[2:4], chosen
        assert all(chosen.count(w) >= 5 for w in procs), chosen
        assert router.in_flight == {} and router.load.in_flight() == 0

        # The holder leaves: it is dropped from the index and never chosen again.
        await asyncio.to_thread(procs[holder].stop)
        await client.snapshot.wait_for(lambda items: all(r.instance_id != holder for r in items.values()), 10)
        assert router.index.num_blocks(holder) == 0 and holder not in router.index.workers()
        for i in range(20):
            selection, _ = await routed(router, client, prompt(200 + i))
            assert selection.instance_id != holder
        assert router.index.is_departed(holder) and holder not in router.index.workers()
    finally:
        await router.stop()


async def test_late_router_recovers_the_index_from_worker_dumps(rt, spawn):
    client, procs = await start_workers(rt, spawn, 3, "--token-latency-ms", "0")
    ids = sorted(procs)
    holder = ids[1]
    await generate(client, holder, prompt(0))  # no router yet: only the worker knows
    other = block_hashes(list(range(9000, 9160)), 16)
    await generate(client, ids[2], list(range(9000, 9160)))

    router = await create_router(rt, "kv", seed=5)
    try:
        await eventually(lambda: router.index.num_blocks(holder) >= 34 and router.index.num_blocks(ids[2]) >= 10,
                         what="index recovered from dumps")
        assert router.index.overlaps(PREFIX_HASHES, ids) == {ids[0]: 0, holder: 32, ids[2]: 0}
        assert router.index.overlaps(other, ids)[ids[2]] == 10
        selection, usage = await routed(router, client, prompt(1))
        assert (selection.instance_id, selection.overlap_blocks, usage.cached_tokens) == (holder, 32, 512)
    finally:
        await router.stop()


async def test_lost_events_trigger_a_dump_that_repairs_the_index_both_ways(rt):
    """A worker (played by the test over real NATS) whose event 2 is lost: the router skips the gap,
    asks for a dump, adds what the dump shows and drops what it no longer confirms."""
    a = block_hashes(list(range(64)), 16)
    b = block_hashes(list(range(100, 164)), 16)
    holds = a[:2] + b  # the worker's real state: event 2 removed a[2:], event 3 stored b
    next_id = [4]

    async def answer_dump(_request) -> None:
        for h in holds:
            await rt.publish(TOPIC_KV, KvEvent("fake", next_id[0], "stored", [h]))
            next_id[0] += 1

    await rt.subscribe(TOPIC_KV_DUMP, KvDumpRequest, lambda req: asyncio.ensure_future(answer_dump(req)))
    router = await create_router(rt, "kv", gap_timeout=0.3, resync_interval=0.5, resync_window=1.0,
                                 maintenance_interval=0.1, request_dump=False)
    try:
        await rt.publish(TOPIC_KV, KvEvent("fake", 1, "stored", a))
        await rt.publish(TOPIC_KV, KvEvent("fake", 3, "stored", b))  # event 2 never arrives
        await eventually(lambda: router.index.counters.gaps_skipped == 1, what="gap skipped")
        await eventually(lambda: router.index.overlaps(a, ["fake"])["fake"] == 2, timeout=10, what="stale blocks dropped")
        assert router.index.overlaps(b, ["fake"]) == {"fake": 4} and router.index.num_blocks("fake") == 6
    finally:
        await router.stop()


async def test_a_second_router_sees_the_overload_through_load_events(rt, spawn):
    """Requests another frontend sent straight to the holder show up in its load events, so a router
    with no in-flight requests of its own moves new requests away from it."""
    client, procs = await start_workers(rt, spawn, 3, "--token-latency-ms", "50")
    holder = sorted(procs)[0]
    await generate(client, holder, prompt(0))
    router = await create_router(rt, "kv", seed=11)
    try:
        await eventually(lambda: router.index.num_blocks(holder) >= 34, what="holder indexed from its dump")
        before = await router.select("mock", prompt(1))
        router.release(before)
        assert (before.instance_id, before.overlap_blocks) == (holder, 32)

        # 20 long requests sharing the prefix, sent to the holder by someone else. The mock reports its
        # distinct pinned blocks: 32 shared + 2 full blocks each = 72, so the holder costs 2*3 + 72 = 78
        # against 2*35 = 70 for an idle worker.
        burst = [asyncio.create_task(generate(client, holder, prompt(300 + i), max_tokens=60)) for i in range(20)]
        await eventually(lambda: router.load.decode_blocks(holder) >= 72, what="load event seen")
        assert router.in_flight == {}  # this router sent none of them
        after = await router.select("mock", prompt(2))
        router.release(after)
        assert after.instance_id != holder and after.overlap_blocks == 0
        for task in burst:
            task.cancel()
        await asyncio.gather(*burst, return_exceptions=True)
    finally:
        await router.stop()
