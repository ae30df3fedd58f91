"""The worker's next-turn prefill over a fake step loop: pieces of whole blocks from the cached
prefix on, dropped when busy or short of blocks, and stepping aside when a real request arrives."""

from __future__ import annotations

import asyncio

import pytest

from runtime.kv_hash import block_hashes
from runtime.messages import NEXT_TURN_DONE, NEXT_TURN_DROPPED, GenerateRequest, TokenDelta
from workers.target.next_turn import NextTurnPrefill

pytestmark = pytest.mark.unit

BS = 4


class FakeBlocks:
    block_size, num_blocks = BS, 100

    def __init__(self, cached: list[int], free: int = 100):
        self.cached, self.num_free_blocks = set(cached), free

    def match_prefix(self, hashes):
        out = []
        for h in hashes:
            if h not in self.cached:
                break
            out.append(h)
        return out


class FakeEngine:
    def __init__(self, blocks):
        self.blocks = blocks

    def validate(self, tokens, params, output_ids=()):
        pass


class FakeLoop:
    """Answers each piece at once (auto) or when told; records submissions and aborts."""

    def __init__(self, blocks, auto=True):
        self.engine = FakeEngine(blocks)
        self.auto = auto
        self.queues: dict[str, asyncio.Queue] = {}
        self.pieces: list[int] = []
        self.aborted: list[str] = []
        self.real = 0

    @property
    def num_requests(self) -> int:
        return len(self.queues) + self.real

    def submit(self, rid, tokens, params, num_speculative_tokens=None, lora=None, priority=0):
        assert params.max_tokens == 1 and params.temperature == 0
        self.pieces.append(len(tokens))
        out = asyncio.Queue()
        self.queues[rid] = out
        if self.auto:
            self.queues.pop(rid)
            out.put_nowait(TokenDelta([1], finish_reason="length"))
        return out

    def abort(self, rid):
        self.aborted.append(rid)
        self.queues.pop(rid, None)


TOKENS = list(range(50))  # 12 whole blocks and 2 tokens


async def test_pieces_start_at_the_cached_prefix_and_cover_the_context():
    cached = block_hashes(TOKENS, BS)[:3]  # 12 tokens cached
    loop = FakeLoop(FakeBlocks(cached))
    prefill = NextTurnPrefill(loop, step_tokens=10)  # -> 8 tokens (whole blocks) a piece
    assert await prefill.run("r", GenerateRequest(TOKENS, next_turn=True)) == NEXT_TURN_DONE
    assert loop.pieces == [20, 28, 36, 44, 50]
    assert prefill.outcomes["started"] == 1 and prefill.outcomes["prefilled"] == 1 and prefill.tokens == 38


async def test_nothing_to_do_busy_and_memory():
    loop = FakeLoop(FakeBlocks(block_hashes(TOKENS, BS)))
    prefill = NextTurnPrefill(loop)
    assert await prefill.run("r", GenerateRequest(TOKENS, next_turn=True)) == NEXT_TURN_DONE
    assert loop.pieces == [] and prefill.outcomes["started"] == 0
    loop = FakeLoop(FakeBlocks([]))
    loop.real = 1  # a real request is open
    prefill = NextTurnPrefill(loop)
    assert await prefill.run("r", GenerateRequest(TOKENS, next_turn=True)) == NEXT_TURN_DROPPED
    assert prefill.outcomes["busy"] == 1 and loop.pieces == []
    prefill = NextTurnPrefill(FakeLoop(FakeBlocks([], free=20)))  # 13 blocks needed, 10 reserved of 100
    assert await prefill.run("r", GenerateRequest(TOKENS, next_turn=True)) == NEXT_TURN_DROPPED
    assert prefill.outcomes["memory"] == 1


async def test_a_real_request_makes_the_piece_in_flight_step_aside():
    loop = FakeLoop(FakeBlocks([]), auto=False)
    prefill = NextTurnPrefill(loop, step_tokens=16)
    task = asyncio.create_task(prefill.run("r", GenerateRequest(TOKENS, next_turn=True)))
    while not loop.queues:
        await asyncio.sleep(0)
    [(rid, out)] = loop.queues.items()
    out.put_nowait(TokenDelta([1], finish_reason="length"))  # the first piece ends ...
    loop.queues.pop(rid)
    while not loop.queues:
        await asyncio.sleep(0)
    [rid2] = loop.queues
    prefill.yield_now()  # ... a real request arrives during the second
    assert await task == NEXT_TURN_DROPPED
    assert loop.aborted == [rid2] and prefill.outcomes["yielded"] == 1 and prefill.tokens == 16
