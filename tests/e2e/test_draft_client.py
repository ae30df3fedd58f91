"""The target's draft client against real draft worker processes: proposals, loss, and recovery."""

from __future__ import annotations

import asyncio
import time

import pytest

from workers.spec.draft_client import DraftPool
from workers.spec.proposer import DraftInput, VerifyResult

pytestmark = pytest.mark.e2e


async def test_pool_proposes_falls_back_when_the_draft_dies_and_resumes(rt, spawn):
    drafts = await rt.client("draft", "speculate")
    first = spawn("workers.draft", "--method", "ngram")
    await drafts.wait_for_instances(1, timeout=60)
    pool = DraftPool("target-1", "m", 100, drafts.instances)
    try:
        client = await pool.get()
        assert client is not None and client.method == "ngram"
        got = await client.propose([DraftInput("s", 0, [5, 6, 7, 5, 6], 2)], timeout=5)
        assert got["s"].token_ids == [7, 5]
        client.verified([VerifyResult("s", 0, 2, [7, 5, 6])])
        got = await client.propose([DraftInput("s", 1, [], 2)], timeout=5)
        assert got["s"].token_ids == [7, 5]

        first.kill()
        start = time.monotonic()
        assert await client.propose([DraftInput("s", 2, [], 2)], timeout=5) == {}
        assert time.monotonic() - start < 5.5
        await asyncio.sleep(0.2)
        assert client.broken
        assert await pool.get() is None or (await pool.get()) is None  # nobody to talk to

        spawn("workers.draft", "--method", "ngram")
        deadline = time.monotonic() + 60
        while (client := await pool.get()) is None:
            assert time.monotonic() < deadline, "speculation did not resume"
            await asyncio.sleep(0.3)
        got = await client.propose([DraftInput("s2", 0, [1, 2, 1], 1)], timeout=5)
        assert got["s2"].token_ids == [2]
    finally:
        await pool.close()


async def test_targets_spread_over_drafts_and_a_new_draft_takes_some_at_once(rt, spawn):
    drafts = await rt.client("draft", "speculate")
    spawn("workers.draft", "--method", "ngram", name="d1")
    await drafts.wait_for_instances(1, timeout=60)
    pools = [DraftPool(f"target-{i}", "m", 100, drafts.instances) for i in range(12)]
    try:
        first = {(await p.get()).draft_id for p in pools}
        assert len(first) == 1
        spawn("workers.draft", "--method", "ngram", name="d2")
        await drafts.wait_for_instances(2, timeout=60)
        chosen = [(await p.get()).draft_id for p in pools]
        # Rendezvous hashing: some targets move to the new draft, the others keep theirs.
        assert len(set(chosen)) == 2 and 1 <= sum(c not in first for c in chosen) <= 11
        assert [(await p.get()).draft_id for p in pools] == chosen  # stable
    finally:
        for p in pools:
            await p.close()
