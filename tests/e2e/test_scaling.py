"""Scaling while serving, with real processes: a frontend and mock target workers under a bounded
load (300 requests, 8 concurrent). A second target added mid-run takes traffic within 2 s of
registering; SIGTERM to the first drains it. No request fails and every one gets all its tokens."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import httpx
import pytest

from runtime.events import TOPIC_KV, TOPIC_LOAD
from runtime.messages import KvEvent, KvEventKind, LoadEvent
from tests.support.servers import free_port
from tests.support.http import wait_for_model
from tests.support.wait import eventually

pytestmark = pytest.mark.e2e

TOTAL, CONCURRENCY, MAX_TOKENS = 300, 8, 32
MOCK_ARGS = ("--token-latency-ms", "10", "--num-speculative-tokens", "0", "--stats-interval", "0.1",
             "--lease-ttl", "3")


async def one_request(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
    """Returns (completion tokens, finish reason); raises on any failure."""
    body = {"model": "mock", "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": f"request {i}: tell me about worker number {i * 7919}"}]}
    if i % 2:
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, f"request {i}: {resp.status_code} {resp.text}"
        data = resp.json()
        return data["usage"]["completion_tokens"], data["choices"][0]["finish_reason"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    finish, usage = None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, f"request {i}: {resp.status_code} {await resp.aread()}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, f"request {i}: {chunk}"
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return usage["completion_tokens"], finish



async def test_add_and_remove_target_workers_under_load(rt, spawn):
    port = free_port()
    frontend = spawn("frontend", "--http-port", str(port), "--router-mode", "kv", name="frontend")
    first = spawn("workers.mock", *MOCK_ARGS, name="target-1")
    targets = await rt.client("target", "generate")
    [inst1] = await targets.wait_for_instances(1, timeout=60)
    await wait_for_model(f"http://127.0.0.1:{port}", "mock")

    # When does each worker first get a request? A mock worker publishes a KV "stored" event the
    # moment a request's (unique) prompt blocks enter its cache, and reports running requests.
    first_traffic: dict[str, float] = {}

    def seen(worker_id: str) -> None:
        first_traffic.setdefault(worker_id, time.monotonic())

    await rt.subscribe(TOPIC_KV, KvEvent, lambda e: e.kind == KvEventKind.STORED and seen(e.worker_id))
    await rt.subscribe(TOPIC_LOAD, LoadEvent, lambda e: e.running > 0 and seen(e.worker_id))

    done, results = 0, []
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits) as client:

        async def run(i: int):
            nonlocal done
            async with sem:
                try:
                    results.append((i, *await one_request(client, i)))
                except Exception as exc:  # counted, reported below
                    results.append((i, 0, f"failed: {exc!r}"))
                done += 1

        load = asyncio.gather(*(run(i) for i in range(TOTAL)))

        await eventually(lambda: done >= 30, timeout=60, interval=0.02, what=lambda: f"30 requests done ({done})")
        second = spawn("workers.mock", *MOCK_ARGS, name="target-2")
        await targets.wait_for_instances(2, timeout=60)
        registered = time.monotonic()
        inst2 = next(r for r in targets.instances() if r.instance_id != inst1.instance_id)
        assert inst2.pid == second.pid
        await eventually(lambda: inst2.instance_id in first_traffic, timeout=2.0, interval=0.01,
                         what="the new target's first request within 2 s of registering")
        logging.getLogger(__name__).info("new target's first request %.3fs after it registered (%d requests done)",
                                         first_traffic[inst2.instance_id] - registered, done)
        assert done < TOTAL - 60, f"the load ended too early ({done} done) to test removal under load"

        first.signal(signal.SIGTERM)
        drained_at = done
        await load

    failures = [r for r in results if r[2] != "length" or r[1] != MAX_TOKENS]
    assert not failures, f"{len(failures)} of {TOTAL} requests failed or came back short: {failures[:5]}"
    assert len(results) == TOTAL
    assert await asyncio.to_thread(first.wait, 40) == 0, first.logs()[-3000:]
    assert "draining" in first.logs()
    assert [r.instance_id for r in targets.instances()] == [inst2.instance_id]
    assert drained_at < TOTAL
    assert frontend.alive() and second.alive()
