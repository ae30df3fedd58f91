"""Incarnation fencing (issue 59): a draft worker restarted under the same worker id is another
process. Real draft services on loopback gRPC, a real DraftPool and DraftClients, a real tiny engine
and step loop: the stream to the old incarnation is dropped once the new one is known, nothing the
old one sent is applied, and the new one hears every sequence from scratch."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from proto import spec_pb2, spec_pb2_grpc
from runtime.messages import InstanceRecord, SamplingParams
from tests.support.draft_pool import FixedPool
from tests.support.serving import serve_through
from tests.support.wait import eventually
from workers.draft.ngram import NgramProposer
from workers.draft.service import DraftService
from workers.engine.engine import Engine, EngineConfig
from workers.target.draft_client import DraftClient, IncompatibleDraft
from workers.target.draft_pool import DraftPool
from workers.target.step_loop import StepLoop

pytestmark = pytest.mark.unit

VOCAB = 256
CFG = EngineConfig(num_blocks=128, block_size=4)
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
PROMPTS = {"a": list(range(10, 22)), "b": [7, 8, 9, 7, 8, 9, 7, 8, 9, 7], "c": list(range(40, 47))}


class RecordingService(DraftService):
    """A draft service that records the first request it hears for each sequence: (round, new tokens)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first: dict[str, tuple[int, int]] = {}

    async def _on_propose(self, stream, batch):
        for r in batch.requests:
            self.first.setdefault(r.seq_id, (r.round, len(r.new_tokens)))
        await super()._on_propose(stream, batch)


@contextlib.asynccontextmanager
async def serving(service: DraftService):
    """``service`` on a free loopback port; yields its address."""
    await service.start()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    spec_pb2_grpc.add_DraftServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        await service.stop()


def record(draft_id: str, address: str, incarnation: int) -> InstanceRecord:
    return InstanceRecord(draft_id, "ns", "draft", "speculate", "", role="draft", grpc_address=address,
                          incarnation=incarnation)


def request(seq_id: str, round_: int, tokens: list[int]) -> spec_pb2.ProposeRequest:
    return spec_pb2.ProposeRequest(seq_id=seq_id, round=round_, new_tokens=tokens, num_speculative_tokens=3)


async def test_the_pool_fences_an_older_incarnation_and_applies_nothing_it_sent():
    old, new = DraftService(NgramProposer(1, 3), "d1", 8, incarnation=1), DraftService(NgramProposer(1, 3), "d1", 8,
                                                                                       incarnation=2)
    async with serving(old) as old_address, serving(new) as new_address:
        records = [record("d1", old_address, 1)]
        pool = DraftPool("t1", "m", VOCAB, lambda: list(records), pipelined=True)
        try:
            first = await pool.get()
            assert first is not None and first.incarnation == 1 and first.seam.pipelined
            first.news([], [], [request("s", 0, [5, 6, 7, 5, 6, 7, 5, 6])])
            # proposals of the old incarnation arrived and wait to be taken by the next step
            await eventually(lambda: first._inbox, timeout=5, what="the old incarnation's proposals")

            records[:] = [record("d1", new_address, 2)]  # restarted under the same id
            assert await pool.poll() is None  # the old stream is fenced at once; the new one opens meanwhile
            assert first.broken and first.take() == []  # nothing it sent is applied
            assert pool.streams_fenced == 1 and pool.proposals_fenced() >= 1
            second = await eventually(pool.poll, timeout=5, what="a stream to the new incarnation")
            assert second is not first and second.draft_id == "d1" and second.incarnation == 2
            await eventually(lambda: not old.streams, timeout=5, what="the old incarnation's stream closed")
            assert [s.target_id for s in new.streams.values()] == ["t1"]

            # the old process registers again (it lost its lease, say): not taken back
            records[:] = [record("d1", old_address, 1)]
            for _ in range(3):
                assert await pool.poll() is second
            assert pool.streams_fenced == 1 and not old.streams
        finally:
            await pool.close()


