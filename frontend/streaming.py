"""Merging the deltas of several choices, and watching for a client that left.

A client that disconnects cancels the task producing its answer (a non-streaming request, or a
streaming one before its first byte; Starlette cancels a started stream itself); the ``finally``
blocks of the producers close the worker streams, which cancels the handlers on the workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]

_END = object()


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it and raising :class:`ClientDisconnected` if the client leaves.

    Call only after the request body was read: from then on ``receive`` yields only the disconnect.
    ``work`` runs in the calling task (no extra task on the hot path); a watcher task cancels the
    caller when the disconnect arrives.
    """
    caller = asyncio.current_task()
    left = False

    def on_disconnect(_task: asyncio.Task) -> None:
        nonlocal left
        if not _task.cancelled() and _task.exception() is None:
            left = True
            caller.cancel()

    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    watcher.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if left:
            caller.uncancel()
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.remove_done_callback(on_disconnect)
        watcher.cancel()


async def merge(iterators: Sequence[AsyncIterator[T]], ahead: int | None = None) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as ``(index, item)``, in arrival order.

    At most ``ahead`` items (None: no limit) are taken from the iterators before the caller reads
    them; the rest stay in the iterators. The first exception of any iterator is raised here;
    leaving early cancels every pump.
    """
    queue: asyncio.Queue = asyncio.Queue()
    room = asyncio.Semaphore(ahead) if ahead else None

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            while True:
                if room is not None:
                    await room.acquire()
                try:
                    item = await it.__anext__()
                except StopAsyncIteration:
                    break
                queue.put_nowait((i, item))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:  # never blocks, so a cancelled pump always ends
            queue.put_nowait((i, _END))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    left = len(tasks)
    try:
        while left:
            i, item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                if room is not None:
                    room.release()
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
