"""The draft stream's fast lane (workers.speculation.lane): the handshake on real gRPC agrees on a
Unix-domain socket and the stream's messages travel on it; a lane out of reach keeps them on gRPC; a
lane that breaks ends the pair and the target decodes plainly; only the stream's own token binds a
connection. Output is the target's own throughout."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest

from tests.unit.workers.draft.loopback import draft_on_loopback
from tests.support.wait import eventually
from tests.unit.workers.target.test_pipelined_seam import CFG, PARAMS, PROMPTS, serve_with
from workers.draft.ngram import NgramProposer
from workers.draft.oracle import OracleProposer
from workers.draft.service import DraftService
from workers.engine.engine import Engine
from workers.speculation import lane
from workers.speculation.lane import HEADER, LaneProtocol

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not lane.available(), reason="no Unix-domain sockets")]


@pytest.fixture(scope="module")
def expected(model):
    return Engine(model, CFG).generate(PROMPTS, PARAMS)


class _Counting(DraftService):
    """Counts the messages its targets send, by where they came: gRPC or the lane."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on: dict[bool, int] = {False: 0, True: 0}

    async def _on_message(self, stream, msg, on_lane: bool = False):
        self.on[on_lane] += 1
        await super()._on_message(stream, msg, on_lane)


def oracle(expected, error=0.2):
    return OracleProposer([PROMPTS[r] + expected[r] for r in PROMPTS], error, 256, seed=3)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sync"])
async def test_after_the_handshake_every_message_travels_on_the_lane(model, expected, pipelined):
    service = _Counting(oracle(expected), "d1", 8)
    async with draft_on_loopback(service, pipelined=pipelined, vocab_size=256) as client:
        assert client.lane is not None and client.seam.pipelined == pipelined
        engine, _, got = await serve_with(model, client)
        sent, received = client.lane.bytes_sent, client.lane.bytes_received
    assert got == expected
    assert engine.counters["d1"].num_drafts > 0 and engine.counters["d1"].num_accepted_tokens > 0
    assert service.on[False] == 1 and service.on[True] >= len(PROMPTS)  # gRPC: the Hello alone
    assert sent > 0 and received > 0


async def test_a_target_that_does_not_offer_a_lane_keeps_to_grpc(model, expected):
    service = _Counting(oracle(expected), "d1", 8)
    async with draft_on_loopback(service, pipelined=True, vocab_size=256, lanes=False) as client:
        assert client.lane is None
        _, _, got = await serve_with(model, client)
    assert got == expected
    assert service.on[True] == 0 and service.on[False] > len(PROMPTS)


async def test_a_lane_out_of_reach_keeps_the_stream_on_grpc(model, expected):
    """A draft on another host or in another container offers a socket this target cannot open: the
    pair speculates on the gRPC stream as before."""
    service = _Counting(oracle(expected), "d1", 8)
    await service.start()
    service._lanes.address = os.path.join(service._lanes._dir, "elsewhere.sock")  # as seen from another host
    async with draft_on_loopback(service, pipelined=True, vocab_size=256) as client:
        assert client.lane is None and not client.broken
        engine, _, got = await serve_with(model, client)
    assert got == expected
    assert engine.counters["d1"].num_drafts > 0
    assert service.on[True] == 0 and service.on[False] > len(PROMPTS)


async def test_a_lane_that_breaks_ends_the_pair_and_the_target_decodes_plainly(model, expected):
    """The draft's side of the lane closes mid-run (its process or socket gone): the target's client
    breaks, the step loop decodes plainly from then on, nothing is lost or wrong, and the draft
    forgets that target's sequences."""
    service = DraftService(oracle(expected), "d1", 8)
    async with draft_on_loopback(service, pipelined=True, vocab_size=256) as client:
        engine = Engine(model, CFG, num_speculative_tokens=3, adaptive=False)

        async def cut_when_drafting():
            while not engine.counters.get("d1") or not engine.counters["d1"].num_drafts:
                await asyncio.sleep(0.001)
            [stream] = service.streams.values()
            stream.lane.transport.close()  # as if the draft's end went away
            return loop.steps

        from tests.support.draft_pool import FixedPool
        from tests.support.serving import serve_through
        from workers.target.step_loop import StepLoop

        loop = StepLoop(engine, FixedPool(client))
        loop.start()
        cutter = asyncio.create_task(cut_when_drafting())
        try:
            got = await serve_through(loop, PROMPTS, PARAMS)
        finally:
            await loop.stop()
        cut_at = await cutter
        assert client.broken and loop.steps > cut_at + 10  # it went on serving, plainly
        await eventually(lambda: not service.streams and len(service.stager) == 0, timeout=2, interval=0.01,
                         what="the draft ending the stream and releasing its sequences")
    assert got == expected


