"""Glue between the target's engine thread and its draft worker stream (which lives on asyncio).

Each engine step, the engine thread asks the :class:`Speculator` (blocking, through
``run_coroutine_threadsafe``) for a draft client, builds proposal requests, waits at most
``propose_timeout`` for proposals, steps, and hands verdicts and released sequences back.
:class:`SpecEngineLoop` is the target worker's engine loop with that protocol. Without a draft
worker, or after its stream broke, steps run with no proposals: plain decoding. Spec-decode
counters are published per (target, draft) pair as cumulative events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from runtime.events import TOPIC_SPEC_STATS

from ..target.engine_loop import EngineLoop
from .draft_client import DraftPool
from .proposer import DraftInput, DraftOutput
from .spec_engine import SpecEngine

log = logging.getLogger(__name__)


class Speculator:
    """The asyncio side: one :class:`DraftPool`, proposals on demand, stats publishing."""

    def __init__(self, pool: DraftPool, engine: SpecEngine, target_id: str, epoch: float,
                 publish: Callable[[str, object], Awaitable[None]] | None = None,
                 propose_timeout: float = 2.0, stats_interval: float = 0.5):
        self.pool = pool
        self.engine = engine
        self.target_id = target_id
        self.epoch = epoch
        self._publish = publish
        self.propose_timeout = propose_timeout
        self._stats_interval = stats_interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._draft_id = ""
        self._method = ""
        self._client = None  # the stream this step's draft state belongs to (ensure_draft picks it)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._publish is not None:
            self._task = asyncio.create_task(self._publish_stats(), name="spec-stats")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.pool.close()

    # ------------------------------------------------------------------ engine-thread calls (blocking)

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def ensure_draft(self) -> str | None:
        """The id of the draft worker to use this step, or None. Resets the engine's draft state when it changed."""
        client = self._call(self.pool.poll(), timeout=10)
        self._client = client
        draft_id = client.draft_id if client is not None else ""
        if draft_id and draft_id != self._draft_id:
            self.engine.reset_drafts()
            self.engine.hidden_layers = tuple(client.hidden_layers)
            self._method = client.method
            log.info("speculating with draft worker %s (%s)", draft_id, client.method)
        if self._draft_id and draft_id != self._draft_id and not draft_id:
            log.warning("no draft worker reachable: plain decoding until one appears")
        self._draft_id = draft_id
        self.engine.draft_id = draft_id
        return draft_id or None

    def propose(self, inputs: list[DraftInput]) -> dict[str, DraftOutput]:
        if not inputs:
            return {}
        client = self._client
        if client is None:
            return {}
        return self._call(client.propose(inputs, self.propose_timeout), timeout=self.propose_timeout + 5)

    def send(self, engine: SpecEngine) -> None:
        verdicts, released = engine.take_verdicts(), engine.take_released()
        client = self._client
        if client is None or (not verdicts and not released):
            return
        self._loop.call_soon_threadsafe(self._send, client, verdicts, released)

    @staticmethod
    def _send(client, verdicts, released) -> None:
        client.verified(verdicts)
        client.release(released)

    # ------------------------------------------------------------------ stats

    async def _publish_stats(self) -> None:
        sent: dict[str, int] = {}
        ticks = 0
        while True:
            await asyncio.sleep(self._stats_interval)
            ticks += 1
            await self.pool.prune()  # an idle target lets go of a draft worker that left
            for draft_id, counters in list(self.engine.counters.items()):
                if not draft_id or (sent.get(draft_id) == counters.num_drafts and ticks % 10):
                    continue
                sent[draft_id] = counters.num_drafts
                try:
                    await self._publish(TOPIC_SPEC_STATS, counters.event(self.target_id, draft_id, self.epoch, self._method))
                except Exception as exc:
                    log.debug("spec stats not published: %r", exc)


class SpecEngineLoop(EngineLoop):
    """:class:`EngineLoop` whose steps carry draft proposals."""

    def __init__(self, engine: SpecEngine, speculator: Speculator, on_kv_events=None):
        super().__init__(engine, on_kv_events)
        self.speculator = speculator

    def start(self) -> None:
        super().start()
        self.speculator.start()

    async def stop(self) -> None:
        await super().stop()
        await self.speculator.stop()

    def submit(self, request_id, token_ids, params, output_ids=(), num_speculative_tokens=None):
        self.engine.validate(token_ids, params, output_ids)
        out: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = out
        self._commands.put(("add_spec", request_id, list(token_ids), params, list(output_ids), num_speculative_tokens))
        return out

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] != "add_spec":
            return super()._apply(cmd)
        _, rid, tokens, params, output_ids, gamma = cmd
        try:
            self.engine.add_request(rid, tokens, params, output_ids, gamma)
        except Exception as exc:
            self._loop.call_soon_threadsafe(self._fail_one, rid, exc)

    def _step(self):
        engine: SpecEngine = self.engine
        proposals = {}
        try:
            if self.speculator.ensure_draft():
                proposals = self.speculator.propose(engine.draft_inputs())
        except Exception as exc:  # speculation is optional: decode plainly this step
            log.warning("draft proposals failed: %r", exc)
        outputs = engine.step(proposals)
        self.speculator.send(engine)
        return outputs
