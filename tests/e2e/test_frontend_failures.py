"""The frontend when things go wrong: no workers yet, a model with no live instance, a client that
disconnects (the worker's handler must be cancelled), and a worker killed with SIGKILL in the middle
of a streamed request (the request migrates and the client's stream just continues)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from runtime import Runtime, RuntimeConfig
from runtime.events import TOPIC_LOAD
from runtime.messages import LoadEvent, ModelCard
from tests.e2e.test_frontend_openai import FrontendStack
from tests.support.metrics import sample_value
from tests.support.wait import eventually, eventually_sync

pytestmark = pytest.mark.e2e

CANCELLED = "cancelled after client left"


@pytest.fixture(scope="module")
def stack(servers):
    s = FrontendStack(servers)
    s.frontend()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def workers(stack):
    procs = [stack.worker("--token-latency-ms", "40", "--num-speculative-tokens", "0", name=f"mock{i}") for i in range(2)]
    stack.wait_healthy()
    eventually_sync(lambda: live_instances(stack) >= 2, timeout=30, interval=0.1, what="both workers routed to")
    return procs


def runtime_config(stack) -> RuntimeConfig:
    env = stack.env
    return RuntimeConfig(etcd_url=env["TANDEM_ETCD"], nats_url=env["TANDEM_NATS"], namespace=env["TANDEM_NAMESPACE"],
                         lease_ttl=3, handle_signals=False)


def live_instances(stack) -> int:
    """How many instances of the mock model the frontend routes to (its /v1/models)."""
    return {m["id"]: m["instances"] for m in httpx.get(stack.url + "/v1/models").json()["data"]}.get("mock", 0)


async def listed(http, model: str) -> bool:
    return model in [m["id"] for m in (await http.get("/v1/models")).json()["data"]]


def cancelled_count(procs) -> int:
    return sum(p.logs().count(CANCELLED) for p in procs)


def test_without_workers_the_frontend_is_ready_and_requests_are_503_with_retry_after(stack):
    assert httpx.get(stack.url + "/live").status_code == 200
    health = httpx.get(stack.url + "/health")
    assert health.status_code == 200 and health.json()["models"] == []
    resp = httpx.post(stack.url + "/v1/chat/completions", json={"model": "mock", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "no_workers"


async def test_a_model_without_a_live_instance_is_503_with_retry_after(stack):
    from workers.demo_model import demo_tokenizer_dir

    async with Runtime.connect(runtime_config(stack)) as rt:
        # A worker that published its card but serves nothing (still starting, or its endpoint is gone).
        await rt.register_model(ModelCard("ghost", tokenizer_path=str(demo_tokenizer_dir())))
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            await eventually(lambda: listed(http, "ghost"), what="the ghost model listed")
            resp = await http.post("/v1/completions", json={"model": "ghost", "prompt": "hi", "max_tokens": 2})
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
            assert resp.json()["error"]["code"] == "no_workers"
            assert "ghost" not in (await http.get("/health")).json()["models"]  # a card alone is not a serving worker


def test_streaming_client_disconnect_cancels_the_worker_handler(stack, workers):
    before = cancelled_count(workers)
    body = {"model": "mock", "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 500, "stream": True}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            data = [line for line in (next(lines) for _ in range(8)) if line.startswith("data:")]
            assert len(data) >= 3
    eventually_sync(lambda: cancelled_count(workers) == before + 1, what="the worker handler cancelled")


async def test_non_streaming_client_disconnect_cancels_the_worker_handler(stack, workers):
    before = cancelled_count(workers)
    body = json.dumps({"model": "mock", "prompt": "a long one", "max_tokens": 500}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    async with httpx.AsyncClient(base_url=stack.url) as http:
        async def generating() -> bool:  # in flight, and its first token came: the worker is generating
            text = (await http.get("/metrics")).text
            return (sample_value(text, "tandem_frontend_inflight_requests", model="mock") == 1
                    and sample_value(text, "tandem_frontend_queued_requests", model="mock") == 0)

        await eventually(generating, what="the worker generating (500 tokens take 20 s)")
    writer.close()
    await writer.wait_closed()
    await eventually(lambda: cancelled_count(workers) == before + 1, what="the worker handler cancelled")


async def test_killing_the_serving_worker_migrates_the_stream(stack, workers):
    prompt, max_tokens = "the quick brown fox jumps over the lazy dog", 100
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        reference = (await http.post("/v1/completions", json={"model": "mock", "prompt": prompt, "max_tokens": max_tokens,
                                                               "temperature": 0})).json()["choices"][0]["text"]
        async with Runtime.connect(runtime_config(stack)) as rt:
            busy: set[str] = set()
            await rt.subscribe(TOPIC_LOAD, LoadEvent, lambda e: busy.add(e.worker_id) if e.running else None)
            body = {"model": "mock", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                events = resp.aiter_lines()
                chunks = []
                while len(chunks) < 5:
                    line = await anext(events)
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                await eventually(lambda: busy, timeout=5, what="a worker reporting the request as running")
                [serving] = busy
                client = await rt.client("target", "generate")
                [pid] = [r.pid for r in client.instances() if r.instance_id == serving]
                [victim] = [p for p in workers if p.pid == pid]
                victim.kill()
                async for line in events:
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
    assert all("error" not in c for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length"] and chunks[-1]["usage"]["completion_tokens"] == max_tokens
    assert text == reference  # greedy: the surviving worker carried on from where the dead one stopped
    metrics = httpx.get(stack.url + "/metrics").text
    assert re.search(r"^tandem_frontend_migrations_total 1\.0$", metrics, re.M), metrics


def migrations(stack) -> float:
    text = httpx.get(stack.url + "/metrics").text
    return float(re.search(r"^tandem_frontend_migrations_total (\S+)$", text, re.M).group(1))


async def start_doomed_worker(stack, name: str):
    """One more worker, with a lease (10 s) that will outlive it; returns it and the live count once
    the frontend routes to it."""
    ghost = stack.worker("--token-latency-ms", "0", "--lease-ttl", "10", name=name)
    async with Runtime.connect(runtime_config(stack)) as rt:
        client = await rt.client("target", "generate")
        await client.snapshot.wait_for(lambda items: any(r.pid == ghost.pid for r in items.values()), 30)
        live = len(client.instances())
    await eventually(lambda: live_instances(stack) == live, what="the frontend routing to the new worker")
    return ghost, live


async def test_a_dead_worker_still_registered_is_skipped_without_failing_requests(stack, workers):
    # Its lease (10 s) outlives it, so the router still offers it: requests sent there find no
    # responder and move on to a live worker.
    ghost, live = await start_doomed_worker(stack, "doomed")
    before = migrations(stack)
    ghost.kill()
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        # distinct prompts, several per worker: kv routing (the default) sends a repeated prompt back to
        # the worker that cached it, so the dead one might never be tried; the idle dead one wins a tie
        answers = [await http.post("/v1/completions", json={"model": "mock", "prompt": f"still here? {i}",
                                                            "max_tokens": 3})
                   for i in range(4 * live)]
    assert [a.status_code for a in answers] == [200] * len(answers)
    assert all(a.json()["usage"]["completion_tokens"] == 3 for a in answers)
    assert migrations(stack) >= before + 1


async def test_a_sigkilled_worker_leaves_routing_at_its_first_no_responders(stack, workers):
    """Its lease outlives it by seconds; the first request that finds nobody on its subject takes it
    out of routing for every later request (one migration, not one per request until the lease ends)."""
    ghost, live = await start_doomed_worker(stack, "sigkilled")
    before = migrations(stack)
    ghost.kill()
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        answers = [await http.post("/v1/completions", json={"model": "mock", "prompt": f"request {i}", "max_tokens": 1})
                   for i in range(6 * live)]  # every worker chosen several times over, were the ghost still routable
    assert [a.status_code for a in answers] == [200] * len(answers)
    assert migrations(stack) - before == 1


async def test_a_card_whose_tokenizer_cannot_load_is_a_500_and_the_server_stays_up(stack):
    async with Runtime.connect(runtime_config(stack)) as rt:
        await rt.register_model(ModelCard("broken", tokenizer_path="/nonexistent/tokenizer"))
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            await eventually(lambda: listed(http, "broken"), what="the broken model listed")
            resp = await http.post("/v1/completions", json={"model": "broken", "prompt": "hi"})
            assert resp.status_code == 500 and resp.json()["error"]["code"] == "tokenizer_unavailable"
            assert (await http.get("/live")).status_code == 200
