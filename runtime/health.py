"""Probes and Prometheus on every long-running process, served by uvicorn.

Serves ``GET /live`` (200 while the event loop runs), ``GET /health`` (200 when ``ready()`` is true,
else 503) and ``GET /metrics`` (prometheus_client's own ASGI exposition of a registry: text or
OpenMetrics by ``Accept``, gzip, ``name[]`` filters); ``extra`` routes may add JSON endpoints.
A tiny ASGI app on uvicorn (already the frontend's server): HTTP parsing, keep-alive and timeouts
are the library's, and signals stay with the runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable

import uvicorn
from prometheus_client import REGISTRY, CollectorRegistry, make_asgi_app

from .errors import StartupError

log = logging.getLogger(__name__)


WILDCARDS = {"0.0.0.0", "::", ""}


def advertised_host(host: str) -> str:
    """``host``, or where it is a wildcard bind, this host's address that others dial (bracketed IPv6)."""
    if host not in WILDCARDS:
        return host
    family = socket.AF_INET6 if host == "::" else socket.AF_INET
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        found = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    return f"[{found}]" if ":" in found else found


class UvicornServer(uvicorn.Server):
    """uvicorn run as one task of a service's event loop (the frontend's HTTP server too)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield  # signals belong to the runtime


async def stop_server(server: UvicornServer, task: asyncio.Task, what: str) -> None:
    """Ask ``server`` to exit and wait for its serving ``task`` (open requests get its graceful timeout)."""
    server.should_exit = True
    try:
        await task
    except (Exception, SystemExit) as exc:
        log.warning("%s stopped with %r", what, exc)


class HealthServer:
    """``/live``, ``/health``, ``/metrics`` (and ``extra`` JSON routes) on ``host:port``."""

    def __init__(
        self,
        host: str,
        port: int,
        ready: Callable[[], bool],
        registry: CollectorRegistry = REGISTRY,
        extra: dict[str, Callable[[], object]] | None = None,
    ):
        self.host = host
        self.port = port
        self._ready = ready
        self._metrics = make_asgi_app(registry)
        self._extra = dict(extra or {})
        self._entry = self._app  # the ASGI app uvicorn calls: _app behind whatever protect() added
        self._server: UvicornServer | None = None
        self._task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def advertised_address(self) -> str:
        """``host:port`` another host can dial: the bound address, or for a wildcard bind (``0.0.0.0``,
        ``::``, as in the k8s manifests) this host's own address, what its hostname resolves to (a pod's
        IP on Kubernetes, a container's on Compose). Workers register it for the planner's scrapes."""
        return f"{advertised_host(self.host)}:{self.port}"

    def add_route(self, path: str, handler: Callable[[], object]) -> None:
        """Serve ``handler()`` as JSON on ``GET path``."""
        self._extra[path] = handler

    def protect(self, middleware: Callable[[Callable], Callable]) -> None:
        """Put ``middleware`` (an ASGI app wrapping an ASGI app) in front of every route, e.g. the
        frontend's API-key check, so that this port gives away nothing its main port guards."""
        self._entry = middleware(self._entry)

    async def start(self, timeout: float = 10.0) -> None:
        # Bind here: a taken port is one line (StartupError), and port 0 is known before serving.
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise StartupError(f"cannot serve health on {self.host}:{self.port}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._serve, interface="asgi3", loop="none", lifespan="off", access_log=False,
                                log_level="warning", timeout_graceful_shutdown=1)
        self._server = UvicornServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="health-http")
        deadline = asyncio.get_running_loop().time() + timeout
        while not self._server.started:
            if self._task.done() or asyncio.get_running_loop().time() > deadline:
                await self.stop()
                raise StartupError(f"the health server on {self.address} did not start")
            await asyncio.sleep(0.01)
        log.info("health and metrics on http://%s/{live,health,metrics}", self.address)

    async def stop(self) -> None:
        if self._task is None:
            return
        await stop_server(self._server, self._task, "health server")
        self._task = self._server = None

    async def _serve(self, scope, receive, send) -> None:
        await self._entry(scope, receive, send)

    async def _app(self, scope, receive, send) -> None:
        method, path = scope["method"], scope["path"]
        if path == "/metrics" and method in ("GET", "HEAD"):
            await self._metrics(scope, receive, send)
            return
        try:
            status, ctype, body = self._route(method, path)
        except Exception:
            log.exception("health route %s failed", path)
            status, ctype, body = 500, "text/plain", b"internal error\n"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        if path == "/live":
            return 200, "text/plain", b"live\n"
        if path == "/health":
            ok = self._ready()
            body = json.dumps({"status": "ready" if ok else "not ready"}).encode()
            return (200 if ok else 503), "application/json", body
        handler = self._extra.get(path)
        if handler is not None:
            return 200, "application/json", json.dumps(handler()).encode()
        return 404, "text/plain", b"not found\n"
