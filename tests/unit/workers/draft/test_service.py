"""The draft service, over real gRPC on loopback and its own run loop, drafts ahead only for sequences
whose whole proposals keep being accepted."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.wait import eventually
from tests.unit.workers.draft.loopback import draft_on_loopback
from workers.draft.drafter import Capabilities, Draft, DraftInput, Drafter, SamplingSpec, VerifyResult
from workers.draft.service import DraftService
from workers.draft.work import Requests
from workers.speculation.convert import verify_to_pb

pytestmark = pytest.mark.unit


class CountingProposer(Drafter):
    caps = Capabilities("fake", drafts_ahead=True)

    def __init__(self):
        self.predrafted: list[str] = []  # sequences drafted ahead: the round's branch, 2γ + 1 long (γ = 4)
        self.released: list[str] = []

    def commit(self, seq_id, tokens, hidden_states=(), sampling=SamplingSpec()):
        pass

    def draft(self, branches, ready=None):
        self.predrafted.extend(b.seq_id for b in branches if b.num_tokens == 9)
        return [Draft(list(range(b.num_tokens))) for b in branches]

    def verified(self, results):
        pass

    def release(self, seq_ids):
        self.released.extend(seq_ids)


async def run_rounds(client, seq_id: str, accepted: list[int]) -> None:
    """Rounds over the real gRPC stream and the service's own run loop: a proposal, then its verdict."""
    for rnd, n in enumerate(accepted):
        got = await client.propose([DraftInput(seq_id, rnd, [], 4)], timeout=5)
        assert got[seq_id].token_ids == [0, 1, 2, 3]
        client.verified([verify_to_pb(VerifyResult(seq_id, rnd, n, list(range(n + 1))))])


def test_drafting_ahead_backs_off_for_rejected_proposals_and_resumes_after_full_ones():
    async def main():
        proposer = CountingProposer()
        async with draft_on_loopback(DraftService(proposer, "d1")) as client:
            await run_rounds(client, "good", [4] * 10)  # every proposal wholly accepted
            # drafting ahead runs on the service's loop after it answers (and the verdict is fire-and-forget),
            # so what it did after the last round shows up shortly after ``propose`` returns: wait for it
            await eventually(lambda: proposer.predrafted.count("good") == 10, timeout=5, interval=0.01,
                             what=lambda: f"10 rounds drafted ahead (got {proposer.predrafted.count('good')})")
            await run_rounds(client, "bad", [0] * 20)  # rejected at the first token every time
            # a count that should stop growing has no event to wait on: give the last round's drafting
            # ahead, if any, time to happen
            await asyncio.sleep(0.2)
            bad_ahead = proposer.predrafted.count("bad")
            assert 1 <= bad_ahead <= 7
            await run_rounds(client, "bad", [4, 4, 4])  # a draft that got good again
            await eventually(lambda: proposer.predrafted.count("bad") > bad_ahead, timeout=5, interval=0.01,
                             what="drafting ahead resumed")
            assert proposer.predrafted.count("good") == 10  # nothing drafted ahead for a finished round twice
            client.release(["good", "bad"])
            await eventually(lambda: len(proposer.released) == 2, timeout=5, interval=0.01,
                             what=lambda: f"both released (released: {proposer.released})")
            assert sorted(proposer.released) == ["bad", "good"]

    asyncio.run(main())


def test_no_overlap_never_drafts_ahead():
    async def main():
        proposer = CountingProposer()
        async with draft_on_loopback(DraftService(proposer, "d1", overlap=False)) as client:
            await run_rounds(client, "s", [4] * 5)
        assert proposer.predrafted == []

    asyncio.run(main())


def test_a_budget_over_the_drafts_maximum_is_cut_keeping_the_tree_shape():
    """Over real gRPC on loopback: a propose request for more nodes than the draft worker's maximum
    reaches the proposer cut to that maximum, with its tree shape and depth bound intact."""
    class Recording(CountingProposer):
        def __init__(self):
            super().__init__()
            self.seen: list[DraftInput] = []

        def propose(self, batch):
            self.seen.extend(batch)
            return super().propose(batch)

    async def main():
        proposer = Recording()
        async with draft_on_loopback(DraftService(proposer, "d1", max_num_speculative_tokens=6)) as client:
            ask = DraftInput("s", 0, [1, 2, 3], 16, tree_topk=4, tree_depth=5, max_depth=3)
            got = await client.propose([ask], timeout=5)
            assert len(got["s"].token_ids) == 6
            seen = proposer.seen[0]
            assert (seen.num_speculative_tokens, seen.tree_topk, seen.tree_depth, seen.max_depth) == (6, 4, 5, 3)

    asyncio.run(main())


