"""Sending one generation to a target worker, and moving it to another when its worker dies.

Contract: :meth:`Dispatcher.open` routes the request (raising ``NoInstances`` or
``PayloadTooLarge`` before anything is sent) and returns a :class:`Generation`, an async iterator
of :class:`TokenDelta` that ends after the delta carrying ``finish_reason``. When the worker fails
mid-request (``InstanceGone``, ``InstanceTimeout``, ``ShuttingDown``, ``EngineFailed``) the generation re-selects a
worker, excluding every one that failed it, and re-sends the prompt with
``output_ids`` = the tokens generated so far and the token budget that is left; the caller's
stream just continues. The router's selection is released exactly once per worker tried, and
:meth:`Generation.aclose` cancels the worker's handler when the caller leaves early.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import msgspec

from router.base import Router, Selection
from router.drafts import DraftAffinity
from runtime import EndpointClient, InstanceGone, InstanceTimeout, NoInstances, PendingBytes, ResponseStream, ShuttingDown
from runtime.errors import EngineFailed, declares_gone
from runtime.messages import NEXT_TURN_DROPPED, GenerateRequest, RoutingHints, SamplingParams, TokenDelta

from .protocol import SpeculativeOptions

log = logging.getLogger(__name__)

# A worker that died, stalled, drains, or whose engine failed a step with this request in it: the
# request continues on another worker (its prompt and the tokens so far), as many times as allowed.
MIGRATABLE = (InstanceGone, InstanceTimeout, ShuttingDown, EngineFailed)
END_TIMEOUT = 2.0  # seconds to wait for a worker's END frame after its finish delta
RESTART_WAIT_S = 30.0  # default: how long a request waits for a live worker when none is left
RESELECT_S = 0.5  # while waiting for one: the longest between two tries of the router

# Closing a worker stream must finish even when the task closing it is being cancelled (a client
# that went away); these tasks are kept here so they are not garbage-collected half way.
_closing: set[asyncio.Task] = set()


async def close_stream(stream: ResponseStream) -> None:
    """Close ``stream`` (cancelling the remote handler if it had not ended), cancellation-proof."""
    task = asyncio.ensure_future(stream.aclose())
    _closing.add(task)
    task.add_done_callback(_closing.discard)
    await asyncio.shield(task)


class Dispatcher:
    """Routes generate requests for one frontend; plain collaborators in."""

    def __init__(self, router: Router, client: EndpointClient, max_migrations: int = 3,
                 on_migrate: Callable[[], None] | None = None, prefill=None, restart_wait_s: float = RESTART_WAIT_S):
        self.router = router
        self.client = client
        self.prefill = prefill  # a frontend.disagg.RemotePrefill when prefill workers may exist
        self.max_migrations = max_migrations
        # how long a request (or a stream whose worker died) waits for a live instance when there is
        # none: the dead one's restart, or another one starting (0: fail at once)
        self.restart_wait_s = restart_wait_s
        self.migrations = 0  # requests moved to another worker
        self.drafts = DraftAffinity()  # the draft worker each conversation's latest turn speculated with
        self._on_migrate = on_migrate
        self._present: set[str] = set()  # models some registered instance serves
        self._lost: set[str] = set()  # models whose registered instances all went at some point
        client.snapshot.add_listener(self._seen)

    def _seen(self, items) -> None:
        present = {record.model for record in items.values()}
        self._lost |= self._present - present
        self._present = present

    def may_come_back(self, model: str) -> bool:
        """Whether a request for ``model`` with no live instance should wait (bounded by
        ``restart_wait_s``): an instance of it is registered (a dead one stays until its lease ends),
        or one was and went (its restart registers the model card before the instance). A model no
        instance ever served here (a card alone) gets its 503 at once."""
        return model in self._lost or any(r.model == model for r in self.client.snapshot.values())

    async def open(
        self, model: str, token_ids: Sequence[int], sampling: SamplingParams, request_id: str,
        speculative: SpeculativeOptions | None = None, pending: PendingBytes | None = None,
        lora: str = "", exclude: frozenset[str] = frozenset(), hints: RoutingHints | None = None,
    ) -> Generation:
        """Route and send one generation; ``pending`` counts the bytes of its frames not read yet.
        ``lora``: the LoRA adapter it runs with on ``model``; ``exclude``: instances never to use
        (those that do not hold the adapter); ``hints``: its priority, queue tier and session, for the
        router (which may hold it in its queue) and the worker (its priority)."""
        gen = Generation(self, model, list(token_ids), sampling, request_id, speculative, pending)
        gen.lora, gen.failed, gen.hints = lora, set(exclude), hints
        await gen._send()
        return gen

    async def next_turn(self, model: str, token_ids: Sequence[int], instance_id: str, request_id: str,
                        priority: int = 0, lora: str = "") -> str:
        """Ask ``instance_id`` to prefill ``token_ids`` into its prefix cache in the background (an
        agent's next turn, see :mod:`frontend.next_turn`); not routed, not counted as load. Returns
        the worker's answer, ``NEXT_TURN_DONE`` or ``NEXT_TURN_DROPPED``."""
        request = GenerateRequest(list(token_ids), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                  model, num_speculative_tokens=0, lora=lora, priority=priority, next_turn=True)
        stream = await self.client.call(instance_id, request, TokenDelta, request_id=request_id)
        finish = NEXT_TURN_DROPPED
        try:
            async for delta in stream:
                finish = delta.finish_reason or finish
        finally:
            if not stream.finished:
                await close_stream(stream)
        return finish


class Generation:
    """The token deltas of one request, across however many workers it took."""

    def __init__(self, dispatcher: Dispatcher, model: str, token_ids: list[int], sampling: SamplingParams, request_id: str,
                 speculative: SpeculativeOptions | None = None, pending: PendingBytes | None = None):
        self._d = dispatcher
        self.speculative = speculative
        self.pending = pending
        self.model = model
        self.token_ids = token_ids
        self.sampling = sampling
        self.request_id = request_id
        self.output_ids: list[int] = []
        self.failed: set[str] = set()  # instances not to use: failed this request, or lack its adapter
        self.lora = ""  # the LoRA adapter it runs with ("": the base model)
        self.hints: RoutingHints | None = None
        self.attempt = 0
        self._selection: Selection | None = None
        self._stream: ResponseStream[TokenDelta] | None = None
        self._done = False
        self._finishing = False  # the finish delta was returned; the END frame is still to come
        self._first: TokenDelta | None = None  # a prefill worker's delta, returned before the decode worker's
        self.served_by: str | None = None  # the worker it was last sent to (its KV is there when it ends)

    @property
    def _session(self) -> str:
        return self.hints.session_id if self.hints is not None else ""

    @property
    def instance_id(self) -> str | None:
        return self._selection.instance_id if self._selection else None

    async def _select(self) -> Selection:
        """A worker not known dead or failing this request; with none live, wait for one (the dead
        worker's restart) up to the dispatcher's ``restart_wait_s``, then raise ``NoInstances``."""
        deadline = time.monotonic() + self._d.restart_wait_s
        waited = False  # logged once
        while True:
            # instances NATS found unreachable are excluded too (a standalone router cannot know of them)
            exclude = frozenset(self.failed) | frozenset(self._d.client.unreachable_ids())
            try:
                return await self._d.router.select(self.model, self.token_ids, exclude=exclude,
                                                   request_id=self.request_id, lora=self.lora, hints=self.hints)
            except NoInstances:
                left = deadline - time.monotonic()
                if left <= 0 or not self._d.may_come_back(self.model):
                    raise
                if not waited:
                    waited = True
                    log.info("request %s: no live worker serves %s; waiting up to %.0fs for one",
                             self.request_id, self.model, left)
            # a new instance, or one coming back from an unreachable mark; the router's own view
            # (a standalone router's) may follow the snapshot a moment later, hence the short retry
            client = self._d.client

            def eligible(_items) -> bool:
                return any(r.instance_id not in exclude for r in client.instances(self.model))

            try:
                await client.snapshot.wait_for(eligible, min(left, RESELECT_S))
            except asyncio.TimeoutError:
                pass

    async def _send(self) -> None:
        """Pick a worker (not one that failed us) and send it what is left of the request."""
        sel = await self._select()
        self._selection = sel
        self.served_by = sel.instance_id
        spec = self.speculative
        request = GenerateRequest(self.token_ids, self.sampling, self.model,
                                  num_speculative_tokens=spec.num_draft_tokens if spec else None,
                                  speculative_tree_topk=spec.eagle_topk if spec else None,
                                  speculative_tree_depth=spec.num_steps if spec else None, lora=self.lora,
                                  priority=self.hints.priority if self.hints else 0,
                                  draft_id=self._d.drafts.choose(self.token_ids, self._session))
        handoff = None
        if self.attempt == 0 and self._d.prefill is not None and not self.lora:  # adapters: no disaggregation
            try:
                first = await self._d.prefill.run(self.model, self.token_ids, request, sel.instance_id,
                                                  sel.overlap_blocks, self.request_id, self.pending)
            except BaseException:
                self._release()
                raise
            if first is not None:
                handoff = first.handoff
                self._first = first = first.delta
                if first.finish_reason is not None:  # the first token ended it: no decode worker needed
                    self._release()
                    return
                self.output_ids.extend(first.token_ids)
        sp = self.sampling
        done = len(self.output_ids)
        if done:
            sp = msgspec.structs.replace(sp, max_tokens=sp.max_tokens - done, min_tokens=max(0, sp.min_tokens - done))
        request = msgspec.structs.replace(request, sampling=sp, output_ids=list(self.output_ids), kv_transfer=handoff)
        rid = self.request_id if self.attempt == 0 else f"{self.request_id}-m{self.attempt}"
        try:
            self._stream = await self._d.client.call(sel.instance_id, request, TokenDelta, request_id=rid,
                                                     pending=self.pending)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        if self._selection is not None:
            self._d.router.release(self._selection)
            self._selection = None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._first is not None:  # the prefill worker's first token
            first, self._first = self._first, None
            if first.finish_reason is not None:
                self._done = True
            return first
        while True:
            if self._finishing:
                await self.aclose()
            if self._done or self._stream is None:
                raise StopAsyncIteration
            try:
                delta = await self._stream.__anext__()
            except StopAsyncIteration:
                delta = None
                failure: Exception = InstanceGone(self._stream.instance_id, "stream ended without a finish reason")
            except MIGRATABLE as exc:
                delta, failure = None, exc
            except BaseException:
                await self.aclose()
                raise
            if delta is not None:
                self.output_ids.extend(delta.token_ids)
                self._finishing = delta.finish_reason is not None
                spec = delta.usage.spec if delta.usage is not None else None
                if spec is not None and spec.draft_id:  # its next turn goes back to that draft
                    self._d.drafts.note(self.token_ids + self.output_ids, spec.draft_id, self._session)
                return delta
            await self._migrate(failure)
            if len(self.output_ids) >= self.sampling.max_tokens:
                # The worker died after its last token but before saying so.
                await self.aclose()
                return TokenDelta(finish_reason="length")

    async def _migrate(self, failure: Exception) -> None:
        stream, self._stream = self._stream, None
        failed = stream.instance_id
        self.failed.add(failed)
        if declares_gone(failure):  # hung or dead: no new request goes there until it shows a sign of life
            self._d.client.mark_unreachable(failed, failure.reason if isinstance(failure, InstanceGone) else str(failure))
        if not stream.finished:  # a stalled stream: tell the worker, should it still be alive
            await close_stream(stream)
        self._release()
        self.attempt += 1
        if self.attempt > self._d.max_migrations:
            self._done = True
            raise failure
        log.warning("request %s: worker %s failed (%s); migrating with %d tokens generated",
                    self.request_id, failed, failure, len(self.output_ids))
        if len(self.output_ids) >= self.sampling.max_tokens:
            return
        self._d.migrations += 1
        if self._d._on_migrate is not None:
            self._d._on_migrate()
        try:
            await self._send()
        except BaseException:
            self._done = True
            raise

    def close_nowait(self) -> asyncio.Task | None:
        """End the generation now: bookkeeping at once, the worker stream's end in a task of its own.

        Safe in a task that is being cancelled (a client that left): nothing here awaits. A worker
        still generating is told to stop; one that already sent its finish delta is read to its
        END frame instead, so a finished handler is not cancelled. Idempotent.
        """
        self._done = True
        stream, self._stream = self._stream, None
        finishing, self._finishing = self._finishing, False
        self._release()
        if stream is None or stream.finished:
            return None
        task = asyncio.ensure_future(_end_stream(stream, finishing))
        _closing.add(task)
        task.add_done_callback(_closing.discard)
        return task

    async def aclose(self) -> None:
        """:meth:`close_nowait`, then wait for the worker stream to be closed."""
        task = self.close_nowait()
        if task is not None:
            await asyncio.shield(task)


async def _end_stream(stream: ResponseStream, finishing: bool) -> None:
    if finishing:
        try:
            await asyncio.wait_for(_drain(stream), END_TIMEOUT)
        except Exception as exc:
            log.debug("request %s: no clean end from worker %s: %r", stream.request_id, stream.instance_id, exc)
    if not stream.finished:
        await stream.aclose()


async def _drain(stream: ResponseStream) -> None:
    async for delta in stream:
        log.warning("request %s: worker sent a delta after the finish reason: %r", stream.request_id, delta)
