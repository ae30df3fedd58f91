"""The standalone router is no single point of failure: a frontend started with --remote-router routes
in its own process while no router instance answers, and through the service again once one does;
under ``tandem up --standalone-router`` a killed router leaves the stack serving."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections import Counter

import httpx
import pytest

from tests.support.launcher import MOCK, ask, launcher  # noqa: F401 (fixture)
from tests.support.http import completion_load, wait_for_model
from tests.support.servers import free_port
from tests.support.wait import eventually, eventually_sync

pytestmark = pytest.mark.e2e


def _decisions(router_url: str) -> float:
    text = httpx.get(router_url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem_router_decisions_total"))


async def test_a_killed_router_service_is_routed_around_in_process(spawn):
    router_port, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    router = spawn("router", "--lease-ttl", "10", "--mode", "kv", "--http-port", str(router_port), name="router")
    spawn("workers.mock", "--lease-ttl", "3", "--token-latency-ms", "1", "--num-speculative-tokens", "0", name="mock")
    frontend = spawn("frontend", "--http-port", str(port), "--remote-router", "--lease-ttl", "3", name="frontend")
    frontend.wait_for_log("frontend ready", timeout=60)
    router.wait_for_log("router", timeout=60)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await wait_for_model(url, "mock", timeout=60, interval=0.1)
        body = {"model": "mock", "prompt": "hi", "max_tokens": 2}

        async def through_the_service() -> bool:  # it may register after the frontend started routing in-process
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            return _decisions(f"http://127.0.0.1:{router_port}") >= 1

        await eventually(through_the_service, timeout=30, interval=0.1, what="a request routed through the service")

    statuses: Counter = Counter()
    stop = asyncio.Event()
    load = [asyncio.create_task(completion_load(url, statuses, stop, "route me", 3)) for _ in range(3)]
    await eventually(lambda: statuses[200] > 0, timeout=10, what="the load being served")
    router.kill()  # SIGKILL: its registration outlives it for the 10 s lease
    await asyncio.sleep(3)  # the load goes on for a while with the router dead and still registered
    stop.set()
    await asyncio.gather(*load)
    assert sum(statuses.values()) > 30 and set(statuses) == {200}, dict(statuses)
    assert "routing in this process" in frontend.logs().split("answers again")[-1]

    # a router instance again: the frontend goes back to it
    again = spawn("router", "--lease-ttl", "10", "--mode", "kv", "--http-port", str(free_port()), name="router2")
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def back_to_the_service() -> bool:
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            return "answers again" in frontend.logs()

        await eventually(back_to_the_service, timeout=60, interval=0.2,
                         what=lambda: f"the frontend back on the service:\n{frontend.logs()[-2000:]}")
    assert again.alive()


def test_tandem_up_survives_a_killed_router(launcher):  # noqa: F811
    up = launcher(*MOCK, "--standalone-router")
    up.wait_ready()
    pids = {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", up.logs())}
    os.kill(pids["router"], signal.SIGKILL)
    eventually_sync(lambda: re.search(r"router exited with -9; restarting it in [\d.]+s \(restart 1\); the rest of "
                                      "the stack keeps serving", up.logs()), timeout=30, interval=0.1,
                    what=lambda: f"the launcher restarting the router:\n{up.logs()[-3000:]}")
    for _ in range(5):
        assert ask(up.url, max_tokens=3)["usage"]["completion_tokens"] == 3
    assert up.proc.poll() is None
    assert len(re.findall(r"started router \(pid \d+\)", up.logs())) == 2  # the launcher restarted it
