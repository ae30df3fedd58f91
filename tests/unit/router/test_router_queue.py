"""The KV router's pending queue (``--router-queue-threshold``) and session affinity, fed by hand."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.cost import KvRouterConfig
from router.kv_router import KvRouter
from router.metrics import RouterQueueCollector
from router.queue import PendingQueue, policy_key
from runtime import NoInstances
from runtime.kv_hash import block_hashes
from runtime.messages import InstanceRecord, KvEvent, LoadEvent, RoutingHints

pytestmark = pytest.mark.unit

PROMPT = list(range(2000, 2064))  # 4 blocks


def make_router(workers=("w0", "w1"), capacity: int = 1, **options) -> tuple[KvRouter, dict]:
    records = {w: InstanceRecord(w, "ns", "target", "generate", f"s.{w}", model="m") for w in workers}
    router = KvRouter(lambda model: [r for r in records.values() if model is None or r.model == model],
                      KvRouterConfig(seed=3, **options))
    router.on_instances(dict(records))
    for w in workers:
        router.on_load_event(LoadEvent(w, max_num_seqs=capacity))
    return router, records


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_policy_keys():
    plain, urgent = RoutingHints(), RoutingHints(priority=-3)
    assert policy_key("fcfs", urgent, 10.0, 64) == 7.0 and policy_key("fcfs", plain, 10.0, 64) == 10.0
    assert policy_key("fcfs", RoutingHints(priority=5), 10.0, 64) == 10.0  # never pushed behind arrival order
    assert policy_key("lcfs", plain, 10.0, 64) < policy_key("lcfs", plain, 9.0, 64)
    assert policy_key("wspt", RoutingHints(osl=16), 0.0, 64) < policy_key("wspt", RoutingHints(osl=512), 0.0, 64)
    assert policy_key("wspt", RoutingHints(osl=512, priority=-9), 0.0, 64) < policy_key("wspt", RoutingHints(osl=512), 0, 64)
    with pytest.raises(ValueError):
        PendingQueue("edf")
    with pytest.raises(ValueError):
        KvRouterConfig(queue_threshold=0)


async def test_without_a_threshold_nothing_waits():
    router, _ = make_router()
    chosen = [await router.select("m", PROMPT) for _ in range(6)]
    assert len(chosen) == 6 and len(router.queue) == 0


async def test_held_while_every_worker_is_busy_then_released_by_tier_then_priority():
    router, _ = make_router(queue_threshold=1.0)
    first = [await router.select("m", PROMPT, request_id=f"run{i}") for i in range(2)]
    assert {s.instance_id for s in first} == {"w0", "w1"}  # one each: both are now at their capacity
    order: list[str] = []

    async def ask(name: str, hints: RoutingHints):
        selection = await router.select("m", PROMPT, request_id=name, hints=hints)
        order.append(name)
        return selection

    tasks = [asyncio.create_task(ask("low", RoutingHints())),
             asyncio.create_task(ask("urgent", RoutingHints(priority=-5))),
             asyncio.create_task(ask("tier1", RoutingHints(strict_priority=1))),
             asyncio.create_task(ask("lower", RoutingHints(priority=7)))]
    await settle()
    assert order == [] and router.queue.pending_by_tier == {0: 3, 1: 1}
    running = list(first)
    for expected in ("tier1", "urgent", "low", "lower"):
        router.release(running.pop(0))
        await settle()
        assert order[-1] == expected and len(order) == ["tier1", "urgent", "low", "lower"].index(expected) + 1
        running.append(tasks[["low", "urgent", "tier1", "lower"].index(expected)].result())
    assert len(router.queue) == 0 and set(router.queue_wait) == {0, 1}
    text = generate_latest(_registry(router)).decode()
    assert 'tandem_router_queue_pending_requests' in text and 'tandem_router_queue_wait_seconds_count{strict_priority="1"} 1.0' in text
    assert 'tandem_router_queue_max_wait_seconds{strict_priority="0"}' in text
    assert "dynamo_frontend_router_queue_pending_requests" in text


def _registry(router) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RouterQueueCollector(router, dynamo=True))
    return registry


@pytest.mark.parametrize("policy, first", [("lcfs", "second"), ("wspt", "short")])
async def test_lcfs_takes_the_newest_and_wspt_the_least_work(policy, first):
    router, _ = make_router(("w0",), queue_threshold=1.0, queue_policy=policy)
    running = await router.select("m", PROMPT)
    done: list[str] = []

    async def ask(name, hints):
        s = await router.select("m", PROMPT, request_id=name, hints=hints)
        done.append(name)
        return s

    a = asyncio.create_task(ask("first" if policy == "lcfs" else "long", RoutingHints(osl=4000)))
    await settle()
    b = asyncio.create_task(ask("second" if policy == "lcfs" else "short", RoutingHints(osl=8)))
    await settle()
    router.release(running)
    await settle()
    assert done == [first]
    router.release((b if done[0] in ("second", "short") else a).result())
    await settle()
    assert len(done) == 2


async def test_a_threshold_above_one_and_unknown_capacity():
    router, _ = make_router(("w0",), capacity=2, queue_threshold=1.5)
    held = [await router.select("m", PROMPT) for _ in range(3)]  # busy at 3 in flight (1.5 × 2)
    waiting = asyncio.create_task(router.select("m", PROMPT))
    await settle()
    assert not waiting.done()
    router.release(held[0])
    await settle()
    assert waiting.done()
    unknown, _ = make_router(("w0",), capacity=0, queue_threshold=1.0)  # no capacity said: never busy
    assert len([await unknown.select("m", PROMPT) for _ in range(5)]) == 5


async def test_a_cancelled_request_leaves_the_queue_and_takes_no_slot():
    router, _ = make_router(("w0",), queue_threshold=1.0)
    running = await router.select("m", PROMPT)
    gone = asyncio.create_task(router.select("m", PROMPT))
    stays = asyncio.create_task(router.select("m", PROMPT))
    await settle()
    gone.cancel()
    await settle()
    assert len(router.queue) == 1
    router.release(running)
    await settle()
    assert stays.done() and router.load.own_requests("w0") == 1


async def test_held_requests_go_to_a_new_worker_and_fail_when_every_worker_left():
    router, records = make_router(("w0",), queue_threshold=1.0)
    await router.select("m", PROMPT)
    waiting = asyncio.create_task(router.select("m", PROMPT))
    await settle()
    records["w9"] = InstanceRecord("w9", "ns", "target", "generate", "s.w9", model="m")
    router.on_instances(dict(records))  # a new worker (capacity not said yet): the held request goes there
    await settle()
    assert waiting.result().instance_id == "w9"
    router.on_load_event(LoadEvent("w9", max_num_seqs=1))
    stuck = asyncio.create_task(router.select("m", PROMPT))
    await settle()
    records.clear()
    router.on_instances({})
    await settle()
    with pytest.raises(NoInstances):
        stuck.result()


# --------------------------------------------------------------------------- sessions


async def test_a_session_stays_on_its_worker_on_a_tie_and_follows_the_kv_score_otherwise():
    router, _ = make_router(("w0", "w1", "w2"))
    hints = RoutingHints(session_id="agent-1")
    homes = set()
    for turn in range(6):  # no KV events at all: every worker ties, the session keeps its worker
        s = await router.select("m", PROMPT + [turn], hints=hints)
        homes.add(s.instance_id)
        router.release(s)
    assert len(homes) == 1 and router.session_hits == 5
    home = homes.pop()
    other = next(w for w in ("w0", "w1", "w2") if w != home)
    router.on_kv_event(KvEvent(other, 1, "stored", block_hashes(PROMPT, 16)))  # the prefix is elsewhere now
    s = await router.select("m", PROMPT + [99], hints=hints)
    assert s.instance_id == other and router.sessions["agent-1"] == other


async def test_after_its_worker_dies_a_session_goes_where_its_prefix_is_in_any_tier():
    router, records = make_router(("w0", "w1", "w2"))
    hints = RoutingHints(session_id="s")
    router.on_kv_event(KvEvent("w0", 1, "stored", block_hashes(PROMPT, 16)))
    assert (await router.select("m", PROMPT + [1], hints=hints)).instance_id == "w0"
    # w2's disk tier (shared with w0) holds the session's prompt; w1 holds nothing
    router.on_kv_event(KvEvent("w2", 1, "stored", block_hashes(PROMPT, 16), tier="disk"))
    del records["w0"]
    router.on_instances(dict(records))
    s = await router.select("m", PROMPT + [2], hints=hints)
    assert s.instance_id == "w2" and router.sessions["s"] == "w2"


async def test_sessions_are_bounded():
    router, _ = make_router(max_sessions=4)
    for i in range(10):
        router.release(await router.select("m", PROMPT, hints=RoutingHints(session_id=f"s{i}")))
    assert list(router.sessions) == ["s6", "s7", "s8", "s9"]


async def test_the_router_service_passes_the_hints_on():
    from router.remote import RouterService
    from runtime.messages import RouteRequest
    from runtime.request_plane import RequestContext

    router, _ = make_router()
    service = RouterService(router, "router-1")
    request = RouteRequest("m", PROMPT, hints=RoutingHints(session_id="remote-agent"))
    [resp] = [r async for r in service.select(request, RequestContext("rid", "router-1"))]
    assert router.sessions["remote-agent"] == resp.instance_id
