"""A worker whose drain times out ends its open streams with a ``shutting_down`` error frame, and the
frontend resumes them on another worker at once: real frontend, two mock workers, real etcd and NATS.
Before, the streams were cancelled without a word and the clients waited for a probe or the stall
timeout to find the worker gone."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import httpx
import pytest

from tests.support.http import wait_for_model
from tests.support.servers import free_port

pytestmark = pytest.mark.e2e

MOCK = ("--num-speculative-tokens", "0", "--lease-ttl", "3")
DRAIN_S = 1.0
MAX_TOKENS = 1000  # 20 s at the first worker's 20 ms a token: the stream outlives its drain; the second is fast


async def test_a_timed_out_drain_moves_its_streams_to_another_worker_within_a_second(rt, spawn):
    port = free_port()
    frontend = spawn("frontend", "--http-port", str(port), name="frontend")
    first = spawn("workers.mock", *MOCK, "--token-latency-ms", "20", "--drain-timeout", str(DRAIN_S), name="target-1")
    targets = await rt.client("target", "generate")
    [one] = await targets.wait_for_instances(1, timeout=60)
    await wait_for_model(f"http://127.0.0.1:{port}", "mock")

    body = {"model": "mock", "prompt": "drain me slowly", "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    chunks: list[dict] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break
            # the stream runs on the only worker; now a second one comes, and the first is told to stop
            spawn("workers.mock", *MOCK, "--token-latency-ms", "1", name="target-2")
            await targets.wait_for_instances(2, timeout=60)
            [two] = [r for r in targets.instances() if r.instance_id != one.instance_id]
            first.signal(signal.SIGTERM)
            stopped = time.monotonic()
            async for line in lines:
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    chunks.append(json.loads(line[6:]))
    assert "error" not in json.dumps(chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # The first worker streams until its drain times out, then the stream goes on elsewhere: no gap
    # between two chunks reaches a second (the stall timeout here is 5 heartbeats).
    gaps = [b - a for a, b in zip([stopped, *arrivals], arrivals)]
    logging.getLogger(__name__).warning("largest gap between chunks %.3f s (SIGTERM to end %.3f s)",
                                        max(gaps), arrivals[-1] - stopped)
    assert max(gaps) < 1.0, (max(gaps), gaps.index(max(gaps)), len(gaps))
    assert arrivals[-1] - stopped > DRAIN_S  # the drain did run out with the stream still open
    # The frontend migrated on the worker's error frame (not on a probe finding the worker gone).
    assert f"worker {one.instance_id} failed (drain timed out" in frontend.logs(), frontend.logs()[-3000:]
    assert not first.alive() and two.instance_id in {r.instance_id for r in targets.instances()}
