"""Prefill/decode disaggregation, the frontend's side: where a prompt is prefilled.

For each new request the decode worker is chosen first (the usual KV-aware choice over
``target.generate``). The prompt is prefilled remotely when that worker is a decode worker (role
``decode``: it can pull KV), some prefill worker serves the model, the part of the prompt the
decode worker does not hold is at least ``min_tokens`` long, and the least-loaded prefill worker
has fewer than ``max_queue`` requests waiting or in flight from here (conditional
disaggregation). The prefill worker is chosen KV-aware among ``prefill.generate`` instances; its
one frame (:class:`runtime.messages.PrefillDelta`) carries the first token and a :class:`runtime.messages.KvHandoff`, which goes to the
decode worker with the rest of the request.

Everything else prefills on the decode worker, as without prefill workers. A prefill worker that
dies, stalls or drains before it answers only costs the time spent: the request prefills on its
decode worker instead. Decisions are counted in ``prefills`` (``where`` = remote or local, and why).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from router.base import Router
from runtime import EndpointClient, InstanceGone, InstanceTimeout, NoInstances, PendingBytes, ShuttingDown
from runtime.errors import EngineFailed, declares_gone
from runtime.messages import GenerateRequest, PrefillDelta

from .dispatch import close_stream

log = logging.getLogger(__name__)

PREFILL_FAILURES = (InstanceGone, InstanceTimeout, ShuttingDown, EngineFailed)


class RemotePrefill:
    """Chooses where prompts prefill and runs remote prefills; plain collaborators in."""

    def __init__(self, router: Router, client: EndpointClient, decode: EndpointClient,
                 block_size: Callable[[str], int], min_tokens: int = 256, max_queue: int = 8):
        self.router = router  # over prefill.generate instances
        self.client = client
        self.decode = decode
        self.block_size = block_size
        self.min_tokens = min_tokens
        self.max_queue = max_queue
        self.prefills: Counter = Counter()  # (where, why) -> requests
        self.failures: Counter = Counter()  # remote prefills that fell back, by error kind
        self.on_decision: Callable[[str, str], None] | None = None  # (where, why), e.g. a metric

    def _decided(self, where: str, why: str) -> None:
        self.prefills[(where, why)] += 1
        if self.on_decision is not None:
            self.on_decision(where, why)

    def _local(self, why: str) -> None:
        self._decided("local", why)

    def _is_decode_worker(self, instance_id: str) -> bool:
        return any(r.instance_id == instance_id and r.role == "decode" for r in self.decode.instances())

    async def run(self, model: str, token_ids: list[int], request: GenerateRequest, decode_id: str, overlap_blocks: int,
                  request_id: str, pending: PendingBytes | None = None) -> PrefillDelta | None:
        """The prefill worker's answer for ``request`` (the first token's delta, and the handoff unless
        the request ended with it), or None: prefill on the decode worker ``decode_id`` instead."""
        if not self.client.instances(model):
            return None  # no prefill pool: not counted, as without disaggregation
        if not self._is_decode_worker(decode_id):
            self._local("not_decode")
            return None
        uncached = len(token_ids) - overlap_blocks * self.block_size(model)
        if uncached < self.min_tokens:
            self._local("short")
            return None
        try:
            sel = await self.router.select(model, token_ids, request_id=request_id)
        except NoInstances:
            self._local("no_prefill")
            return None
        try:
            load = getattr(self.router, "load", None)
            queue = load.queued(sel.instance_id) + load.own_requests(sel.instance_id) - 1 if load else 0
            if queue >= self.max_queue:
                self._local("busy")
                return None
            return await self._call(sel.instance_id, request, request_id, pending)
        finally:
            self.router.release(sel)

    async def _call(self, instance_id: str, request: GenerateRequest, request_id: str,
                    pending: PendingBytes | None) -> PrefillDelta | None:
        stream = None
        try:
            stream = await self.client.call(instance_id, request, PrefillDelta, request_id=f"{request_id}-p",
                                            pending=pending)
            first = None
            async for answer in stream:
                if first is None:
                    first = answer
            if first is None or (first.handoff is None and first.delta.finish_reason is None):
                raise InstanceGone(instance_id, "the prefill stream ended without a handoff")
            self._decided("remote", "ok")
            return first
        except PREFILL_FAILURES as exc:
            self.failures[type(exc).__name__] += 1
            self._local("prefill_failed")
            if declares_gone(exc):
                self.client.mark_unreachable(instance_id, str(exc))
            log.warning("request %s: prefill worker %s failed (%s); prefilling on the decode worker", request_id,
                        instance_id, exc)
            return None
        finally:
            if stream is not None and not stream.finished:
                await close_stream(stream)