def test_a_staging_that_finds_news_waiting_takes_the_news_before_staging_its_answers():
    """Pipelined seam: a staging call that had to answer (nothing streamed fitted) stages what
    verifying the answers may lead to at once, in a second drafting call, only when no news is
    waiting. With news waiting the stager is behind the target: a second call would put it further
    behind (news waits a whole drafting call longer, and a late stager drafts spare tokens for the
    steps it is behind, which makes each call longer still: at batch 8 on two cores such a draft
    stayed a few steps late for whole runs). The answers' outcomes are staged with that news."""
    from workers.draft.oracle import OracleProposer
    from workers.draft.service import _Stream

    ref = list(range(100, 160))

    async def main(news_waiting: bool):
        oracle = OracleProposer([ref], 0.0, 1000)
        calls: list[int] = []
        real = oracle.draft
        oracle.draft = lambda branches, *ready: calls.append(len(branches)) or real(branches, *ready)
        service = DraftService(oracle, "d1")
        stream = _Stream("t1", asyncio.Queue(), pipelined=True)
        first = DraftInput("s", 0, ref[:10], 2)
        if news_waiting:
            service._work.put_nowait(Requests(stream, [DraftInput("s", 1, ref[10:11], 2)]))
        await service._stage([Requests(stream, [first])], {"s": (stream, first)})
        sent = [p for msg in iter_queue(stream.out) for p in msg.proposals.proposals]
        return calls, sent

    calls, sent = asyncio.run(main(news_waiting=False))
    assert len(calls) == 2  # the answer, then its outcomes
    assert [p.start for p in sent][0] == 10 and len(sent) > 1
    calls, sent = asyncio.run(main(news_waiting=True))
    assert len(calls) == 1 and [p.start for p in sent] == [10]  # the answer only: the news comes first


def test_staged_proposals_leave_before_the_drafting_calls_last_pass():
    """A drafter that says its chains are ready before its last pass (that pass only guesses what
    follows): the service streams the proposals then, while the call goes on, and not again after."""
    import threading

    from workers.draft.oracle import OracleProposer
    from workers.draft.service import _Stream

    ref = list(range(100, 160))
    last_pass = threading.Event()

    class SlowLastPass(OracleProposer):
        def draft(self, branches, ready=None):
            chains = super().draft(branches)
            if ready is not None:
                ready([Draft(c.tokens[: b.num_tokens - 1], c.alternatives[: b.num_tokens - 1])
                       for b, c in zip(branches, chains)])
                last_pass.wait(10)  # the last pass: until the test has seen the proposals (or 10 s)
            return chains

    async def main():
        service = DraftService(SlowLastPass([ref], 0.0, 1000), "d1")
        stream = _Stream("t1", asyncio.Queue(), pipelined=True)
        first = DraftInput("s", 0, ref[:10], 2)
        staging = asyncio.create_task(service._stage([Requests(stream, [first])], {"s": (stream, first)}))
        await eventually(lambda: not stream.out.empty() or staging.done(), timeout=5, interval=0.01,
                         what="a first proposal streamed, or the staging call done")
        during = [p for msg in iter_queue(stream.out) for p in msg.proposals.proposals]
        busy = not staging.done()
        last_pass.set()
        await staging
        after = [p for msg in iter_queue(stream.out) for p in msg.proposals.proposals]
        return busy, during, after, service.stats.proposals

    busy, during, after, counted = asyncio.run(main())
    assert busy and during and during[0].start == 10 and list(during[0].token_ids) == list(range(110, 113))
    assert len(during) + len(after) == counted  # each proposal streamed once, all counted
    assert all(p.start > 10 for p in after)  # the answer's outcomes, staged by the next call


def iter_queue(queue: asyncio.Queue):
    while not queue.empty():
        yield queue.get_nowait()
