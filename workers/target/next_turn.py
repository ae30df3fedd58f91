"""Next-turn prefill: an agent turn's whole context computed into the prefix cache in the background.

A frontend that served a chat turn with ``nvext.agent_hints.speculative_prefill`` sends the turn's
context (prompt, reply, the template's end of turn) back to the worker that served it as a
``GenerateRequest`` with ``next_turn`` set; the next turn's prompt then starts with cached blocks.

It is background work, never a cost to a real request:

- it starts only on a worker with no real request open (else it is dropped at once, ``busy``), and
  only when the blocks it may need leave a reserve of the pool free (else ``memory``);
- it runs as a series of ordinary greedy one-token requests over growing prefixes of the context,
  ``step_tokens`` new tokens each (whole blocks), so the engine never runs a long step for it; each
  piece's blocks are registered in the prefix cache when it ends, and its one token is discarded;
- a real request arriving at the worker aborts the piece in flight (:meth:`NextTurnPrefill.yield_now`,
  called before the real one is queued, so the engine sees the abort first); what the earlier pieces
  computed stays cached (``yielded``).

Only one runs at a time per worker; a few more may wait for it (``max_waiting``), the rest are
dropped. Outcomes are counted in :attr:`NextTurnPrefill.outcomes` (the worker's metrics).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter

from runtime.errors import InvalidRequest
from runtime.kv_hash import block_hashes, chain_root
from runtime.messages import NEXT_TURN_DONE, NEXT_TURN_DROPPED, GenerateRequest, SamplingParams

log = logging.getLogger(__name__)

STEP_TOKENS = 256  # new tokens per piece (rounded down to whole blocks): the longest step it adds
RESERVE = 0.1  # share of the KV pool that must stay free after its blocks (else: memory pressure)
MAX_WAITING = 4  # next-turn prefills waiting for the one running on this worker
PIECE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
_YIELDED = object()  # put on a piece's queue when a real request takes the worker

# "started": computing began; then each request ends in one of the others
OUTCOMES = ("started", "prefilled", "busy", "memory", "yielded", "invalid", "failed")


class NextTurnPrefill:
    """Next-turn prefills on one worker's step loop (see the module docstring); plain values in."""

    def __init__(self, loop, step_tokens: int = STEP_TOKENS, reserve: float = RESERVE, max_waiting: int = MAX_WAITING):
        if step_tokens <= 0 or not 0 <= reserve < 1 or max_waiting < 0:
            raise ValueError(f"bad next-turn prefill settings: step_tokens={step_tokens}, reserve={reserve}, "
                             f"max_waiting={max_waiting}")
        self.loop = loop  # a workers.target.step_loop.StepLoop
        self.step_tokens = step_tokens
        self.reserve = reserve
        self.max_waiting = max_waiting
        self.outcomes: Counter = Counter({name: 0 for name in OUTCOMES})
        self.tokens = 0  # context tokens computed by finished pieces
        self._piece: tuple[str, asyncio.Queue] | None = None  # (request id, deltas) of the piece in flight
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._ids = itertools.count()

    def busy(self) -> bool:
        """Whether the engine holds a request other than the piece in flight."""
        return self.loop.num_requests > (1 if self._piece is not None else 0)

    def yield_now(self) -> None:
        """A real request is about to be queued: abort the piece in flight (its blocks, computed or
        not, go back to the pool; earlier pieces' blocks stay cached)."""
        if self._piece is not None:
            rid, out = self._piece
            self._piece = None
            out.put_nowait(_YIELDED)
            self.loop.abort(rid)

    async def run(self, request_id: str, req: GenerateRequest) -> str:
        """Prefill ``req.token_ids``; returns ``NEXT_TURN_DONE`` or ``NEXT_TURN_DROPPED`` (never raises
        for the request's sake: a next-turn prefill is never an error to anyone)."""
        if self._waiting >= self.max_waiting or self.busy():
            return self._end("busy", request_id)
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            if self.busy():  # (a real request came while this one waited)
                return self._end("busy", request_id)
            return await self._run(request_id, req)
        finally:
            self._lock.release()

    async def _run(self, request_id: str, req: GenerateRequest) -> str:
        engine = self.loop.engine
        tokens = list(req.token_ids)
        try:
            engine.validate(tokens, PIECE)
        except InvalidRequest as exc:
            log.debug("next-turn prefill %s: %s", request_id, exc)
            return self._end("invalid", request_id)
        blocks = engine.blocks
        bs = blocks.block_size
        # the cached prefix (a dict lookup per block; the engine thread may change it meanwhile: a hint)
        hashes = block_hashes(tokens, bs, chain_root(req.lora or None))
        cached = len(blocks.match_prefix(hashes)) * bs
        need = -(-(len(tokens) - cached) // bs)
        if need > blocks.num_free_blocks - self.reserve * blocks.num_blocks:
            return self._end("memory", request_id)
        if len(tokens) // bs * bs <= cached:  # every whole block is cached already
            return self._end("prefilled", request_id)
        self.outcomes["started"] += 1
        step = max(bs, self.step_tokens // bs * bs)
        ends = [*range(cached + step, len(tokens), step), len(tokens)]
        for i, end in enumerate(ends):
            if self.busy():
                return self._end("yielded", request_id)
            rid = f"{request_id}#next{next(self._ids)}"
            try:
                out = self.loop.submit(rid, tokens[:end], PIECE, num_speculative_tokens=0, lora=req.lora or None,
                                       priority=req.priority)
            except Exception as exc:  # (validated above; a LoRA adapter unloaded meanwhile, say)
                log.debug("next-turn prefill %s: %r", request_id, exc)
                return self._end("failed", request_id)
            self._piece = (rid, out)
            finished = False
            try:
                while not finished:
                    item = await out.get()
                    if item is _YIELDED:
                        return self._end("yielded", request_id)
                    if isinstance(item, Exception):
                        log.debug("next-turn prefill %s: %r", request_id, item)
                        return self._end("failed", request_id)
                    finished = item.finish_reason is not None
            finally:
                if self._piece is not None and self._piece[0] == rid:
                    self._piece = None
                    if not finished:
                        self.loop.abort(rid)  # cancelled mid-piece (the frontend left): free its blocks
            self.tokens += end - (ends[i - 1] if i else cached)
        return self._end("prefilled", request_id)

    def _end(self, outcome: str, request_id: str) -> str:
        self.outcomes[outcome] += 1
        log.debug("next-turn prefill %s: %s", request_id, outcome)
        return NEXT_TURN_DONE if outcome == "prefilled" else NEXT_TURN_DROPPED
