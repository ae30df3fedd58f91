"""The draft service drafts ahead only for sequences whose whole proposals keep being accepted."""

from __future__ import annotations

import asyncio

import pytest

from workers.draft.service import AHEAD_MIN, DraftService, _Stream
from workers.draft.proposer import DraftInput, DraftOutput, Proposer, VerifyResult

pytestmark = pytest.mark.unit


class CountingProposer(Proposer):
    method = "fake"
    drafts_ahead = True

    def __init__(self):
        self.predrafted: list[str] = []

    def propose(self, batch):
        return [DraftOutput(d.seq_id, d.round, list(range(d.num_tokens))) for d in batch]

    def predraft(self, seq_ids, num_tokens):
        self.predrafted.extend(seq_ids)

    def verified(self, results):
        pass

    def release(self, seq_ids):
        pass


async def run_rounds(service: DraftService, stream: _Stream, seq_id: str, accepted: list[int]) -> None:
    for rnd, n in enumerate(accepted):
        await service._process([("propose", stream, [DraftInput(seq_id, rnd, [], 4)])])
        if service._ahead:
            await service._draft_ahead()
        await service._process([("verify", stream, [VerifyResult(seq_id, rnd, n, list(range(n + 1)))])])


def test_drafting_ahead_backs_off_for_rejected_proposals_and_resumes_after_full_ones():
    async def main():
        proposer = CountingProposer()
        service = DraftService(proposer, "d1")
        stream = _Stream("t1", asyncio.Queue())
        await run_rounds(service, stream, "good", [4] * 10)  # every proposal wholly accepted
        assert proposer.predrafted.count("good") == 10
        await run_rounds(service, stream, "bad", [0] * 20)  # rejected at the first token every time
        bad_ahead = proposer.predrafted.count("bad")
        assert 1 <= bad_ahead <= 7 and service._full_rate["bad"] < AHEAD_MIN
        await run_rounds(service, stream, "bad", [4, 4, 4])  # a draft that got good again
        assert proposer.predrafted.count("bad") > bad_ahead
        await service._process([("release", stream, ["good", "bad"])])
        assert not service._full_rate and not service._proposed and not service._ahead

    asyncio.run(main())


def test_no_overlap_never_drafts_ahead():
    async def main():
        proposer = CountingProposer()
        service = DraftService(proposer, "d1", overlap=False)
        await run_rounds(service, _Stream("t1", asyncio.Queue()), "s", [4] * 5)
        assert proposer.predrafted == []

    asyncio.run(main())


def test_a_budget_over_the_drafts_maximum_is_cut_keeping_the_tree_shape():
    """Over real gRPC on loopback: a propose request for more nodes than the draft worker's maximum
    reaches the proposer cut to that maximum, with its tree shape and depth bound intact."""
    from tests.unit.workers.draft.loopback import draft_on_loopback

    class Recording(CountingProposer):
        def __init__(self):
            super().__init__()
            self.seen: list[DraftInput] = []

        def propose(self, batch):
            self.seen.extend(batch)
            return super().propose(batch)

    async def main():
        proposer = Recording()
        async with draft_on_loopback(DraftService(proposer, "d1", max_speculative_tokens=6)) as client:
            ask = DraftInput("s", 0, [1, 2, 3], 16, tree_topk=4, tree_depth=5, max_depth=3)
            got = await client.propose([ask], timeout=5)
            assert len(got["s"].token_ids) == 6
            seen = proposer.seen[0]
            assert (seen.num_tokens, seen.tree_topk, seen.tree_depth, seen.max_depth) == (6, 4, 5, 3)

    asyncio.run(main())
