"""merge(): every item of every iterator, and no more than ``ahead`` read before the caller takes them."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from frontend.streaming import merge

pytestmark = pytest.mark.unit


async def test_merge_reads_at_most_ahead_items_before_the_caller_takes_them():
    pulled = [0, 0]

    async def numbers(i: int):
        for k in range(100):
            pulled[i] += 1
            yield k

    async with contextlib.aclosing(merge([numbers(0), numbers(1)], ahead=2)) as merged:
        got = [await merged.__anext__()]
        await asyncio.sleep(0.05)  # a caller that stops reading: the rest stays in the iterators
        assert sum(pulled) <= 3
        got += [item async for item in merged]
    assert sorted(got) == sorted((i, k) for i in range(2) for k in range(100))


async def test_merge_raises_the_first_error_and_ends_when_the_caller_leaves():
    async def failing():
        yield 1
        raise ValueError("boom")

    async def endless():
        while True:
            await asyncio.sleep(0.001)
            yield 0

    with pytest.raises(ValueError, match="boom"):
        async with contextlib.aclosing(merge([failing(), endless()], ahead=2)) as merged:
            async for _ in merged:
                pass
