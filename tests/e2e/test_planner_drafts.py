"""The draft:target rule with real workers on the bundled demo model: ``tandem up`` with two target
workers, one EAGLE-3 draft worker (the shipped head) and the planner (local connector). Under load the
two targets share the one draft and wait on its proposals while drafting pays, so the planner adds a
draft worker (``targets_wait``, or ``drafts_busy``); the launcher starts it and the targets spread over
both. When the load stops, neither draft proposes anything, and the planner removes one
(``drafts_idle``) down to ``--min-drafts 1``. The wait threshold is 5% of the targets' busy time
(default 10%): what two shared CPU cores show is in the log line of each decision, printed at the end."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from tests.support.http import wait_for_model
from tests.support.servers import free_port

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
TEXT = "the red fox jumps over the lazy dog, the red fox jumps over the lazy dog, the red fox"


async def test_planner_adds_a_draft_under_load_and_removes_one_when_idle(rt, spawn):
    port = free_port()
    up = spawn("deploy.cli", "up", "--targets", "2", "--drafts", "1",
               "--num-speculative-tokens", "4", "--no-load-aware-speculation", "--http-port", str(port),
               "--drain-timeout", "10", "--planner", "--planner-args",
               "--itl-p90 10s --adjustment-interval 1 --latency-window 4 --up-cooldown 2 --down-cooldown 2 "
               "--draft-wait-high 0.05 --min-targets 2 --min-drafts 1 --max-drafts 2", name="tandem-up")
    drafts = await rt.client("draft", "speculate")
    await wait_for_model(f"http://127.0.0.1:{port}", MODEL, timeout=300)
    up.wait_for_log("Tandem is ready", timeout=120)
    assert len(drafts.instances()) == 1
    stop = asyncio.Event()
    failures: list[str] = []

    async def client(i: int, http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": f"{i}: {TEXT}", "max_tokens": 32,
                                                            "temperature": 0})
            if resp.status_code != 200:
                failures.append(f"{resp.status_code} {resp.text[:200]}")

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
        load = [asyncio.create_task(client(i, http)) for i in range(6)]
        try:
            deadline = time.monotonic() + 150
            while len(drafts.instances()) < 2:
                assert time.monotonic() < deadline, "no draft was added under load:\n" + up.logs()[-4000:]
                await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.gather(*load, return_exceptions=True)
    added = re.search(r"pool draft: 1 -> 2 \((targets_wait|drafts_busy|proposals_late|drafts_slow|drafts_queued)\): (.*)", up.logs())
    assert added, up.logs()[-4000:]
    deadline = time.monotonic() + 90
    while len(drafts.instances()) > 1:
        assert time.monotonic() < deadline, "no draft was removed when idle:\n" + up.logs()[-4000:]
        await asyncio.sleep(0.5)
    removed = re.search(r"pool draft: 2 -> 1 \(drafts_idle\): (.*)", up.logs())
    assert removed, up.logs()[-4000:]
    assert not failures, failures[:3]
    print("added:", added.group(0))
    print("removed:", removed.group(0))
