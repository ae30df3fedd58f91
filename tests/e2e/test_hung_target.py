"""A hung target (SIGSTOP): once the frontend has declared it gone (its streams stalled), no new
request goes to it, although its etcd lease lives on; it is routed to again at its next sign of
life (SIGCONT: its load events resume), without waiting for etcd."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import httpx
import pytest

from runtime import Runtime, RuntimeConfig
from runtime.events import TOPIC_LOAD
from runtime.messages import LoadEvent
from tests.e2e.test_frontend_openai import FrontendStack

pytestmark = pytest.mark.e2e


async def stream(http: httpx.AsyncClient, max_tokens: int) -> int:
    body = {"model": "mock", "prompt": "alpha beta gamma", "max_tokens": max_tokens, "stream": True}
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            tokens += line.startswith("data: {")
    return tokens


async def test_a_sigstopped_target_gets_no_new_request_after_the_first_stall(servers):
    stack = FrontendStack(servers)
    hung = None
    try:
        # a lease that outlives the stall timeout (5 s), as the default 10 s one does
        workers = [stack.worker("--token-latency-ms", "20", "--num-speculative-tokens", "0", "--lease-ttl", "20",
                                name=f"mock{i}") for i in range(2)]
        # round robin: without local suspicion every second new request would go to the hung target
        frontend = stack.frontend("--router-mode", "round_robin")
        stack.wait_healthy()
        deadline = time.monotonic() + 30
        while {m["id"]: m["instances"] for m in httpx.get(stack.url + "/v1/models").json()["data"]}.get("mock", 0) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        ids = [re.search(r"mock worker (\w+) ready", w.logs()).group(1) for w in workers]
        hung, hung_id = workers[1], ids[1]
        env = stack.env
        config = RuntimeConfig(etcd_url=env["TANDEM_ETCD"], nats_url=env["TANDEM_NATS"],
                               namespace=env["TANDEM_NAMESPACE"], handle_signals=False)
        running: dict[str, int] = {}
        async with Runtime.connect(config) as rt, httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            await rt.subscribe(TOPIC_LOAD, LoadEvent, lambda ev: running.__setitem__(ev.worker_id, ev.running))
            long = [asyncio.create_task(stream(http, 400)) for _ in range(4)]  # two on each target
            while running.get(hung_id, 0) < 2:
                await asyncio.sleep(0.05)

            hung.signal(signal.SIGSTOP)
            declared = f"worker {hung_id} failed (instance {hung_id} is gone: stream stalled"  # the first stall
            deadline = time.monotonic() + 20
            while declared not in frontend.logs():
                assert time.monotonic() < deadline, frontend.logs()[-3000:]
                await asyncio.sleep(0.05)
            # From the first stall on, new requests go to the live target only: each is answered at
            # once, none waits out the 10 s acknowledgement timeout on the hung one.
            took = []
            for _ in range(8):
                started = time.monotonic()
                assert await stream(http, 4) == 4  # a chunk per token
                took.append(time.monotonic() - started)
            print("requests after the first stall took", ", ".join(f"{t:.2f}s" for t in took))
            assert max(took) < 2.0
            assert f"instance {hung_id} did not answer within" not in frontend.logs()
            assert f"instance {hung_id} does not answer (stream stalled" in frontend.logs()
            assert await asyncio.gather(*long) == [400] * 4  # the stalled streams migrated and finished

            hung.signal(signal.SIGCONT)
            back = f"instance {hung_id} shows a sign of life: routing to it again"
            deadline = time.monotonic() + 5
            while back not in frontend.logs():
                assert time.monotonic() < deadline, frontend.logs()[-3000:]
                await asyncio.sleep(0.05)
            running[hung_id] = 0
            again = [asyncio.create_task(stream(http, 200)) for _ in range(2)]
            deadline = time.monotonic() + 5
            while running.get(hung_id, 0) < 1:  # round robin sends one of the two to it again
                assert time.monotonic() < deadline, running
                await asyncio.sleep(0.05)
            await asyncio.gather(*again)
    finally:
        if hung is not None:
            hung.signal(signal.SIGCONT)
        stack.stop()
