"""One thread that owns the engine; asyncio talks to it through commands and per-request queues.

Torch compute must never run on the event loop (NATS heartbeats and lease refreshes live there),
so every engine call happens on this thread. Requests and aborts go in through a thread-safe
command queue; after every step the thread hands all outputs and KV events back to the loop in
one ``call_soon_threadsafe`` call, which puts each delta on its request's ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from runtime.messages import KvEvent, SamplingParams, TokenDelta

from workers.engine.engine import Engine

log = logging.getLogger(__name__)

_IDLE_WAIT = 0.5  # seconds the idle thread blocks waiting for a command


class EngineFailed(RuntimeError):
    """The engine raised during a step; the requests it was running are failed with this."""


class EngineLoop:
    """Runs ``engine`` on a dedicated thread; all public methods are called from the event loop."""

    def __init__(self, engine: Engine, on_kv_events: Callable[[list[KvEvent]], None] | None = None):
        self.engine = engine
        self._on_kv_events = on_kv_events
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._commands.put(("wake",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams,
               output_ids: list[int] = (), num_speculative_tokens: int | None = None) -> asyncio.Queue:
        """Validate (raises InvalidRequest here, on the caller's side) and queue a request.

        ``num_speculative_tokens`` is used by loops whose engine speculates (see
        :class:`workers.spec.speculator.SpecEngineLoop`); a plain engine decodes one token a step.
        """
        self.engine.validate(token_ids, params, output_ids)
        out: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = out
        self._commands.put(("add", request_id, list(token_ids), params, list(output_ids)))
        return out

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (no more deltas are delivered)."""
        if self._queues.pop(request_id, None) is not None:
            self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], object]):
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        future: Future = Future()
        self._commands.put(("call", fn, future))
        return await asyncio.wrap_future(future)

    @property
    def num_requests(self) -> int:
        return len(self._queues)

    def _deliver(self, outputs: list[tuple[str, TokenDelta]], events: list[KvEvent], error: Exception | None) -> None:
        for rid, delta in outputs:
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(delta)
                if delta.finish_reason:
                    del self._queues[rid]
        if error is not None:
            for rid in list(self._queues):
                self._queues.pop(rid).put_nowait(error)
        if events and self._on_kv_events is not None:
            self._on_kv_events(events)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            try:
                self._drain_commands(block=not engine.has_work())
                outputs, error = [], None
                if engine.has_work():
                    outputs = self._step()
                    self.steps += 1
            except Exception as exc:  # a bug or OOM in a step: fail what is running, keep serving
                log.exception("engine step failed")
                outputs, error = [], EngineFailed(f"engine step failed: {exc!r}")
                for rid in list(engine.seqs):
                    engine.abort(rid)
            events = engine.drain_kv_events()
            if outputs or events or error:
                self._loop.call_soon_threadsafe(self._deliver, outputs, events, error)

    def _step(self) -> list[tuple[str, TokenDelta]]:
        """One engine step (subclasses add work around it, e.g. draft proposals)."""
        return self.engine.step()

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, tokens, params, output_ids = cmd
            try:
                self.engine.add_request(rid, tokens, params, output_ids)
            except Exception as exc:
                self._loop.call_soon_threadsafe(self._fail_one, rid, exc)
        elif kind == "abort":
            self.engine.abort(cmd[1])
        elif kind == "call":
            _, fn, future = cmd
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:
                future.set_exception(exc)

    def _fail_one(self, rid: str, exc: Exception) -> None:
        q = self._queues.pop(rid, None)
        if q is not None:
            q.put_nowait(exc)
