"""Replacing a draft worker while serving, with the real target worker (the bundled SmolLM2 demo),
ngram draft workers and the frontend under a bounded load: a second draft is added, the first one
is stopped with SIGTERM, the target switches to the new draft and no request fails or comes back
short."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import httpx
import pytest

from runtime.events import TOPIC_SPEC_STATS
from runtime.messages import SpecStatsEvent
from tests.support.servers import free_port
from tests.support.http import wait_for_model
from tests.support.flags import speculative

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
TOTAL, CONCURRENCY, MAX_TOKENS = 24, 4, 16
DRAFT_ARGS = ("--method", "ngram", "--model-name", MODEL, "--lease-ttl", "3")
# Repetitive text, so the n-gram proposer finds matches and the target really verifies drafts.
TEXT = "the red fox jumps over the lazy dog, the red fox jumps over the lazy dog, the red fox"



async def test_replace_a_draft_worker_under_load(rt, spawn):
    first = spawn("workers.draft", *DRAFT_ARGS, name="draft-1")
    drafts = await rt.client("draft", "speculate")
    [draft1] = await drafts.wait_for_instances(1, timeout=60)
    # load_aware false: this test is about which draft the target speculates with, so it must
    # speculate whatever the cost model makes of two busy cores
    spawn("workers.target", "--served-model-name", MODEL, "--num-speculative-tokens", "4", "--kv-cache-gb", "0.25",
          *speculative(load_aware=False), "--lease-ttl", "3", name="target")
    port = free_port()
    spawn("frontend", "--http-port", str(port), name="frontend")
    await wait_for_model(f"http://127.0.0.1:{port}", MODEL, timeout=180)

    # Verification steps per draft worker, from the target's cumulative (target, draft) counters.
    steps: dict[str, int] = {}
    first_used: dict[str, float] = {}

    def on_stats(event: SpecStatsEvent) -> None:
        steps[event.draft_id] = max(steps.get(event.draft_id, 0), event.num_drafts)
        if event.num_drafts:
            first_used.setdefault(event.draft_id, time.monotonic())

    await rt.subscribe(TOPIC_SPEC_STATS, SpecStatsEvent, on_stats)

    done, results = 0, []
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:

        async def run(i: int):
            nonlocal done
            body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "messages": [{"role": "user", "content": f"{i}: copy this: {TEXT}"}]}
            async with sem:
                try:
                    resp = await client.post("/v1/chat/completions", json=body)
                    data = resp.json()
                    results.append((i, resp.status_code, data["choices"][0]["finish_reason"],
                                    data["usage"]["completion_tokens"]))
                except Exception as exc:  # counted, reported below
                    results.append((i, 0, f"failed: {exc!r}", 0))
                done += 1

        load = asyncio.gather(*(run(i) for i in range(TOTAL)))
        deadline = time.monotonic() + 60
        while draft1.instance_id not in first_used:
            assert time.monotonic() < deadline, "the target never speculated with the first draft worker"
            await asyncio.sleep(0.1)

        second = spawn("workers.draft", *DRAFT_ARGS, name="draft-2")
        await drafts.wait_for_instances(2, timeout=60)
        draft2 = next(r for r in drafts.instances() if r.instance_id != draft1.instance_id)
        assert draft2.pid == second.pid
        first.signal(signal.SIGTERM)
        stopped = time.monotonic()
        stopped_at = done
        deadline = stopped + 30
        while draft2.instance_id not in first_used and done < TOTAL:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await load

    bad = [r for r in results if r[1] != 200 or r[2] not in ("length", "stop")
           or (r[2] == "length" and r[3] != MAX_TOKENS)]
    assert not bad and len(results) == TOTAL, bad[:5]
    assert stopped_at < TOTAL, "the load ended before the draft worker was replaced"
    assert draft2.instance_id in first_used, f"the target never used the new draft worker: {steps}"
    logging.getLogger(__name__).info("target switched to the new draft %.2fs after SIGTERM to the old one; "
                                     "verification steps per draft: %s", first_used[draft2.instance_id] - stopped, steps)
    assert first_used[draft2.instance_id] - stopped < 5.0
    assert await asyncio.to_thread(first.wait, 40) == 0, first.logs()[-3000:]
