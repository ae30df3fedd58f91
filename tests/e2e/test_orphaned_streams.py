"""A frontend killed with SIGKILL says nothing to its workers: they must find out themselves (NATS
answers "no responders" on a dead requester's reply subject) and stop its streams within 1 s,
freeing their batch slots, instead of generating on to ``max_tokens``."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from datetime import datetime

import httpx
import pytest

from runtime import Runtime, RuntimeConfig
from runtime.events import TOPIC_LOAD
from runtime.messages import LoadEvent
from tests.e2e.test_frontend_openai import FrontendStack

pytestmark = pytest.mark.e2e

STREAMS = 16
GONE = "its requester is gone"


async def stream_tokens(url: str, seen: list[int], index: int) -> None:
    body = {"model": "mock", "prompt": "alpha beta gamma delta", "max_tokens": 1500, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        seen[index] += 1
    except httpx.HTTPError:
        pass  # the frontend died under us: expected


def log_times(text: str, marker: str) -> list[float]:
    """Wall-clock times of the log lines containing ``marker``."""
    stamps = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*" + re.escape(marker), text, re.M)
    return [datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f").timestamp() for s in stamps]


async def test_a_killed_frontends_streams_stop_generating_within_1s(servers):
    stack = FrontendStack(servers)
    try:
        worker = stack.worker("--token-latency-ms", "20", "--num-speculative-tokens", "0")
        frontend = stack.frontend()
        stack.wait_healthy()
        env = stack.env
        config = RuntimeConfig(etcd_url=env["TANDEM_ETCD"], nats_url=env["TANDEM_NATS"],
                               namespace=env["TANDEM_NAMESPACE"], handle_signals=False)
        loads: list[tuple[float, int]] = []  # (when it arrived, running)
        async with Runtime.connect(config) as rt:
            await rt.subscribe(TOPIC_LOAD, LoadEvent, lambda ev: loads.append((time.time(), ev.running)))
            seen = [0] * STREAMS
            clients = [asyncio.create_task(stream_tokens(stack.url, seen, i)) for i in range(STREAMS)]
            deadline = time.monotonic() + 30
            while min(seen) < 5 or not loads or loads[-1][1] < STREAMS:
                assert time.monotonic() < deadline, (seen, loads[-3:])
                await asyncio.sleep(0.05)

            killed_at = time.time()
            frontend.signal(signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not [t for t, running in loads if t > killed_at and running == 0]:
                assert time.monotonic() < deadline, f"the worker still runs {loads[-1]}:\n{worker.logs()[-3000:]}"
                await asyncio.sleep(0.05)
            idle_at = min(t for t, running in loads if t > killed_at and running == 0)
            await asyncio.gather(*clients)

        gone = log_times(worker.logs(), GONE)
        assert len(gone) == STREAMS, worker.logs()[-3000:]
        slowest = max(gone) - killed_at
        print(f"{STREAMS} streams stopped {min(gone) - killed_at:.3f}-{slowest:.3f}s after the frontend's SIGKILL; "
              f"the worker reported running=0 {idle_at - killed_at:.3f}s after it")
        assert slowest < 1.0
        # load events come every 0.2 s: the first with nothing running is at most that much later
        assert idle_at - killed_at < 1.0 + 0.2 + 0.1
        assert worker.logs().count("cancelled after client left") == STREAMS
    finally:
        stack.stop()
