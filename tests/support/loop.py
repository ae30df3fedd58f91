"""How long an event loop waits while a call runs in a thread beside it."""

from __future__ import annotations

import asyncio
import time


def loop_lag_of(fn, *args, tick: float = 0.005):
    """Run ``fn(*args)`` in a thread while the loop ticks every ``tick`` seconds; returns (its result,
    seconds it took, the loop's worst gap between two ticks)."""

    async def main():
        gaps, last = [], time.perf_counter()

        async def ticker():
            nonlocal last
            while True:
                await asyncio.sleep(tick)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        started = time.perf_counter()
        result = await asyncio.to_thread(fn, *args)
        took = time.perf_counter() - started
        task.cancel()
        return result, took, max(gaps)

    return asyncio.run(main())
