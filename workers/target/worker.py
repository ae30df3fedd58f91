"""The target worker's ``generate`` handler and its event publishers (KV events, load, KV dumps).

The engine itself is driven by :class:`workers.target.step_loop.StepLoop`; a handler submits its
request there and streams the deltas that come back on its queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from runtime.errors import InvalidRequest
from runtime.events import TOPIC_KV, TOPIC_LOAD
from runtime.messages import (GenerateRequest, KvDumpRequest, KvEvent, LoadEvent, LoraAdmin, LoraAdminReply,
                              PrefillDelta, TokenDelta)

from ..engine.engine import HANDOFF, Engine
from ..engine.lora import LoraError
from .disagg import DisaggStats, HandoffKeeper, KvReceiver, release_handoff
from .draft_pool import DraftPool
from .metrics import RequestStats
from .next_turn import NextTurnPrefill
from .draft_watch import DraftWatch
from .step_loop import StepLoop

log = logging.getLogger(__name__)

Publish = Callable[[str, object], Awaitable[None]]


def merge_deltas(deltas: list[TokenDelta]) -> TokenDelta:
    """Several deltas of one request as one (the stream's consumer fell behind the engine)."""
    if len(deltas) == 1:
        return deltas[0]
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [x for d in deltas for x in d.logprobs] if all(d.logprobs is not None for d in deltas) else None
    top = [x for d in deltas for x in d.top_logprobs] if all(d.top_logprobs is not None for d in deltas) else None
    last = deltas[-1]
    return TokenDelta(tokens, logprobs, top, last.finish_reason, last.usage)


class TargetWorker:
    """Serves ``generate`` from an :class:`Engine` driven by a :class:`StepLoop`; speculates through
    ``pool`` (a :class:`DraftPool`) when given one."""

    def __init__(self, engine: Engine, worker_id: str, publish: Publish, model_name: str,
                 load_interval: float = 0.5, *, pool: DraftPool | None = None, propose_timeout: float = 2.0,
                 propose_min_wait: float = 0.02, epoch: float = 0.0, role: str = "aggregated",
                 receiver: KvReceiver | None = None,
                 on_adapter: Callable[[str, bool], Awaitable[None]] | None = None,
                 executor: ThreadPoolExecutor | None = None):
        self.engine = engine
        self.role = role
        self.disagg = receiver.stats if receiver is not None else DisaggStats()
        self.receiver = receiver  # decode role: pulls prompts' KV from prefill workers
        self.keeper: HandoffKeeper | None = None
        self.worker_id = worker_id
        self.model_name = model_name
        self._publish = publish
        self._load_interval = load_interval
        self._kv_out: asyncio.Queue[list[KvEvent]] = asyncio.Queue()
        self.loop = StepLoop(engine, pool, worker_id, watch=DraftWatch(propose_timeout, min_wait=propose_min_wait),
                             on_kv_events=self._kv_out.put_nowait, publish=publish, epoch=epoch,
                             executor=executor)
        self.next_turn = NextTurnPrefill(self.loop)  # agents' next-turn prefills: background, yielding
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count()
        self.cancelled = 0  # handlers cancelled by their client
        self.stats = RequestStats()
        self._on_adapter = on_adapter  # (name, loaded): publish or withdraw a LoRA adapter's model card

    async def start(self) -> None:
        self.loop.start()
        if self.role == "prefill":
            self.keeper = HandoffKeeper(self.loop, self.disagg)
            self.keeper.start()
        await self.loop.call(lambda engine: engine.blocks.clear())  # tell routers we start empty
        self._tasks.append(asyncio.create_task(self._publish_kv(), name="target-kv-events"))
        self._tasks.append(asyncio.create_task(self._publish_load(), name="target-load"))

    async def drain(self, timeout: float) -> None:
        """Wait (bounded) until the engine has no requests; new ones are refused by the runtime."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.loop.num_requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.receiver is not None:
            await self.receiver.stop()
        if self.keeper is not None:
            await self.keeper.stop()
        await self.loop.stop()

    async def generate(self, req: GenerateRequest, ctx) -> AsyncIterator[TokenDelta]:
        """Token ids in, token deltas out; the last delta has the finish reason and usage. A request
        with ``kv_transfer`` (decode role) has its prompt's KV pulled from a prefill worker. A
        ``next_turn`` request fills the prefix cache in the background (:mod:`.next_turn`) and
        answers one delta: ``NEXT_TURN_DONE`` or ``NEXT_TURN_DROPPED``."""
        if req.next_turn:
            if req.model and req.model != self.model_name:
                raise InvalidRequest(f"this worker serves {self.model_name!r}, not {req.model!r}", field="model")
            yield TokenDelta(finish_reason=await self.next_turn.run(f"{ctx.request_id}#{next(self._ids)}", req))
            return
        async for _, delta in self._serve(req, ctx, prefill_only=False):
            yield delta

    async def prefill(self, req: GenerateRequest, ctx) -> AsyncIterator[PrefillDelta]:
        """Prefill role: compute the prompt and its first token; the one frame carries that token and,
        unless the request ended with it, the handoff saying where its KV waits."""
        if req.kv_transfer is not None:
            raise InvalidRequest("a prefill worker computes prompts; it takes no kv_transfer", field="kv_transfer")
        async for rid, delta in self._serve(req, ctx, prefill_only=True):
            if delta.finish_reason == HANDOFF:
                self.disagg.handoffs += 1
                yield PrefillDelta(msgspec.structs.replace(delta, finish_reason=None, usage=None),
                                   self.loop.handoffs.pop(rid))
            else:
                yield PrefillDelta(delta)

    async def _serve(self, req: GenerateRequest, ctx, prefill_only: bool) -> AsyncIterator[tuple[str, TokenDelta]]:
        if req.model and req.model != self.model_name:
            raise InvalidRequest(f"this worker serves {self.model_name!r}, not {req.model!r}", field="model")
        rid = f"{ctx.request_id}#{next(self._ids)}"
        lora = req.lora or None
        if lora:
            if self.engine.lora is None:
                raise InvalidRequest(f"this worker serves no LoRA adapters, not {lora!r}", field="model")
            self.engine.lora.check(lora)
            if prefill_only or req.kv_transfer is not None:
                raise InvalidRequest("LoRA adapters are not served with prefill/decode disaggregation", field="model")
        for name, low in (("num_speculative_tokens", 0), ("speculative_tree_topk", 1), ("speculative_tree_depth", 1)):
            value = getattr(req, name)
            if value is not None and value < low:
                raise InvalidRequest(f"{name} must be >= {low}, got {value}", field=name)
        grammar = None
        if req.sampling.structured is not None:
            grammar = await self.loop.compile_grammar(list(req.token_ids), req.sampling, list(req.output_ids))
        started, last = time.monotonic(), None
        finished = False
        self.next_turn.yield_now()  # a real request: background prefill steps aside before it is queued
        try:
            if req.kv_transfer is not None and self.receiver is not None:
                out = await self.receiver.admit(self.loop, rid, req, grammar)
            else:
                if req.kv_transfer is not None:  # not a decode worker: prefill here, and free the handoff
                    self.disagg.local_prefills["not_decode"] += 1
                    await release_handoff(self._publish, req.kv_transfer, ok=False)
                out = self.loop.submit(rid, list(req.token_ids), req.sampling, list(req.output_ids),
                                       req.num_speculative_tokens,
                                       (req.speculative_tree_topk, req.speculative_tree_depth), grammar, prefill_only,
                                       lora, req.priority, req.draft_id)
            while not finished:
                items = [await out.get()]
                while not out.empty():
                    items.append(out.get_nowait())
                for item in items:
                    if isinstance(item, Exception):
                        raise item
                delta = merge_deltas(items)
                finished = delta.finish_reason is not None
                self.stats.observe_delta(delta)
                if delta.token_ids or finished:
                    last = self.stats.observe_timing(started, last, delta)
                yield rid, delta
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            self.stats.observe_cancel()
            log.info("request %s: cancelled by the client, freeing its blocks", ctx.request_id)
            raise
        finally:
            if not finished:
                self.loop.abort(rid)

    async def lora_admin(self, req: LoraAdmin, ctx) -> AsyncIterator[LoraAdminReply]:
        """``target.lora``: load (a path given) or unload a LoRA adapter, then publish or withdraw its
        model card; one reply with the adapters held afterwards. Refusals are ``InvalidRequest``."""
        name, path = req.lora_name, req.lora_path
        if not name:
            raise InvalidRequest("lora_name must not be empty", field="lora_name")
        try:
            if path:
                await self.loop.call(lambda engine: engine.load_lora(name, path))
            else:
                await self.loop.call(lambda engine: engine.unload_lora(name))
        except LoraError as exc:
            raise InvalidRequest(str(exc), field=exc.field) from None
        log.info("LoRA adapter %s %s", name, f"loaded from {path}" if path else "unloaded")
        if self._on_adapter is not None:
            await self._on_adapter(name, bool(path))
        yield LoraAdminReply(self.engine.lora.names)

    @property
    def healthy(self) -> bool:
        """False when the step loop ended or the engine keeps failing (the health check's answer)."""
        return self.loop.healthy

    async def on_dump_request(self, _request: KvDumpRequest) -> None:
        events = await self.loop.call(lambda engine: engine.blocks.dump()
                                      + (engine.tiers.dump() if engine.tiers is not None else []))
        self._kv_out.put_nowait(events)

    def load(self) -> LoadEvent:
        engine = self.engine
        total = engine.blocks.num_blocks
        free = engine.blocks.num_free_blocks
        return LoadEvent(self.worker_id, running=engine.num_running, queued=engine.num_waiting,
                         active_blocks=total - free, total_blocks=total, free_blocks=free, timestamp=time.time(),
                         max_num_seqs=engine.config.max_num_seqs)

    async def _publish_kv(self) -> None:
        while True:
            events = await self._kv_out.get()
            for event in events:
                try:
                    await self._publish(TOPIC_KV, event)
                except Exception as exc:  # NATS reconnecting; routers resync with a dump request
                    log.warning("KV event %d not published: %r", event.event_id, exc)

    async def _publish_load(self) -> None:
        last = None
        ticks = 0
        while True:
            await asyncio.sleep(self._load_interval / 5)
            ticks += 1
            load = self.load()
            key = (load.running, load.queued, load.free_blocks)
            if key == last and ticks % 5:
                continue  # unchanged: publish only every load_interval
            last = key
            try:
                await self._publish(TOPIC_LOAD, load)
            except Exception as exc:
                log.debug("load not published: %r", exc)
