"""The frontend's ASGI transport: how request bodies come in (size limit before parsing, a deadline
for slow uploads), how a stream goes out (:class:`EventStream`: dropped when its client stops reading
or its waiting output passes a cap, cleanup always run), and :class:`FastPath`, which sends the
completion routes straight to their handler. The routes themselves are :mod:`frontend.app`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from runtime import InvalidRequest, PendingBytes

from .delivery import Delivery
from .errors import BodyTimeout, BodyTooLarge
from .server import TRANSPORT
from .streaming import ClientDisconnected

log = logging.getLogger(__name__)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or :class:`BodyTooLarge` as soon as it exceeds ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("the Content-Length header is not a number")
        if int(declared) > limit:
            raise BodyTooLarge(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # the client left mid-upload: its doing, not a server error
        raise ClientDisconnected() from None
    return b"".join(chunks)


async def read_body_in_time(request: Request, limit: int, timeout_s: float) -> bytes:
    """:func:`read_body` within ``timeout_s`` seconds, else :class:`BodyTimeout` (a slow or stalled upload)."""
    try:
        return await asyncio.wait_for(read_body(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise BodyTimeout(timeout_s) from None


class ClientStalled(Exception):
    """The client stopped reading its stream: a write did not complete within the write timeout."""


class BufferOverflow(Exception):
    """More of a stream's output waits for its client than the per-request cap allows."""


class EventStream(StreamingResponse):
    """An SSE response that runs ``cleanup`` after it ends, even if it never started streaming.

    A client that stops reading (its socket buffers full) makes a write wait. The stream is dropped
    when a write waits ``write_timeout`` seconds, or when bytes already written have waited that long
    for a client that acknowledges none of them (:mod:`frontend.delivery`: a small reply fits in the
    socket buffers, so no write ever waits), or earlier when the output waiting for the client
    (frames from the workers not yet sent, counted by ``pending``) passes its cap: the generations
    are closed, which cancels the workers' work, and what was waiting is freed. One log line each.
    """

    def __init__(self, events: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], headers: dict[str, str],
                 write_timeout: float = 30.0, request_id: str = "", pending: PendingBytes | None = None,
                 on_drop: Callable[[str], None] | None = None):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._cleanup = cleanup
        self._write_timeout = write_timeout
        self._request_id = request_id
        self._pending = pending
        self._on_drop = on_drop

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()
        overflow = loop.create_future()
        if self._pending is not None:
            self._pending.on_exceeded(lambda: overflow.done() or overflow.set_result(None))
        stalled = loop.create_future()
        transport = scope.get("extensions", {}).get(TRANSPORT)
        watch = asyncio.ensure_future(self._watch(Delivery(transport), stalled)) if transport is not None else None

        async def guarded_send(message) -> None:
            if message["type"] == "http.response.start":  # the headers always go: the response has begun
                await send(message)
                return
            if overflow.done():
                raise BufferOverflow()
            if stalled.done():
                raise ClientStalled()
            sending = asyncio.ensure_future(send(message))
            done, _ = await asyncio.wait((sending, overflow, stalled), timeout=self._write_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if sending in done:
                sending.result()
                return
            sending.cancel()
            raise BufferOverflow() if overflow.done() else ClientStalled()

        async def until_stalled() -> None:
            await asyncio.shield(stalled)
            raise ClientStalled()

        try:
            if watch is None:
                await super().__call__(scope, receive, guarded_send)
            else:  # a stall also ends a stream that is waiting for its next token, not only a write
                async with asyncio.TaskGroup() as group:
                    response = group.create_task(super().__call__(scope, receive, guarded_send))
                    stopper = group.create_task(until_stalled())
                    response.add_done_callback(lambda _: stopper.cancel())
        except* ClientStalled:
            log.info("request %s: the client stopped reading for %.0fs: stream dropped", self._request_id,
                     self._write_timeout)
            self._dropped("write_timeout")
        except* BufferOverflow:
            log.info("request %s: %d bytes of output waiting for a client that does not read (cap %d): stream "
                     "dropped", self._request_id, self._pending.peak, self._pending.limit)
            self._dropped("buffer")
        finally:
            if watch is not None:
                watch.cancel()
            await self._events.aclose()
            await self._cleanup()

    async def _watch(self, delivery: Delivery, stalled: asyncio.Future) -> None:
        """Resolve ``stalled`` once written bytes have waited ``write_timeout`` for a client that
        acknowledges none of them."""
        loop = asyncio.get_running_loop()
        interval = min(1.0, self._write_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            waited = delivery.stalled_for(loop.time())
            if waited is None:
                return
            if waited >= self._write_timeout:
                stalled.set_result(None)
                return

    def _dropped(self, reason: str) -> None:
        if self._on_drop is not None:
            self._on_drop(reason)


class FastPath:
    """ASGI app that sends the two completion routes straight to their handler, skipping FastAPI's
    routing and middleware (about 0.1 ms a request); everything else goes to the FastAPI app, which
    also declares the completion routes (OpenAPI, and the same handler behind them)."""

    def __init__(self, app: FastAPI, routes: dict[str, Callable[[Request], Awaitable[Response]]]):
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.routes.get(scope["path"])
            if handler is not None:
                response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
