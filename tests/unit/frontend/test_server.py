"""The HTTP server's connection deadlines, on a real uvicorn socket: a connection that sends nothing, or
trickles its headers, is closed in bounded time; a complete request is not cut short by them."""

from __future__ import annotations

import asyncio
import time

import pytest

from frontend.server import HttpServer

pytestmark = pytest.mark.unit

REQUEST = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n"


async def echo(scope, receive, send) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def server():
    srv = await HttpServer(echo, idle_timeout=0.6, header_timeout=0.4).start()
    yield srv
    await srv.stop()


async def closed_after(reader: asyncio.StreamReader, limit: float) -> float:
    """Seconds until the server closes the connection (read returns EOF)."""
    began = time.monotonic()
    data = await asyncio.wait_for(reader.read(), limit)
    assert b"HTTP/1.1" not in data
    return time.monotonic() - began


async def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    assert 0.4 < await closed_after(reader, 3) < 1.5
    writer.close()


async def test_trickled_headers_are_cut_off_after_the_header_timeout(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    began = time.monotonic()

    async def trickle() -> None:
        for byte in REQUEST[:-4]:  # never the blank line that ends the headers
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)  # every byte well inside the idle timeout

    task = asyncio.create_task(trickle())
    try:
        await asyncio.wait_for(reader.read(), 3)
        assert 0.3 < time.monotonic() - began < 1.2  # the header deadline, not restarted by each byte
    finally:
        task.cancel()
        writer.close()


async def test_keep_alive_requests_and_slow_bodies_within_the_deadlines(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for _ in range(3):  # kept alive across requests spaced under the idle timeout
        writer.write(REQUEST)  # headers at once, the body later than the header timeout: the app's business
        await asyncio.sleep(0.5)
        writer.write(b"ok")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
        assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(2) == b"ok"
        await asyncio.sleep(0.3)
    assert 0.1 < await closed_after(reader, 3) < 1.2  # then idle: closed
    writer.close()
