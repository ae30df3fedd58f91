"""uvicorn serving an ASGI app inside an already running event loop.

The runtime owns SIGTERM/SIGINT (drain, revoke the lease), so uvicorn's own signal capture is
turned off; :meth:`HttpServer.stop` is the way to shut it down. Port 0 picks a free port, which
:attr:`HttpServer.port` reports once started.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import socket

import uvicorn

from runtime.errors import StartupError

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # signals belong to the runtime


class HttpServer:
    """One uvicorn server on ``host:port``; httptools when installed, no access log."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, graceful_timeout: float = 30.0,
                 log_level: str = "warning"):
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
        config = uvicorn.Config(app, host=host, port=port, http=http, loop="none", lifespan="off",
                                access_log=False, log_level=log_level, timeout_graceful_shutdown=graceful_timeout,
                                timeout_keep_alive=30)
        self._server = _Server(config)
        self._task: asyncio.Task | None = None
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, timeout: float = 10.0) -> HttpServer:
        if self.port:  # a taken port is one line, not uvicorn's log and a traceback
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((self.host, self.port))
                except OSError as exc:
                    raise StartupError(f"cannot listen for HTTP on {self.host}:{self.port}: "
                                       f"{exc.strerror or exc}") from None
        self._task = asyncio.create_task(self._server.serve(), name="uvicorn")
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
        self._server.should_exit = True
        try:
            await self._task
        except (Exception, SystemExit) as exc:
            log.warning("HTTP server stopped with %r", exc)
        self._task = None
