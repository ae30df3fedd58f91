"""The draft worker process over real gRPC: discovery, hello, batched proposals, verdicts, release."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import spec_pb2, spec_pb2_grpc

pytestmark = pytest.mark.e2e


async def test_ngram_draft_worker_serves_batched_proposals(rt, spawn):
    spawn("workers.draft", "--method", "ngram", "--speculative-config",
          '{"prompt_lookup_min": 1, "prompt_lookup_max": 3}')
    client = await rt.client("draft", "speculate")
    [inst] = await client.wait_for_instances(1, timeout=60)
    assert inst.role == "draft" and inst.grpc_address.startswith("127.0.0.1:")
    models = await rt.models()
    await models.wait_for(lambda c: any(m.role == "draft" and m.spec_method == "ngram" for m in c.values()), 5)

    outgoing: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (msg := await outgoing.get()) is not None:
            yield msg

    async with grpc.aio.insecure_channel(inst.grpc_address) as channel:
        stub = spec_pb2_grpc.DraftServiceStub(channel)
        responses = stub.Speculate(requests())
        outgoing.put_nowait(spec_pb2.TargetMessage(hello=spec_pb2.Hello(target_id="t1", model="m", vocab_size=100)))
        ack = await responses.read()
        assert ack.hello_ack.method == "ngram" and ack.hello_ack.draft_id == inst.instance_id

        # Two sequences in one batch.
        outgoing.put_nowait(spec_pb2.TargetMessage(propose=spec_pb2.ProposeBatch(requests=[
            spec_pb2.ProposeRequest(seq_id="a", round=0, new_tokens=[1, 2, 3, 4, 1, 2], num_speculative_tokens=3),
            spec_pb2.ProposeRequest(seq_id="b", round=0, new_tokens=[7, 8, 9], num_speculative_tokens=3),
        ])))
        got = (await responses.read()).proposals.proposals
        assert {p.seq_id: list(p.token_ids) for p in got} == {"a": [3, 4, 1], "b": []}

        # The target accepted two drafts of "a" and emitted its own token 1 after them.
        outgoing.put_nowait(spec_pb2.TargetMessage(verify=spec_pb2.VerifyBatch(outcomes=[
            spec_pb2.VerifyOutcome(seq_id="a", round=0, num_accepted=2, emitted_tokens=[3, 4, 1])])))
        outgoing.put_nowait(spec_pb2.TargetMessage(propose=spec_pb2.ProposeBatch(requests=[
            spec_pb2.ProposeRequest(seq_id="a", round=1, new_tokens=[], num_speculative_tokens=2)])))
        [p] = (await responses.read()).proposals.proposals
        # History 1 2 3 4 1 2 3 4 1: the suffix "3 4 1" last occurred at positions 2..4, then "2 3".
        assert p.round == 1 and list(p.token_ids) == [2, 3]
        outgoing.put_nowait(spec_pb2.TargetMessage(release=spec_pb2.ReleaseBatch(seq_ids=["a", "b"])))
        outgoing.put_nowait(None)
