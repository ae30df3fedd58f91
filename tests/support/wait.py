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


def _poll(condition: Callable[[], Any], timeout: float, what: str | Callable[[], str],
          ignoring: tuple[type[BaseException], ...], awaits: bool):
    """The loop of both waits, as a generator that does all but the waiting: it yields an awaitable
    the condition returned (only where ``awaits``: the caller awaits it and sends back its result, or
    throws in what it raised) or None (the caller sleeps one interval), returns the first truthy value
    and raises :class:`NotReached` once ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            last = condition()
            if awaits and inspect.isawaitable(last):
                last = yield last
        except ignoring as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise _failure(what, timeout, last)
        yield None


async def eventually(condition: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.05,
                     what: str | Callable[[], str] = "condition",
                     ignoring: tuple[type[BaseException], ...] = ()) -> Any:
    """Await ``condition()`` (sync, or a coroutine function) every ``interval`` seconds until it is
    truthy and return that value; :class:`NotReached` after ``timeout`` seconds."""
    poll = _poll(condition, timeout, what, ignoring, awaits=True)
    resume, sent = poll.send, None
    try:
        while True:
            pending = resume(sent)
            resume, sent = poll.send, None
            if pending is None:
                await asyncio.sleep(interval)
                continue
            try:
                sent = await pending
            except BaseException as exc:  # the generator decides: one of ``ignoring``, or raised on
                resume, sent = poll.throw, exc
    except StopIteration as done:
        return done.value


def eventually_sync(condition: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.05,
                    what: str | Callable[[], str] = "condition",
                    ignoring: tuple[type[BaseException], ...] = ()) -> Any:
    """:func:`eventually` for a test without an event loop: blocks the calling thread while it waits."""
    poll = _poll(condition, timeout, what, ignoring, awaits=False)
    try:
        while True:
            next(poll)
            time.sleep(interval)
    except StopIteration as done:
        return done.value
