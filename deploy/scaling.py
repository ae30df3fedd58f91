"""A launcher's ``launcher.scale`` endpoint, for the planner's ``launcher`` connector.

``tandem up`` and ``tandem ray up`` are synchronous programs; :class:`ScaleService` runs a Tandem
runtime on an event loop in a thread of its own, serves ``{ns}.launcher.scale`` there
(:mod:`planner.messages`) and hands each request to the launcher's ``scale`` function in a worker
thread. The launcher answers with a :class:`~planner.messages.ScaleReply`; it starts workers at once
and stops workers by SIGTERM, so they leave discovery first and drain what they hold before they exit.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from planner.messages import COMPONENT, ENDPOINT, ScaleReply, ScaleRequest
from runtime import Runtime
from runtime.config import RuntimeConfig

log = logging.getLogger(__name__)


class ScaleService:
    """Serves ``launcher.scale`` with ``scale(request) -> ScaleReply`` (called in a worker thread)."""

    def __init__(self, config: RuntimeConfig, scale: Callable[[ScaleRequest], ScaleReply]):
        self._config = config
        self._scale = scale
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 60.0) -> None:
        """Start serving; raises ``RuntimeError`` if the endpoint is not registered within ``timeout``."""
        self._thread = threading.Thread(target=self._run, name="launcher-scale", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"the launcher's scale endpoint did not start: {self._error!r}")

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start(); the stack runs on without a planner hook
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with Runtime.connect(self._config) as rt:
            await rt.serve(COMPONENT, ENDPOINT, self._handle, ScaleRequest, role="launcher")
            self._ready.set()
            await self._stop.wait()

    async def _handle(self, request: ScaleRequest, ctx):
        if request.replicas is not None:
            log.info("planner asks for %d %s workers (%s)", request.replicas, request.pool, request.reason or "no reason")
        try:
            reply = await asyncio.to_thread(self._scale, request)
        except Exception as exc:  # a bug or a failed start: the planner sees it as a refused request
            log.exception("scaling %s failed", request.pool)
            reply = ScaleReply(error=f"{type(exc).__name__}: {exc}")
        yield reply

    def stop(self, timeout: float = 15.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass  # the loop already ended
        if self._thread is not None:
            self._thread.join(timeout)
