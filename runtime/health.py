"""A small HTTP server for probes and Prometheus on every long-running process.

Serves ``GET /live`` (200 while the event loop runs), ``GET /health`` (200 when ``ready()`` is true,
else 503) and ``GET /metrics`` (Prometheus text of a registry); ``extra`` routes may add JSON
endpoints. HTTP/1.1 with ``Connection: close``; no framework, so ``runtime/`` stays small.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable", 500: "Internal Server Error"}


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
        self._registry = registry
        self._extra = dict(extra or {})
        self._server: asyncio.AbstractServer | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def add_route(self, path: str, handler: Callable[[], object]) -> None:
        """Serve ``handler()`` as JSON on ``GET path``."""
        self._extra[path] = handler

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("health and metrics on http://%s/{live,health,metrics}", self.address)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        path = path.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        if path == "/live":
            return 200, "text/plain", b"live\n"
        if path == "/health":
            ok = self._ready()
            return (200 if ok else 503), "application/json", json.dumps({"status": "ready" if ok else "not ready"}).encode()
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        handler = self._extra.get(path)
        if handler is not None:
            return 200, "application/json", json.dumps(handler()).encode()
        return 404, "text/plain", b"not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            try:
                status, ctype, body = self._route(method, path)
            except Exception:
                log.exception("health route %s failed", path)
                status, ctype, body = 500, "text/plain", b"internal error\n"
            writer.write(
                f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + (b"" if method == "HEAD" else body)
            )
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()
