"""uvicorn serving an ASGI app inside an already running event loop.

The runtime owns SIGTERM/SIGINT (drain, revoke the lease), so uvicorn's own signal capture is
turned off; :meth:`HttpServer.stop` is the way to shut it down. Port 0 picks a free port, which
:attr:`HttpServer.port` reports once started.

Connections are bounded in time while no request is being served: one that sends nothing (new, or
between keep-alive requests) is closed after ``idle_timeout``, and one that started a request but has
not finished its headers ``header_timeout`` after the first byte is closed too. uvicorn alone has
neither: its keep-alive timer starts only after a first response and restarts on every byte, so a
client trickling headers, or connecting and sending nothing, held a connection for ever. Bodies are
bounded by the app (``--body-timeout``), streams by its write timeout, for which each request's
scope carries its transport (``scope["extensions"]["tandem.transport"]``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import socket

import uvicorn

from runtime.errors import StartupError
from runtime.health import UvicornServer, stop_server

log = logging.getLogger(__name__)

TRANSPORT = "tandem.transport"  # the scope extension that carries a request's transport (httptools only)


class _Deadlines:
    """Mixin for uvicorn's HTTP protocols: the idle and header deadlines of the module docstring.

    Between requests one timer runs: ``idle_timeout`` from the connection's start or its last
    response's end, replaced by ``header_timeout`` at the first byte of the next request. Once the
    headers are complete a request cycle is running and the timer, should it fire, does nothing.
    """

    idle_timeout = 30.0
    header_timeout = 10.0
    closed_idle = 0  # connections closed by these deadlines (all servers of the process)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # the app's streams ask the transport whether their client takes what is sent (frontend/app.py)
        self.scope["extensions"] = {TRANSPORT: self.transport}

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._in_headers = False
        self._arm(self.idle_timeout)

    def data_received(self, data: bytes) -> None:
        if not self._in_headers and self._between_requests():
            self._in_headers = True
            self._arm(self.header_timeout)
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._in_headers = False
        self._arm(self.idle_timeout)

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, seconds: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _expired(self) -> None:
        self._deadline = None
        if self._between_requests() and not self.transport.is_closing():
            _Deadlines.closed_idle += 1
            log.debug("closing connection from %s: %s", self.client,
                      "headers incomplete" if self._in_headers else "idle")
            self.transport.close()


def preload() -> None:
    """Import what a server imports only when it starts (a spare frontend's head start)."""
    _protocol(30.0, 10.0)


def _protocol(idle_timeout: float, header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol (h11 when httptools is missing) with these deadlines."""
    if importlib.util.find_spec("httptools"):
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type("Http" + base.__name__, (_Deadlines, base),
                {"idle_timeout": idle_timeout, "header_timeout": header_timeout})


class _IncompleteResponses(logging.Filter):
    """Drops uvicorn's error line for a response the app left unfinished: the app does that only to a
    stream it dropped on purpose (a client that stopped reading), which it logged in a line of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing response."


logging.getLogger("uvicorn.error").addFilter(_IncompleteResponses())


class HttpServer:
    """One uvicorn server on ``host:port``; httptools when installed, no access log."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, graceful_timeout: float = 30.0,
                 log_level: str = "warning", idle_timeout: float = 30.0, header_timeout: float = 10.0,
                 fd: int | None = None):
        """``fd``: an inherited socket that already listens (its owner keeps it across restarts of this
        process), served instead of binding ``host:port``."""
        config = uvicorn.Config(app, host=host, port=port, http=_protocol(idle_timeout, header_timeout), loop="none",
                                lifespan="off", access_log=False, log_level=log_level,
                                timeout_graceful_shutdown=graceful_timeout, timeout_keep_alive=idle_timeout)
        self._server = UvicornServer(config)
        self._task: asyncio.Task | None = None
        self.host = host
        self.port = port
        self._socket: socket.socket | None = None
        if fd is not None:
            try:
                self._socket = socket.socket(fileno=fd)
            except OSError as exc:
                raise StartupError(f"--http-fd {fd} is not a socket: {exc.strerror or exc}") from None
            if self._socket.type != socket.SOCK_STREAM:
                raise StartupError(f"--http-fd {fd} is not a stream socket")
            self.host, self.port = self._socket.getsockname()[:2]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, timeout: float = 10.0) -> HttpServer:
        if self.port and self._socket is None:  # a taken port is one line, not uvicorn's log and a traceback
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                # as uvicorn binds: connections of an earlier process left in TIME_WAIT do not take the
                # port, a listener does
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((self.host, self.port))
                except OSError as exc:
                    raise StartupError(f"cannot listen for HTTP on {self.host}:{self.port}: "
                                       f"{exc.strerror or exc}") from None
        sockets = None if self._socket is None else [self._socket]
        self._task = asyncio.create_task(self._server.serve(sockets=sockets), name="uvicorn")
        deadline = asyncio.get_running_loop().time() + timeout
        while not self._server.started:
            if self._task.done():
                try:
                    self._task.result()
                except SystemExit:  # uvicorn exits when it cannot bind
                    pass
                raise OSError(f"the HTTP server could not listen on {self.host}:{self.port} (see the log above)")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the HTTP server on {self.host}:{self.port} did not start in {timeout}s")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("HTTP server listening on %s", self.url)
        return self

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (up to the graceful timeout), then return."""
        if self._task is None:
            return
        await stop_server(self._server, self._task, "HTTP server")
        self._task = None
