"""Waiting for a condition in tests: poll it until it holds, and fail with what was awaited.

A test that waits says what for: ``await eventually(lambda: len(events) >= 2, what="two KV events")``
instead of ``await asyncio.sleep(1)``. It returns as soon as the condition holds (fast on a quiet
machine), and when it never does the failure names the condition and the last value it returned,
so a slow machine reads differently from a broken feature.

``condition`` returns a value that is truthy once the wait is over (that value is returned); for
:func:`eventually` it may also be a coroutine function. ``what`` is a string or a callable that
returns one (for a message that says how things stand at the time of failure). Exceptions listed in
``ignoring`` count as "not yet" (a server that does not answer yet), and the last one is reported.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


class NotReached(AssertionError):
    """The awaited condition did not hold within the timeout."""


def _failure(what: str | Callable[[], str], timeout: float, last: Any) -> NotReached:
    text = what() if callable(what) else what
    return NotReached(f"{text}: not reached within {timeout:g} s (last value: {last!r})")


async def eventually(condition: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.05,
                     what: str | Callable[[], str] = "condition",
                     ignoring: tuple[type[BaseException], ...] = ()) -> Any:
    """Await ``condition()`` (sync, or a coroutine function) every ``interval`` seconds until it is
    truthy and return that value; :class:`NotReached` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            last = condition()
            if inspect.isawaitable(last):
                last = await last
        except ignoring as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise _failure(what, timeout, last)
        await asyncio.sleep(interval)


def eventually_sync(condition: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.05,
                    what: str | Callable[[], str] = "condition",
                    ignoring: tuple[type[BaseException], ...] = ()) -> Any:
    """:func:`eventually` for a test without an event loop: blocks the calling thread while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            last = condition()
        except ignoring as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise _failure(what, timeout, last)
        time.sleep(interval)
