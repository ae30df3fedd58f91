"""The target's draft client against real draft worker processes: proposals, loss, and recovery."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from runtime.messages import InstanceRecord
from tests.support.wait import eventually
from workers.target.draft_pool import DraftPool
from workers.draft.drafter import DraftInput, VerifyResult
from workers.speculation.convert import verify_to_pb

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
        client.verified([verify_to_pb(VerifyResult("s", 0, 2, [7, 5, 6]))])
        got = await client.propose([DraftInput("s", 1, [], 2)], timeout=5)
        assert got["s"].token_ids == [7, 5]

        first.kill()
        start = time.monotonic()
        assert await client.propose([DraftInput("s", 2, [], 2)], timeout=5) == {}
        assert time.monotonic() - start < 5.5
        await eventually(lambda: client.broken, timeout=5, what="the stream to the killed draft marked broken")
        assert await pool.get() is None or (await pool.get()) is None  # nobody to talk to

        spawn("workers.draft", "--method", "ngram")
        client = await eventually(pool.get, timeout=60, interval=0.3, what="speculation resuming")
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


def _record(instance_id: str, address: str) -> InstanceRecord:
    return InstanceRecord(instance_id=instance_id, namespace="t", component="draft", endpoint="speculate",
                          subject=f"t.draft.speculate.{instance_id}", role="draft", grpc_address=address)


async def test_a_failing_draft_worker_is_retried_with_backoff(caplog):
    with socket.socket() as s:  # a port nobody listens on: every connect is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = DraftPool("target-1", "m", 100, lambda: [_record("gone", f"127.0.0.1:{port}")])
    start = time.monotonic()
    while time.monotonic() - start < 5.0:  # asked for 5 s on end: the retries' backoff is what is checked
        assert await pool.get() is None
        await asyncio.sleep(0.1)
    attempts = [r for r in caplog.records if "could not open a stream to draft worker gone" in r.getMessage()]
    # tries at 0 s and ~2 s, the next not before ~6 s (2 s, doubling)
    assert len(attempts) == 2, [r.getMessage() for r in attempts]
    assert "trying again in 2 s" in attempts[0].getMessage() and "trying again in 4 s" in attempts[1].getMessage()
    await pool.close()


async def test_poll_never_waits_for_a_stream_to_open(rt, spawn):
    # A draft worker that accepts connections and never answers: opening a stream to it takes the
    # whole connect timeout. The target's step loop (poll) must not wait for that.
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen()
        records = [_record("hole", "127.0.0.1:%d" % hole.getsockname()[1])]
        pool = DraftPool("target-1", "m", 100, lambda: records)
        try:
            for _ in range(20):
                start = time.monotonic()
                assert await pool.poll() is None
                assert time.monotonic() - start < 0.5
                await asyncio.sleep(0.05)

            # A working draft worker appears: poll picks it up once the silent one has failed.
            spawn("workers.draft", "--method", "ngram")
            drafts = await rt.client("draft", "speculate")
            [real] = await drafts.wait_for_instances(1, timeout=60)
            records.append(real)
            client = await eventually(pool.poll, timeout=30, interval=0.1, what="poll returning the working draft worker")
            assert client.draft_id == real.instance_id
            got = await client.propose([DraftInput("s", 0, [1, 2, 1], 1)], timeout=5)
            assert got["s"].token_ids == [2]
        finally:
            await pool.close()
