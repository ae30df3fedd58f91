"""tests/support/wait.py: ``eventually`` returns the condition's value as soon as it holds, and a wait
that never ends fails with what was awaited and the last value seen."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.support.wait import NotReached, eventually, eventually_sync

pytestmark = pytest.mark.unit


def test_returns_the_first_truthy_value_of_a_sync_or_async_condition():
    counter = itertools.count()
    assert eventually_sync(lambda: next(counter) >= 3 and "done", interval=0) == "done"

    async def main():
        calls = itertools.count()

        async def ready():
            return next(calls) >= 2 and {"ok"}

        assert await eventually(ready, interval=0) == {"ok"}
        assert await eventually(lambda: 7, timeout=0) == 7  # holds at once: no sleep, even with no time

    asyncio.run(main())


def test_a_timeout_names_what_was_awaited_and_the_last_value():
    events: list[int] = []

    def three_events():
        events.append(len(events))
        return len(events) >= 10**6 and events

    with pytest.raises(NotReached, match=r"three events: not reached within 0.05 s \(last value: False\)"):
        eventually_sync(three_events, timeout=0.05, interval=0.01, what="three events")
    with pytest.raises(NotReached, match=r"stood at 2: .*\(last value: \[\]\)"):
        asyncio.run(eventually(lambda: [], timeout=0.02, interval=0.01, what=lambda: "stood at 2"))


def test_listed_exceptions_count_as_not_yet_and_others_propagate():
    attempts = itertools.count()

    def flaky():
        if next(attempts) < 2:
            raise ConnectionError("not up yet")
        return "up"

    def down():
        raise ConnectionError("down")

    assert eventually_sync(flaky, interval=0, ignoring=(ConnectionError,)) == "up"
    with pytest.raises(NotReached, match=r"last value: ConnectionError\('down'\)"):
        eventually_sync(down, timeout=0.02, interval=0.01, ignoring=(ConnectionError,))
    with pytest.raises(KeyError):
        asyncio.run(eventually(lambda: {}["x"], ignoring=(ConnectionError,)))


def test_a_coroutine_condition_may_raise_a_listed_exception_and_others_propagate():
    attempts = itertools.count()

    async def flaky():
        if next(attempts) < 2:
            raise ConnectionError("not up yet")
        return "up"

    async def broken():
        raise KeyError("x")

    assert asyncio.run(eventually(flaky, interval=0, ignoring=(ConnectionError,))) == "up"
    with pytest.raises(KeyError):
        asyncio.run(eventually(broken, ignoring=(ConnectionError,)))
    # a blocking wait does not await: a coroutine is a truthy value like any other
    coroutine = broken()
    assert eventually_sync(lambda: coroutine) is coroutine
    coroutine.close()
