"""A restarted frontend binds its port at once, although connections of the previous process on that
port still sit in TIME_WAIT (the server closed them first, as it does at shutdown); or it serves a
socket its launcher holds, which queues clients while no frontend runs."""

from __future__ import annotations

import asyncio
import os
import socket

import httpx
import pytest
from starlette.responses import PlainTextResponse

from deploy.binaries import listening_socket
from frontend.server import HttpServer
from runtime.errors import StartupError


def _port_with_time_wait() -> int:
    """A port whose listener is gone but whose accepted connection the server side closed first."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server's side closes first: it is the one left in TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    return port


async def app(scope, receive, send):
    await PlainTextResponse("ok")(scope, receive, send)


async def test_a_port_with_connections_in_time_wait_can_be_served_again():
    port = _port_with_time_wait()
    with socket.socket() as plain:  # what the old probe did: fails while the connection is in TIME_WAIT
        try:
            plain.bind(("127.0.0.1", port))
            time_wait = False
        except OSError:
            time_wait = True
    assert time_wait, "the setup did not leave a connection in TIME_WAIT"
    server = await HttpServer(app, "127.0.0.1", port).start()
    try:
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
    finally:
        await server.stop()


async def test_a_held_socket_queues_clients_between_two_servers():
    """What ``tandem up`` does for its frontend: the launcher listens, each frontend process serves the
    inherited socket (``--http-fd``); a client that connects while no server runs waits for the next
    one instead of being refused."""
    held = listening_socket("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        for _ in range(2):  # a frontend, then its replacement
            server = await HttpServer(app, fd=os.dup(held.fileno())).start()
            assert server.port == port
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
            await server.stop()
            # no server now: the connection is accepted by the kernel and waits (refused without the held socket)
            waiting = await asyncio.open_connection("127.0.0.1", port)
            waiting[1].write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            replacement = await HttpServer(app, fd=os.dup(held.fileno())).start()
            answer = await asyncio.wait_for(waiting[0].read(200), 5)
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok"), answer
            waiting[1].close()
            await replacement.stop()
    finally:
        held.close()
    with pytest.raises(StartupError):
        HttpServer(app, fd=os.open(os.devnull, os.O_RDONLY))
