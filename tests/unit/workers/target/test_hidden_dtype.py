"""Hidden states travel in the draft's dtype: the draft says it in its HelloAck, the target's draft
client casts before sending (real gRPC on loopback, a draft service in this process)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.unit.workers.draft.loopback import draft_on_loopback
from tests.support.wait import eventually
from workers.draft.drafter import Capabilities, Draft, DraftInput, Drafter, VerifyResult
from workers.draft.service import DraftService
from workers.speculation.convert import verify_to_pb

pytestmark = pytest.mark.unit


class RecordingProposer(Drafter):
    caps = Capabilities("recording", (1, 2), "bfloat16")

    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def commit(self, seq_id, tokens, hidden_states=(), sampling=None):
        self.seen.extend(hidden_states)

    def draft(self, branches, ready=None):
        return [Draft([7]) for _ in branches]

    def verified(self, results):
        for r in results:
            self.seen.extend(r.hidden_states)

    def release(self, seq_ids):
        pass


def test_hidden_states_are_sent_in_the_drafts_dtype():
    async def main():
        proposer = RecordingProposer()
        async with draft_on_loopback(DraftService(proposer, "d1"), hidden_layers=[1, 2]) as client:
            assert client.hidden_dtype == "bfloat16" and client.hidden_layers == [1, 2]
            hidden = [torch.randn(3, 8), torch.randn(3, 8)]  # float32 on the target
            got = await client.propose([DraftInput("s", 0, [1, 2, 3], 1, hidden_states=hidden)], timeout=5)
            assert got["s"].token_ids == [7]
            # verdicts travel converted (the target converts them on its engine thread)
            client.verified([verify_to_pb(VerifyResult("s", 0, 1, [7, 8], [torch.randn(2, 8), torch.randn(2, 8)]),
                                          client.hidden_dtype)])
            await eventually(lambda: len(proposer.seen) == 4, timeout=2, interval=0.02,
                             what="the draft seeing the verdict's hidden rows")
            assert [t.dtype for t in proposer.seen] == [torch.bfloat16] * 4
            assert torch.equal(proposer.seen[0], hidden[0].to(torch.bfloat16))
            assert client.hidden_bytes == (3 + 3 + 2 + 2) * 8 * 2  # rows × width × 2 bytes

    asyncio.run(main())
