"""The mock worker's admission: at most ``max_num_seqs`` requests run, the rest start in arrival order
or, with the priority policy, in (priority, arrival) order; a client that leaves while waiting frees
nothing it did not take."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from runtime.messages import GenerateRequest, SamplingParams
from workers.mock import MockWorker

pytestmark = pytest.mark.unit


async def _publish(topic, message) -> None:
    return None


async def _order(policy: str) -> tuple[list[str], MockWorker]:
    worker = MockWorker("w", _publish, token_latency=0.002, max_num_seqs=1, scheduling_policy=policy)
    started: list[str] = []

    async def run(name: str, priority: int) -> None:
        request = GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_tokens=3), priority=priority)
        async for _ in worker.generate(request, SimpleNamespace(request_id=name)):
            if name not in started:
                started.append(name)

    first = asyncio.create_task(run("first", 9))
    await asyncio.sleep(0)
    tasks = [asyncio.create_task(run(name, p)) for name, p in (("low", 5), ("high", -1), ("mid", 0))]
    await asyncio.sleep(0)
    gone = asyncio.create_task(run("gone", -9))
    await asyncio.sleep(0)
    assert worker.load().queued == 4 and worker.load().max_num_seqs == 1
    gone.cancel()
    await asyncio.gather(first, *tasks)
    assert worker.running == 0 and worker.load().queued == 0
    return started, worker


async def test_fcfs_and_priority_admission():
    assert (await _order("fcfs"))[0] == ["first", "low", "high", "mid"]
    assert (await _order("priority"))[0] == ["first", "high", "mid", "low"]