async def test_only_the_streams_own_token_binds_a_connection():
    server = lane.LaneServer()
    assert await server.start()
    try:
        frames: list[bytes] = []
        token = server.expect(lambda proto: frames.append)
        lost: list[str] = []
        stranger = await lane.connect(server.address, b"x" * len(token), lambda f: None, lost.append)
        await eventually(lambda: lost, timeout=1, interval=0.005, what="the stranger's connection lost")
        assert stranger.closed  # refused: closed at its first frame
        bound = await lane.connect(server.address, token, lambda f: None, lost.append)
        bound.send(b"hello")
        again = await lane.connect(server.address, token, lambda f: None, lost.append)  # a token binds once
        await eventually(lambda: frames and again.closed, timeout=1, interval=0.005,
                         what="the frame delivered and the second binding closed")
        assert frames == [b"hello"] and again.closed and not bound.closed
        assert (os.stat(os.path.dirname(server.address)).st_mode & 0o777) == 0o700  # this user only
        bound.close()
    finally:
        await server.close()
    assert not os.path.exists(server.address)


def test_frames_split_and_joined_arrive_whole_and_in_order():
    got: list[bytes] = []
    lost: list[str] = []
    proto = LaneProtocol(got.append, lost.append)
    frames = [b"a", b"", b"bcdef" * 100, b"g"]
    wire = b"".join(HEADER.pack(len(f)) + f for f in frames)
    for i in range(0, len(wire), 7):  # in pieces that split headers and bodies alike
        proto.data_received(wire[i : i + 7])
    proto.data_received(wire)  # and all at once
    assert got == frames + frames and not lost
    proto.data_received(HEADER.pack(lane.MAX_FRAME + 1))  # a corrupt length ends the lane
    assert lost and proto.closed


async def test_a_new_draft_worker_removes_the_lane_a_killed_one_left_and_no_other(tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys
    import time

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed = subprocess.run(  # a draft worker's lane server, then SIGKILL: no clean stop removes its directory
        [sys.executable, "-c", "import asyncio, os, signal, sys, tempfile\n"
         "tempfile.tempdir = sys.argv[1]\n"
         "from workers.speculation.lane import LaneServer\n"
         "async def main():\n"
         "    server = LaneServer()\n"
         "    assert await server.start()\n"
         "    print(server.address, flush=True)\n"
         "    os.kill(os.getpid(), signal.SIGKILL)\n"
         "asyncio.run(main())\n", str(tmp_path)],
        capture_output=True, text=True, cwd=os.path.dirname(lane.__file__) + "/../..", timeout=60)
    assert killed.returncode == -signal.SIGKILL
    dead = os.path.dirname(killed.stdout.strip())
    assert os.path.exists(os.path.join(dead, lane.SOCKET_NAME))  # the socket file outlives its process
    live = lane.LaneServer()
    assert await live.start()
    young = tempfile.mkdtemp(prefix=lane.DIR_PREFIX)  # as a worker starting right now has it: no socket yet
    old = time.time() - 2 * lane.STALE_AFTER
    for path in (dead, os.path.dirname(live.address)):
        os.utime(path, (old, old))
    server = lane.LaneServer()
    try:
        assert await server.start()
        assert not os.path.exists(dead)
        assert os.path.exists(live.address) and os.path.exists(young)
        stream = await lane.connect(live.address, live.expect(lambda proto: (lambda f: None)), lambda f: None,
                                    lambda r: None)  # the live worker's lane still takes its targets
        assert not stream.closed
        stream.close()
    finally:
        await server.close()
        await live.close()
