"""A restarted frontend binds its port at once, although connections of the previous process on that
port still sit in TIME_WAIT (the server closed them first, as it does at shutdown)."""

from __future__ import annotations

import socket

import httpx
from starlette.responses import PlainTextResponse

from frontend.server import HttpServer


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
