"""The planner with the local connector, with real processes: ``tandem up --mock --planner`` on the
test's etcd and NATS. Mock targets whose token latency grows with the requests they run (5 ms + 4 ms
per other running request) under 12 concurrent clients break a 25 ms ITL p90; the planner adds
targets through the launcher until the SLA holds, then, as the load falls to 3 clients and to
nothing, removes them again. No request fails or comes back short.

A second test resizes a stack through the launcher's ``launcher.scale`` endpoint directly (what the
planner's connector sends), removing the busiest target while long streams run on it: the worker
leaves discovery at once, while it still streams, finishes its streams and exits 0; every stream
completes."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from planner.connectors.base import ScaleError
from planner.connectors.launcher import LauncherConnector
from runtime.events import TOPIC_LOAD
from runtime.messages import LoadEvent
from tests.support.http import wait_for_model
from tests.support.servers import free_port
from tests.support.wait import eventually

pytestmark = pytest.mark.e2e

MAX_TOKENS = 60


async def complete(client: httpx.AsyncClient, i: int, max_tokens: int = MAX_TOKENS) -> str | None:
    """One request (odd ones stream); None when it came back whole, else what went wrong."""
    body = {"model": "mock", "prompt": f"client {i} asks at {time.time()}", "max_tokens": max_tokens}
    try:
        if i % 2 == 0:
            resp = await client.post("/v1/completions", json=body)
            if resp.status_code != 200:
                return f"{resp.status_code} {resp.text[:200]}"
            got = resp.json()["usage"]["completion_tokens"]
        else:
            got = 0
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    return f"{resp.status_code} {(await resp.aread())[:200]!r}"
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        return line
                    if line.startswith("data: {") and '"usage"' in line and '"completion_tokens"' in line:
                        got = int(re.search(r'"completion_tokens":\s*(\d+)', line).group(1))
        return None if got == max_tokens else f"{got} of {max_tokens} tokens"
    except httpx.HTTPError as exc:
        return repr(exc)


class Clients:
    """``n`` clients sending requests back to back; ``set(n)`` changes how many run."""

    def __init__(self, port: int):
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60,
                                        limits=httpx.Limits(max_connections=64))
        self.wanted = 0
        self.done = 0
        self.failures: list[str] = []
        self.tasks: list[asyncio.Task] = []

    def set(self, n: int) -> None:
        self.wanted = n
        while len(self.tasks) < n:
            self.tasks.append(asyncio.create_task(self._run(len(self.tasks))))

    async def _run(self, i: int) -> None:
        while i < self.wanted:
            error = await complete(self.client, i)
            self.done += 1
            if error:
                self.failures.append(error)

    async def close(self) -> None:
        self.wanted = 0
        await asyncio.gather(*self.tasks)
        await self.client.aclose()


def planner_metrics_url(launcher_log: str) -> str:
    port = re.search(r"planner\s+pid \d+\s+health http://127\.0\.0\.1:(\d+)/health", launcher_log).group(1)
    return f"http://127.0.0.1:{port}/metrics"


async def test_planner_scales_targets_up_and_down_with_the_load(rt, spawn):
    port = free_port()
    up = spawn("deploy.cli", "up", "--mock", "--http-port", str(port), "--mock-token-latency-ms", "5",
               "--mock-token-latency-per-running-ms", "6", "--drain-timeout", "20", "--planner", "--planner-args",
               "--itl-p90 25ms --adjustment-interval 1 --latency-window 3 --up-cooldown 2 --down-cooldown 3 "
               "--max-targets 3", name="tandem-up")
    targets = await rt.client("target", "generate")
    await wait_for_model(f"http://127.0.0.1:{port}", "mock", timeout=90)
    up.wait_for_log("Tandem is ready", timeout=60)
    peak = 0

    def count() -> int:
        nonlocal peak
        n = len(targets.instances())
        peak = max(peak, n)
        return n

    clients = Clients(port)
    try:
        # ms per token = 5 + 6 * (running - 1): 71 on one worker, 35 on two (6 each), 23 on three: up to 3,
        # each step clear of the 25 ms SLA (with 4 ms per running request two workers sat right at it)
        clients.set(12)
        await eventually(lambda: count() == 3, timeout=45, interval=0.2, what="scaling up to 3 targets")
        await asyncio.sleep(3)  # three targets serve the high load a while before it falls
        clients.set(2)  # 11 ms on one worker: far below 0.7 * SLA, so down to 1
        await eventually(lambda: count() == 1, timeout=45, interval=0.2, what="scaling back down to 1 target")
        served_during_scaling = clients.done
    finally:
        await clients.close()
    assert not clients.failures, f"{len(clients.failures)} of {clients.done} requests failed: {clients.failures[:5]}"
    assert served_during_scaling > 50
    assert peak == 3
    log = up.logs()
    assert re.search(r"pool target: 1 -> 2 \(itl_over_sla\)", log), log[-3000:]
    assert re.search(r"pool target: 3 -> 2 \((below_sla|idle)\)", log), log[-3000:]
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(planner_metrics_url(log))).text
    ups = re.search(r'tandem_planner_decisions_total\{action="up",pool="target",reason="itl_over_sla"\} (\d+)', metrics)
    assert ups and int(float(ups.group(1))) >= 2, metrics  # 1 -> 2 -> 3 (more if a busy machine slows a step)
    assert 'tandem_planner_sla_seconds{metric="itl"} 0.025' in metrics


async def test_a_removed_worker_leaves_discovery_first_and_finishes_its_streams(rt, spawn):
    port = free_port()
    up = spawn("deploy.cli", "up", "--mock", "--targets", "2", "--http-port", str(port), "--mock-token-latency-ms",
               "20", "--drain-timeout", "30", "--allow-scaling", name="tandem-up")
    targets = await rt.client("target", "generate")
    await wait_for_model(f"http://127.0.0.1:{port}", "mock", timeout=90)
    await targets.wait_for_instances(2, timeout=60)
    connector = await LauncherConnector.connect(rt)
    replicas = await eventually(connector.replicas, timeout=30, interval=0.2, ignoring=(ScaleError,),
                                what="the launcher's scale endpoint")
    assert replicas["target"] == 2

    running: dict[str, int] = {}
    await rt.subscribe(TOPIC_LOAD, LoadEvent, lambda e: running.__setitem__(e.worker_id, e.running))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        # 8 streams of 150 tokens at 20 ms: 3 s each, spread over both targets
        streams = [asyncio.create_task(complete(client, 2 * i + 1, max_tokens=150)) for i in range(8)]
        await eventually(lambda: sum(running.values()) == 8, timeout=20, interval=0.2,
                         what=lambda: f"8 streams running (running: {running})")
        busiest = max(targets.instances(), key=lambda r: running.get(r.instance_id, 0))
        in_flight = running[busiest.instance_id]
        assert in_flight >= 4
        await connector.scale("target", 1, [busiest], "test: remove the busiest")
        await eventually(lambda: all(r.instance_id != busiest.instance_id for r in targets.instances()),
                         timeout=20, interval=0.02, what="the removed target leaving discovery")
        # it left discovery while its streams still ran: the process is alive and has not exited
        assert not all(s.done() for s in streams)
        results = await asyncio.gather(*streams)
    assert results == [None] * 8, results
    assert (await connector.replicas())["target"] == 1
    assert [r.instance_id for r in targets.instances()] != [busiest.instance_id]
    log = up.logs()
    name = re.search(rf"started (target-\d) \(pid {busiest.pid}\)", log).group(1)
    await eventually(lambda: f"{name} exited with 0" in up.logs(), timeout=30, interval=0.2, what=f"{name} exiting 0")
    assert re.search(rf"\[{name}\] .*SIGTERM received: draining", up.logs())
    assert "cancelled" not in "".join(line for line in up.logs().splitlines() if line.startswith(f"[{name}]"))