async def test_a_handshake_from_another_worker_or_an_older_incarnation_is_refused():
    service = DraftService(NgramProposer(1, 3), "d1", 8, incarnation=5)
    async with serving(service) as address:
        for rec, label in [(record("d1", address, 6), "incarnation"), (record("d2", address, 5), "draft_id")]:
            client = DraftClient("t1", "m", VOCAB, rec)
            with pytest.raises(IncompatibleDraft) as refused:
                await client.connect()
            await client.close()
            assert refused.value.label == label
        # the record lags (the process restarted since): the handshake's newer incarnation is taken
        client = DraftClient("t1", "m", VOCAB, record("d1", address, 4))
        await client.connect()
        assert client.incarnation == 5
        await client.close()
        pool = DraftPool("t1", "m", VOCAB, lambda: [record("d1", address, 4)])
        try:
            assert (await pool.get()).incarnation == 5
            assert pool._stale("d1", 4)  # the lagging record's incarnation is older than the one known now
        finally:
            await pool.close()


@pytest.fixture(scope="module")
def expected(model):
    return Engine(model, CFG).generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_new_incarnation_hears_every_sequence_from_scratch(model, expected, pipelined):
    """The step loop switches streams between two steps, to a new incarnation of the same draft worker
    (no step without a draft between): greedy output equals the target alone, and the new incarnation's
    first request for every sequence carries its whole context, never the old one's per-sequence state."""
    old = RecordingService(NgramProposer(1, 3), "d1", 8, incarnation=1)
    new = RecordingService(NgramProposer(1, 3), "d1", 8, incarnation=2)
    async with serving(old) as old_address, serving(new) as new_address:
        first = DraftClient("t1", "m", VOCAB, record("d1", old_address, 1), pipelined=pipelined)
        second = DraftClient("t1", "m", VOCAB, record("d1", new_address, 2), pipelined=pipelined)
        await first.connect()
        await second.connect()
        pool = FixedPool(first)
        engine = Engine(model, CFG, num_speculative_tokens=3, adaptive=False)
        loop = StepLoop(engine, pool)
        loop.start()
        try:
            serve = asyncio.create_task(serve_through(loop, PROMPTS, PARAMS))
            await eventually(lambda: (len(old.first) == len(PROMPTS) and loop.steps >= 6) or serve.done(),
                             timeout=30, what="the old incarnation drafting every sequence")
            assert not serve.done(), "served before the draft worker restarted"
            first.fence(2)
            pool.client = second  # the pool's next answer: the new incarnation, at once
            got = await serve
        finally:
            await loop.stop()
            await first.close()
            await second.close()
    assert got == expected
    assert new.first, "the new incarnation was never asked"
    for seq_id, (round_, n) in new.first.items():
        # the whole context (the prompt, plus what was emitted before it was asked: a sequence asked
        # mid-stream carries more), never a delta
        assert n >= len(PROMPTS[seq_id]) + (round_ > 0), (seq_id, round_, n)
    assert any(n > len(PROMPTS[s]) for s, (_, n) in new.first.items()), new.first  # mid-stream, some


async def test_the_step_loop_gets_the_same_streams_between_looks_at_discovery_and_never_a_broken_one():
    """The step loop asks the pool for its streams before every step: between looks at discovery
    (``REVISE_EVERY_S``) it gets the very same list back, a draft that registers is streamed to soon
    after, and a stream that broke is left out at once, inside the window."""
    first, second = (DraftService(NgramProposer(1, 3), draft_id, 8, incarnation=1) for draft_id in ("d1", "d2"))
    async with serving(first) as first_address:
        records = [record("d1", first_address, 1)]
        pool = DraftPool("t1", "m", VOCAB, lambda: list(records), streams=2)

        async def streams(n: int):
            got = await pool.streams()
            return got if len(got) == n else None

        try:
            one = await eventually(lambda: streams(1), timeout=5, what="a stream to d1")
            assert [c.draft_id for c in one] == ["d1"] and await pool.streams() is one
            async with serving(second) as second_address:
                records.append(record("d2", second_address, 1))
                two = await eventually(lambda: streams(2), timeout=5, what="streams to d1 and d2")
                assert sorted(c.draft_id for c in two) == ["d1", "d2"] and await pool.streams() is two
            lost = next(c for c in two if c.draft_id == "d2")
            await eventually(lambda: lost.broken, timeout=5, what="d2's stream broken")
            got = await pool.streams()
            assert lost not in got and [c.draft_id for c in got] == ["d1"]
        finally:
            await pool.close()
