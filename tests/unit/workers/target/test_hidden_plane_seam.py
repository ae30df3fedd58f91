"""Hidden states on the data plane through the real seam (gRPC on loopback, a draft service in this
process): the handshake agrees on a plane, the target's rows reach the proposer in the target's
dtype and the draft's layer order, no shared-memory name survives the handshake, each stream gets
its own ring, and the draft applies verdicts off its event loop."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from tests.unit.workers.draft.loopback import draft_on_loopback
from tests.support.wait import eventually
from workers.draft.drafter import Capabilities, Draft, DraftInput, Drafter
from workers.draft.service import DraftService
from workers.engine.hidden import HiddenStore
from workers.speculation.convert import verify_to_pb
from workers.speculation.hidden_plane import PlaneOffer
from workers.speculation.payloads import HiddenRef, VerifyResult

pytestmark = pytest.mark.unit

H = 8


class RecordingProposer(Drafter):
    caps = Capabilities("recording", (2, 1, 2), "float32")  # repeats and any order, as EAGLE-3 heads ask

    def __init__(self):
        self.seen: list[list[torch.Tensor]] = []
        self.verified_on: list[str] = []

    def commit(self, seq_id, tokens, hidden_states=(), sampling=None):
        self.seen.append(hidden_states)

    def draft(self, branches, ready=None):
        return [Draft([7]) for _ in branches]

    def verified(self, results):
        self.verified_on.append(threading.current_thread().name)
        self.seen.extend(r.hidden_states for r in results)

    def release(self, seq_ids):
        pass


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("tdm-h-")}


def write(client, store: HiddenStore, slots: list[int]) -> HiddenRef:
    """What the engine does for a batch of one sequence (DraftNews.block)."""
    offset, streamed = client.plane.write(len(slots), lambda rows: store.gather(torch.tensor(slots),
                                                                                client.plane.layers, rows))
    return HiddenRef(offset, len(slots), streamed)


@pytest.mark.parametrize("mode", ["shm", "stream"])
def test_rows_cross_the_plane_in_the_targets_dtype(mode):
    async def main():
        before = shm_names()
        store = HiddenStore((1, 2), 32, H, torch.bfloat16, "cpu")
        for layer in (1, 2):
            store.rows[layer].copy_((layer * 100 + torch.arange(32)).to(torch.bfloat16)[:, None].expand(32, H))
        proposer = RecordingProposer()
        offer = PlaneOffer(H, "bfloat16", mode)
        async with draft_on_loopback(DraftService(proposer, "d1"), hidden_layers=[1, 2], plane=offer) as client:
            assert client.plane is not None and client.plane.kind == mode and client.plane.layers == (1, 2)
            assert shm_names() == before  # the ring's name went with the handshake
            got = await client.propose([DraftInput("s", 0, [1, 2, 3, 4], 1, hidden_ref=write(client, store, [3, 4, 5]))],
                                       timeout=5)
            assert got["s"].token_ids == [7]
            client.verified([verify_to_pb(VerifyResult("s", 0, 1, [7, 8], hidden_ref=write(client, store, [6, 7])))])
            await eventually(lambda: len(proposer.seen) == 2, timeout=4, interval=0.02,
                             what="the draft seeing the verdict's hidden rows")
            first, second = proposer.seen
            assert [t.dtype for t in first] == [torch.bfloat16] * 3  # the target's; the draft casts for itself
            assert [t[:, 0].tolist() for t in first] == [[203, 204, 205], [103, 104, 105], [203, 204, 205]]
            assert [t[:, 0].tolist() for t in second] == [[206, 207], [106, 107], [206, 207]]
            assert client.hidden_bytes == 0 and client.plane_bytes == 5 * 2 * H * 2  # once, 2 distinct layers
            assert client.hidden_bytes_by_plane()[mode] == 5 * 2 * H * 2  # tandem_target_hidden_state_bytes
            assert proposer.verified_on and threading.main_thread().name not in proposer.verified_on
        assert shm_names() == before

    asyncio.run(main())


def test_each_stream_gets_its_own_ring_and_a_draft_without_planes_gets_tensors():
    async def main():
        offer = PlaneOffer(H, "float32", "auto")
        service = DraftService(RecordingProposer(), "d1")
        async with draft_on_loopback(service, hidden_layers=[1, 2], plane=offer) as a:
            names = {id(a): a.plane.ring.segment.name}
            async with draft_on_loopback(DraftService(RecordingProposer(), "d2"), hidden_layers=[1, 2],
                                         plane=offer) as b:
                assert a.plane.kind == b.plane.kind == "shm"
                assert b.plane.ring.segment.name != names[id(a)]
        async with draft_on_loopback(DraftService(RecordingProposer(), "d3"), hidden_layers=[1, 2],
                                     plane=PlaneOffer(H, "float32", "inline")) as c:
            assert c.plane is None  # inline: hidden states travel as Tensors, as before planes

    asyncio.run(main())


def test_inline_hidden_states_never_pass_the_message_limit(monkeypatch):
    """Inline (a draft without planes), a batch is split under the budget, and a sequence whose own rows
    pass it goes without them: that sequence gets nothing to draft from, the stream and the others live."""
    from workers.target import draft_client

    monkeypatch.setattr(draft_client, "INLINE_BUDGET", 1000)

    async def main():
        proposer = RecordingProposer()
        async with draft_on_loopback(DraftService(proposer, "d1"), hidden_layers=[1, 2]) as client:
            assert client.plane is None
            rows = lambda n: [torch.randn(n, H) for _ in (2, 1, 2)]  # noqa: E731 (3 layers × n rows × 32 bytes)
            inputs = [DraftInput("a", 0, [1, 2, 3, 4], 1, hidden_states=rows(3)),  # 288 bytes
                      DraftInput("b", 0, [1, 2, 3, 4], 1, hidden_states=rows(3)),
                      DraftInput("c", 0, [1] * 30, 1, hidden_states=rows(29)),  # 2,784 bytes: over alone
                      DraftInput("d", 0, [1, 2, 3, 4], 1, hidden_states=rows(3)),
                      DraftInput("e", 0, [1, 2, 3, 4], 1, hidden_states=rows(3))]
            sent = []
            real = client._put
            monkeypatch.setattr(client, "_put", lambda m: (sent.append(m), real(m)))
            got = await client.propose(inputs, timeout=5)
            assert sorted(got) == ["a", "b", "c", "d", "e"]  # every proposal came: the stream lives
            batches = [[r.seq_id for r in m.propose.requests] for m in sent if m.WhichOneof("body") == "propose"]
            assert batches == [["a", "b", "c", "d"], ["e"]]  # 288 × 3 ≤ 1000; c carries nothing
            seen = {len(h) for h in proposer.seen}
            assert seen == {0, 3}  # c's rows were dropped, the others' came whole
            assert client.hidden_bytes == 4 * 288

    asyncio.run(main())
