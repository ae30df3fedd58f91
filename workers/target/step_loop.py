"""The target worker's step loop: one asyncio task drives the engine, one step at a time.

Only the engine's thread touches torch or the engine. Each iteration of :meth:`StepLoop._run`:

1. takes the draft's proposals through the stream's seam (:mod:`.seam`, chosen at its handshake).
   Synchronous seam: waits (bounded by :class:`.draft_watch.DraftWatch`'s deadline, judged from the
   target's own step time) for the proposals asked for at the end of the previous cycle; the event
   loop keeps serving meanwhile. Pipelined seam (the draft streams proposals ahead, see
   :mod:`workers.speculation.staging`): takes whatever has arrived and waits for nothing; the engine
   uses, per sequence, a proposal that fits its committed tokens, and a sequence with none decodes
   plainly this step. The draft stream comes from :meth:`DraftPool.poll`, which never waits for a
   stream to open;
2. runs one *cycle* in the loop's one executor thread (:meth:`StepLoop.run_cycle`): the commands
   queued by request handlers (:class:`AddRequest`, :class:`AbortRequest`, :class:`EngineCall`),
   the engine step, the verdicts and the next round's proposal requests, already converted to
   protobuf, and the KV events;
   Pipelined, with a draft that reads no hidden states, the cycle first sends the prompts of the
   requests just added, from the engine's thread (:meth:`Engine.prompt_inputs`): the draft can
   then have a proposal for a request's first decode step, its first token a guess of the
   prefill's;
3. on the event loop again: sends verdicts, released sequences and the next round's requests to
   the draft stream first (one message, the seam's ``news``; pipelined, then one turn of the event
   loop: gRPC takes it, or on a fast lane, where it is written at once, a fast draft's answer
   may come in before the next step), so that the draft works while the loop delivers token deltas
   to the requests' queues and KV events to their publisher.

Without a draft worker (none registered, its stream broke, it is backed off, or speculation is
off) nothing is asked and the engine decodes plainly. Nothing that goes wrong ends the loop: an
engine step that raises fails the requests of its batch with :class:`runtime.errors.EngineFailed`
(the frontend moves them to another target); a failed verdict conversion restarts the draft's view
of that sequence; anything else fails what it concerns, is logged, and the loop goes on. Only
steps that keep failing mark the engine broken (:attr:`StepLoop.healthy`), which turns the
worker's health check unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from runtime.errors import EngineFailed
from runtime.events import TOPIC_SPEC_STATS
from runtime.messages import KvEvent, SamplingParams, TokenDelta

from ..engine.engine import Engine
from ..engine.grammar import Grammar
from ..openmp import torch_thread
from .commands import AbortRequest, AddRequest, Command, Cycle, DraftContext, EngineCall
from .draft_pool import DraftPool
from .draft_watch import DraftWatch
from .drafting import Drafting
from .seam import Proposals

log = logging.getLogger(__name__)

BROKEN_AFTER = 3  # engine steps failing in a row (each on a fresh batch) mark the engine broken


class StepLoop:
    """Drives ``engine`` from one asyncio task; speculates through ``pool`` when given one."""

    def __init__(self, engine: Engine, pool: DraftPool | None = None, target_id: str = "", *,
                 propose_timeout: float = 2.0, on_kv_events: Callable[[list[KvEvent]], None] | None = None,
                 publish: Callable[[str, object], Awaitable[None]] | None = None, epoch: float = 0.0,
                 stats_interval: float = 0.5, watch: DraftWatch | None = None,
                 executor: ThreadPoolExecutor | None = None):
        self.engine = engine
        self.pool = pool
        if self.pool is not None:
            engine.time_steps = False  # the loop times whole cycles for the cost model (see _run)
        self.target_id = target_id
        self.drafting = Drafting(engine, pool, watch or DraftWatch(propose_timeout))
        self._on_kv_events = on_kv_events
        self._publish = publish
        self._epoch = epoch
        self._stats_interval = stats_interval
        self._commands: deque[Command] = deque()
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        # the thread that built the engine, when given: one OpenMP team for its torch work (workers.openmp)
        self._executor = executor or torch_thread("engine-step")
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._has_work = False
        self._last_cycle = 0.0  # seconds of the previous whole cycle (for the cost model)
        self._last_asked = False  # proposals were asked for the previous cycle's step
        self._failures_in_a_row = 0
        self.steps = 0
        self.busy_seconds = 0.0  # time in iterations with work (waiting for proposals included)
        self.step_failures = 0
        self.loop_errors = 0
        self.handoffs: dict = {}  # request id -> KvHandoff, taken by the prefill handler with its last delta

    # ------------------------------------------------------------------ handlers' side

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run(), name="target-step-loop"))
        if self.pool is not None:
            self._tasks.append(asyncio.create_task(self._housekeeping(), name="target-spec-stats"))

    @property
    def broken(self) -> bool:
        """The engine's latest ``BROKEN_AFTER`` steps all failed (a step that succeeds clears it)."""
        return self._failures_in_a_row >= BROKEN_AFTER

    @property
    def healthy(self) -> bool:
        """False when the loop's task ended or the engine keeps failing."""
        return bool(self._tasks) and not self._tasks[0].done() and not self.broken

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
               tree: tuple[int | None, int | None] = (None, None), grammar: Grammar | None = None,
               prefill_only: bool = False, lora: str | None = None, priority: int = 0, draft: str = "") -> asyncio.Queue:
        """Validate (raises InvalidRequest here, on the caller's side) and queue a request; its
        deltas, or the exception that ended it, arrive on the returned queue. ``grammar``: the
        compiled ``params.structured`` (see :meth:`compile_grammar`). ``prefill_only``: the request
        ends after its first token, with finish reason ``handoff`` and its KvHandoff in :attr:`handoffs`.
        ``draft``: the draft worker the router chose for it (see :mod:`.placement`)."""
        self.engine.validate(token_ids, params, output_ids)
        out: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = out
        self._push(AddRequest(request_id, list(token_ids), params, list(output_ids), num_speculative_tokens, tree,
                              grammar, prefill_only, lora, priority, draft))
        return out

    async def receive(self, request_id: str, token_ids: list[int], params: SamplingParams, output_ids: list[int],
                      handoff, num_speculative_tokens: int | None = None,
                      tree: tuple[int | None, int | None] = (None, None), grammar: Grammar | None = None):
        """Like :meth:`submit` for a request whose prompt KV a prefill worker holds (``handoff``):
        returns its queue and the engine's :class:`~workers.engine.engine.Receiving` (what to pull;
        None when it was queued to prefill here, or ended at once)."""
        self.engine.validate(token_ids, params, output_ids)
        out: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = out
        top_k, depth = tree
        try:
            receiving = await self.call(lambda engine: engine.receive(
                request_id, token_ids, params, output_ids, handoff, grammar,
                num_speculative_tokens=num_speculative_tokens, tree_topk=top_k, tree_depth=depth))
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        return out, receiving

    async def compile_grammar(self, token_ids: list[int], params: SamplingParams, output_ids: list[int] = ()) -> Grammar:
        """``params.structured`` compiled in a thread (a large schema takes milliseconds; the first one
        also builds the tokenizer info), so that neither the event loop nor the engine step waits."""
        self.engine.validate(token_ids, params, output_ids)
        return await asyncio.to_thread(self.engine.grammars.grammar, params.structured)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (no more deltas are delivered)."""
        self.handoffs.pop(request_id, None)
        if self._queues.pop(request_id, None) is not None:
            self._push(AbortRequest(request_id))

    async def call(self, fn: Callable[[Engine], object]):
        """Run ``fn(engine)`` on the engine's thread between steps and return its result."""
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
        while not self._stopping:
            try:
                await self._iteration()
            except Exception as exc:  # a bug outside the engine step: fail what is open, keep serving
                self.loop_errors += 1
                log.exception("target step loop: iteration failed; failing its open requests")
                self.drafting.forget()
                for rid in list(self._queues):
                    self._fail(rid, EngineFailed(f"target step loop failed: {exc!r}"))
                    self._commands.append(AbortRequest(rid))

    async def _iteration(self) -> None:
        if not self._commands and not self._has_work:
            self.drafting.forget()  # proposals for sequences that are gone: not worth waiting for
            self._wake.clear()
            await self._wake.wait()
            return
        started = time.perf_counter()
        drafting = self.drafting
        proposals = await drafting.collect()
        contexts = await drafting.contexts()
        commands = list(self._commands)
        self._commands.clear()
        loop = asyncio.get_running_loop()
        asked = any(p.asked > 0 for p in proposals.values())  # a round was asked for this cycle's step (late or not)
        cycle = await loop.run_in_executor(self._executor, self.run_cycle, commands, proposals, contexts,
                                           self._last_cycle, self._last_asked)
        self._has_work = cycle.has_work
        for cmd, result, error in cycle.results:
            self._resolve(cmd, result, error)
        if drafting.talk(cycle):  # first: the drafts work while the loop delivers
            await drafting.hand_over()
        self.handoffs.update(cycle.handoffs)  # before the deltas whose finish reason says "handoff"
        self._deliver(cycle.outputs)
        for rid, error in cycle.failed:
            self._fail(rid, error)
        if cycle.kv_events and self._on_kv_events is not None:
            self._on_kv_events(cycle.kv_events)
        if cycle.stepped:
            self.steps += 1
        drafting.observe(cycle, proposals)
        self._last_cycle = time.perf_counter() - started if cycle.stepped else 0.0
        self.busy_seconds += time.perf_counter() - started
        self._last_asked = asked

    def run_cycle(self, commands: list[Command], proposals: dict[int, Proposals], contexts: tuple[DraftContext, ...],
                  last_cycle: float, last_asked: bool = False) -> Cycle:
        """Everything of one cycle that touches the engine, on its thread: the loop runs it in its
        executor; a driver that runs cycles itself (``bench/default_step_bench.py``) calls it directly.
        ``proposals``: per stream serial, what its seam collected; ``contexts``: the streams to use,
        primary first (empty: decode plainly)."""
        engine, out = self.engine, Cycle()
        if last_cycle and self.pool is not None:  # load-aware budgets learn what a whole cycle costs
            engine.observe_cycle(last_cycle, last_asked)
        spec, drafting = engine.spec, self.drafting
        # a quiet round (the speculator's held plan drafts nothing for the same batch) on the stream of
        # the last cycle, which brought nothing: nothing to place, hand over or count
        quiet = spec.quiet and drafting.unchanged(contexts, proposals)
        if not quiet and (contexts or drafting.placement.serials):
            # a new draft stream knows none of our sequences, even one to the same draft worker (a new
            # stream to it, or to a newer incarnation of it): its sequences are committed afresh, and
            # nothing the old stream sent is used
            drafting.follow(contexts)
        for cmd in commands:
            out.results.append(self._apply(cmd))
        answers, streamed = drafting.proposals(proposals, contexts) if contexts and not quiet else ({}, [])
        # what the step sees of the drafts' proposals, counted only where it can see any
        before = drafting.counts(contexts) if contexts and (answers or streamed or spec.staged) else None
        if streamed:  # pipelined: streamed ahead; checked and kept until they fit
            engine.offer(streamed)
        added = engine.take_added()
        if added and contexts:
            drafting.prompt_news(added, contexts)
        if engine.has_work():
            started = time.perf_counter()
            try:
                out.outputs = engine.step(answers)
                out.handoffs = engine.handoffs.take()  # prefill role: where handed-off requests' KV waits
                self._failures_in_a_row = 0
                if engine.last_step.tokens:
                    out.decode_seconds = time.perf_counter() - started
            except Exception as exc:
                out.failed = self._step_failed(exc)
            out.stepped = True
        if contexts:
            if not (quiet and drafting.quiet_round(contexts)):
                out.news = drafting.shares(contexts, before)
                drafting.messages(out, contexts)
        else:
            engine.draft_news((), None, None, False, "no_draft")  # (dropped) and why the next step decodes plainly
        out.kv_events = engine.drain_kv_events()
        out.has_work = engine.has_work()
        return out

    def _apply(self, cmd: Command) -> tuple[Command, object, BaseException | None]:
        engine = self.engine
        try:
            if isinstance(cmd, AddRequest):
                top_k, depth = cmd.tree
                engine.add_request(cmd.request_id, cmd.token_ids, cmd.params, cmd.output_ids, cmd.grammar,
                                   num_speculative_tokens=cmd.num_speculative_tokens, tree_topk=top_k,
                                   tree_depth=depth, prefill_only=cmd.prefill_only, lora=cmd.lora,
                                   priority=cmd.priority, draft=cmd.draft)
                return cmd, None, None
            if isinstance(cmd, AbortRequest):
                engine.abort(cmd.request_id)
                return cmd, None, None
            return cmd, cmd.fn(engine), None
        except Exception as exc:
            return cmd, None, exc

    def _step_failed(self, exc: Exception) -> list[tuple[str, BaseException]]:
        """An engine step raised: the requests of its batch fail (and leave the engine); the others
        go on. Steps failing ``BROKEN_AFTER`` times in a row mark the engine broken."""
        engine = self.engine
        self.step_failures += 1
        self._failures_in_a_row += 1
        batch = list(engine.last_batch) or list(engine.seqs)
        log.error("engine step failed (%d in a row), failing %d request(s): %r", self._failures_in_a_row,
                  len(batch), exc, exc_info=exc)
        if self._failures_in_a_row == BROKEN_AFTER:
            log.error("engine failed %d steps in a row: reporting unhealthy", self._failures_in_a_row)
        for rid in batch:
            engine.abort(rid)
        engine.reset_drafts()  # verdicts of the failed step, if any, are unsafe to send
        error = EngineFailed(f"engine step failed: {exc!r}")
        return [(rid, error) for rid in batch]

    def _resolve(self, cmd: Command, result: object, error: BaseException | None) -> None:
        if isinstance(cmd, AddRequest):
            if error is not None:
                queue = self._queues.pop(cmd.request_id, None)
                if queue is not None:
                    queue.put_nowait(error)
        elif isinstance(cmd, AbortRequest):
            if error is not None:
                log.warning("request %s: abort failed: %r", cmd.request_id, error)
        elif not cmd.future.done():
            if error is not None:
                cmd.future.set_exception(error)
            else:
                cmd.future.set_result(result)

    def _deliver(self, outputs: list[tuple[str, TokenDelta]]) -> None:
        for rid, delta in outputs:
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(delta)
                if delta.finish_reason:
                    del self._queues[rid]

    def _fail(self, rid: str, error: BaseException) -> None:
        queue = self._queues.pop(rid, None)
        if queue is not None:
            queue.put_nowait(error)

    # ------------------------------------------------------------------ speculation

    async def _housekeeping(self) -> None:
        """Publish the spec-decode counters per draft worker (cumulative, when they changed, and every
        10 intervals regardless) and let go of a draft worker that left while this target is idle."""
        sent: dict[str, int] = {}
        ticks = 0
        while True:
            await asyncio.sleep(self._stats_interval)
            ticks += 1
            try:
                await self.pool.prune()
            except Exception as exc:
                log.warning("pruning draft streams failed: %r", exc)
            if self._publish is None:
                continue
            for draft_id, counters in list(self.engine.counters.items()):
                if not draft_id or (sent.get(draft_id) == counters.num_drafts and ticks % 10):
                    continue
                sent[draft_id] = counters.num_drafts
                try:
                    await self._publish(TOPIC_SPEC_STATS, counters.event(self.target_id, draft_id, self._epoch,
                                                                         self.drafting.methods.get(draft_id, "")))
                except Exception as exc:
                    log.debug("spec stats not published: %r", exc)

