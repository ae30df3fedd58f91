"""The target worker's step loop: one asyncio task drives the engine, one step at a time.

Each iteration of :meth:`StepLoop._run`:

1. applies the commands queued by request handlers (:class:`AddRequest`, :class:`AbortRequest`,
   :class:`EngineCall`) — only between steps, so nothing else ever touches the engine;
2. asks the draft worker for proposals for every sequence that decodes next and *awaits* them with
   a deadline (``propose_timeout``); the event loop keeps serving meanwhile. The draft stream comes
   from :meth:`DraftPool.poll`, which never waits for a stream to open;
3. runs the engine step in the loop's one executor thread (torch never runs on the event loop,
   where NATS heartbeats and etcd lease refreshes live; one thread, so CUDA and torch thread state
   stay put);
4. delivers token deltas to the requests' queues, KV events to their publisher, and the verdicts
   and released sequences to the draft stream that proposed.

Without a draft worker (none registered, its stream broke, or the engine does not speculate) step
2 yields nothing and the engine decodes plainly. An engine step that raises fails the requests it
was running with :class:`EngineFailed`; the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from runtime.events import TOPIC_SPEC_STATS
from runtime.messages import KvEvent, SamplingParams, TokenDelta

from ..engine.engine import Engine
from ..engine.grammar import Grammar
from ..speculation.payloads import DraftOutput
from .draft_client import DraftClient, DraftPool
from .spec_engine import SpecEngine

log = logging.getLogger(__name__)


class EngineFailed(RuntimeError):
    """The engine raised during a step; the requests it was running are failed with this."""


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_speculative_tokens: int | None = None  # None: the engine's default γ
    tree: tuple[int | None, int | None] = (None, None)  # (top-k, depth); None: the engine's setting
    grammar: Grammar | None = None  # params.structured, compiled off the loop


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class EngineCall:
    """Run ``fn(engine)`` between steps; its result (or exception) goes to ``future``."""

    fn: Callable[[Engine], object]
    future: asyncio.Future


Command = AddRequest | AbortRequest | EngineCall


class StepLoop:
    """Drives ``engine`` from one asyncio task; speculates through ``pool`` when given one."""

    def __init__(self, engine: Engine, pool: DraftPool | None = None, target_id: str = "", *,
                 propose_timeout: float = 2.0, on_kv_events: Callable[[list[KvEvent]], None] | None = None,
                 publish: Callable[[str, object], Awaitable[None]] | None = None, epoch: float = 0.0,
                 stats_interval: float = 0.5):
        self.engine = engine
        self.pool = pool if isinstance(engine, SpecEngine) else None
        if self.pool is not None:
            engine.time_steps = False  # the loop times whole cycles for the cost model (see _run)
        self.target_id = target_id
        self.propose_timeout = propose_timeout
        self._on_kv_events = on_kv_events
        self._publish = publish
        self._epoch = epoch
        self._stats_interval = stats_interval
        self._commands: deque[Command] = deque()
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._client: DraftClient | None = None  # the stream this step's proposals came from
        self._draft_id = ""
        self._method = ""
        self.steps = 0

    # ------------------------------------------------------------------ handlers' side

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run(), name="target-step-loop"))
        if self.pool is not None:
            self._tasks.append(asyncio.create_task(self._housekeeping(), name="target-spec-stats"))

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for task in self._tasks[1:]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._executor.shutdown(wait=True)
        if self.pool is not None:
            await self.pool.close()

    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams, output_ids: list[int] = (),
               num_speculative_tokens: int | None = None,
               tree: tuple[int | None, int | None] = (None, None), grammar: Grammar | None = None) -> asyncio.Queue:
        """Validate (raises InvalidRequest here, on the caller's side) and queue a request; its
        deltas, or the exception that ended it, arrive on the returned queue. ``grammar``: the
        compiled ``params.structured`` (see :meth:`compile_grammar`)."""
        self.engine.validate(token_ids, params, output_ids)
        out: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = out
        self._push(AddRequest(request_id, list(token_ids), params, list(output_ids), num_speculative_tokens, tree,
                              grammar))
        return out

    async def compile_grammar(self, token_ids: list[int], params: SamplingParams, output_ids: list[int] = ()) -> Grammar:
        """``params.structured`` compiled in a thread (a large schema takes milliseconds; the first one
        also builds the tokenizer info), so that neither the event loop nor the engine step waits."""
        self.engine.validate(token_ids, params, output_ids)
        return await asyncio.to_thread(self.engine.grammars.grammar, params.structured)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (no more deltas are delivered)."""
        if self._queues.pop(request_id, None) is not None:
            self._push(AbortRequest(request_id))

    async def call(self, fn: Callable[[Engine], object]):
        """Run ``fn(engine)`` between steps and return its result."""
        future = asyncio.get_running_loop().create_future()
        self._push(EngineCall(fn, future))
        return await future

    @property
    def num_requests(self) -> int:
        return len(self._queues)

    def _push(self, command: Command) -> None:
        self._commands.append(command)
        self._wake.set()

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        engine = self.engine
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._apply_commands()
            self._flush_kv_events()
            if not engine.has_work():
                self._wake.clear()
                if not self._commands:
                    await self._wake.wait()
                continue
            cycle_started = time.perf_counter()
            proposals = await self._proposals()
            try:
                outputs = await loop.run_in_executor(self._executor, engine.step, proposals) if proposals \
                    else await loop.run_in_executor(self._executor, engine.step)
            except Exception as exc:  # a bug or OOM in a step: fail what is running, keep serving
                log.exception("engine step failed")
                self._fail_all(EngineFailed(f"engine step failed: {exc!r}"))
                continue
            self.steps += 1
            self._deliver(outputs)
            self._send_verdicts()
            if self.pool is not None:  # load-aware budgets learn what a whole cycle costs
                engine.observe_cycle(time.perf_counter() - cycle_started)

    def _apply_commands(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, AddRequest):
                try:
                    if isinstance(self.engine, SpecEngine):
                        self.engine.add_request(cmd.request_id, cmd.token_ids, cmd.params, cmd.output_ids,
                                                cmd.num_speculative_tokens, *cmd.tree, grammar=cmd.grammar)
                    else:
                        self.engine.add_request(cmd.request_id, cmd.token_ids, cmd.params, cmd.output_ids,
                                                cmd.grammar)
                except Exception as exc:
                    queue = self._queues.pop(cmd.request_id, None)
                    if queue is not None:
                        queue.put_nowait(exc)
            elif isinstance(cmd, AbortRequest):
                self.engine.abort(cmd.request_id)
            elif not cmd.future.done():
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except Exception as exc:
                    cmd.future.set_exception(exc)

    def _deliver(self, outputs: list[tuple[str, TokenDelta]]) -> None:
        for rid, delta in outputs:
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(delta)
                if delta.finish_reason:
                    del self._queues[rid]
        self._flush_kv_events()

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
        for rid in list(self._queues):
            self._queues.pop(rid).put_nowait(error)
        self._flush_kv_events()

    def _flush_kv_events(self) -> None:
        events = self.engine.drain_kv_events()
        if events and self._on_kv_events is not None:
            self._on_kv_events(events)

    # ------------------------------------------------------------------ speculation

    async def _proposals(self) -> dict[str, DraftOutput]:
        """This step's proposals: {} without a draft stream, or when it fails or misses the deadline."""
        if self.pool is None:
            return {}
        engine: SpecEngine = self.engine
        try:
            client = await self.pool.poll()
        except Exception as exc:
            log.warning("choosing a draft worker failed: %r", exc)
            client = None
        draft_id = client.draft_id if client is not None else ""
        if draft_id != self._draft_id:
            if draft_id:
                engine.reset_drafts()  # a new draft worker knows none of our sequences
                engine.hidden_layers = tuple(client.hidden_layers)
                self._method = client.method
                log.info("speculating with draft worker %s (%s)", draft_id, client.method)
            else:
                log.warning("no draft worker reachable: plain decoding until one appears")
            self._draft_id = draft_id
            engine.draft_id = draft_id
        self._client = client
        if client is None:
            return {}
        inputs = engine.draft_inputs()
        if not inputs:
            return {}
        try:
            return await client.propose(inputs, self.propose_timeout)
        except Exception as exc:  # speculation is optional: decode plainly this step
            log.warning("draft proposals failed: %r", exc)
            return {}

    def _send_verdicts(self) -> None:
        if self.pool is None:
            return
        engine: SpecEngine = self.engine
        verdicts, released = engine.take_verdicts(), engine.take_released()
        client = self._client
        if client is not None and (verdicts or released):
            client.verified(verdicts)
            client.release(released)

    async def _housekeeping(self) -> None:
        """Publish the spec-decode counters per draft worker (cumulative, when they changed, and every
        10 intervals regardless) and let go of a draft worker that left while this target is idle."""
        sent: dict[str, int] = {}
        ticks = 0
        while True:
            await asyncio.sleep(self._stats_interval)
            ticks += 1
            await self.pool.prune()
            if self._publish is None:
                continue
            for draft_id, counters in list(self.engine.counters.items()):
                if not draft_id or (sent.get(draft_id) == counters.num_drafts and ticks % 10):
                    continue
                sent[draft_id] = counters.num_drafts
                try:
                    await self._publish(TOPIC_SPEC_STATS, counters.event(self.target_id, draft_id, self._epoch,
                                                                         self._method))
                except Exception as exc:
                    log.debug("spec stats not published: %r", exc)
