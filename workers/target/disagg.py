"""Prefill/decode disaggregation, the target worker's side: handing a prompt's KV off, and pulling it in.

Roles (``--role``): ``aggregated`` prefills and decodes its own requests (no NIXL); ``prefill``
serves ``prefill.generate``: it computes the prompt, samples the first token and answers with one
delta carrying it and a :class:`runtime.messages.KvHandoff` (its blocks stay parked until the decode
worker releases them, or ``ttl`` runs out: :class:`HandoffKeeper`); ``decode`` serves
``target.generate`` like an aggregated worker, and a request with ``kv_transfer`` has its prompt's
KV and hidden rows pulled (:class:`KvReceiver`) instead of recomputed. Both NIXL roles register their
cache with a :class:`.kv_transfer.KvAgent` and publish it in etcd.

Nothing here loses a request: a pull that cannot start (no agent record, a layout that does not fit,
no free blocks), fails or times out leaves the request to prefill on the decode worker itself. A
pull that could not even be cancelled takes its blocks out of use for good instead of letting a late
write corrupt them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import Histogram

from runtime.histogram import histogram
from runtime.messages import GenerateRequest, KvAgentRecord, KvHandoff, KvRelease
from runtime.names import kv_release_topic

from ..engine.handoff import Receiving
from .kv_transfer import KvAgent, TransferFailed
from .step_loop import StepLoop

log = logging.getLogger(__name__)

EXPIRY_MARGIN = 2.0  # seconds a pull must leave before a handoff expires (clock skew between hosts)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass
class DisaggStats:
    """Counters of both roles (a worker fills the ones of its role)."""

    handoffs: int = 0  # prefill: prompts handed off
    released: int = 0  # prefill: handoffs a decode worker released
    remote_prefills: int = 0  # decode: prompts pulled from a prefill worker
    local_prefills: Counter = field(default_factory=Counter)  # decode: kv_transfer requests prefilled here, by why
    failures: Counter = field(default_factory=Counter)  # decode: pulls that failed, by kind
    transfer_bytes: int = 0
    reused_blocks: int = 0  # decode: handed-off blocks found in the local prefix cache, not pulled
    transfer_seconds: Histogram = field(default_factory=lambda: histogram(TRANSFER_BUCKETS))


async def release_handoff(publish: Callable[[str, object], Awaitable[None]], handoff: KvHandoff, ok: bool) -> None:
    """Tell the prefill worker holding ``handoff`` to free its blocks (``ok``: they were pulled).
    Best effort: if the message is lost, the handoff's ttl frees them."""
    try:
        await publish(kv_release_topic(handoff.worker_id), KvRelease([handoff.handoff_id], ok))
    except Exception as exc:
        log.debug("KV release to %s not sent: %r", handoff.worker_id, exc)


class HandoffKeeper:
    """Prefill side: frees handed-off blocks on :class:`KvRelease` and when their ttl runs out."""

    def __init__(self, loop: StepLoop, stats: DisaggStats, interval: float = 1.0):
        self.loop = loop
        self.stats = stats
        self.interval = interval
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._expire(), name="prefill-handoff-expiry")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def on_release(self, msg: KvRelease) -> None:
        ids = list(msg.handoff_ids)

        def release(engine) -> None:
            self.stats.released += engine.handoffs.release(ids)

        asyncio.ensure_future(self.loop.call(release))

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self.loop.engine.handoffs.parked:
                try:
                    await self.loop.call(lambda engine: engine.handoffs.expire())
                except Exception as exc:
                    log.warning("expiring handoffs failed: %r", exc)


class KvReceiver:
    """Decode side: admits requests whose prompt KV waits on a prefill worker, pulling it with NIXL."""

    def __init__(self, agent: KvAgent, records: Callable[[], list[KvAgentRecord]],
                 publish: Callable[[str, object], Awaitable[None]], stats: DisaggStats, timeout: float = 5.0):
        self.agent = agent
        self._records = records
        self._publish = publish
        self.stats = stats
        self.timeout = timeout
        self._pulls: set[asyncio.Task] = set()

    def record_of(self, instance_id: str) -> KvAgentRecord | None:
        for record in self._records():
            if record.instance_id == instance_id:
                return record
        return None

    async def admit(self, loop: StepLoop, rid: str, req: GenerateRequest, grammar) -> asyncio.Queue:
        """Queue ``req`` on ``loop`` with its prompt KV pulled from ``req.kv_transfer``'s prefill worker
        (or prefilled here when that cannot be done); returns the request's delta queue."""
        handoff = req.kv_transfer
        record = self.record_of(handoff.worker_id)
        why = "no_agent" if record is None else ("incompatible" if self.agent.incompatibility(record) else None)
        if why is None and self._time_left(handoff) < self.timeout / 2:
            why = "expired"  # its blocks may be freed (and reused) before a pull could end: do not read them
        if why is not None:
            if record is not None:
                log.warning("request %s: cannot pull KV from %s: %s", rid, handoff.worker_id,
                            self.agent.incompatibility(record))
            return await self._local(loop, rid, req, grammar, handoff, why)
        queue, receiving = await loop.receive(rid, list(req.token_ids), req.sampling, list(req.output_ids), handoff,
                                              req.num_speculative_tokens,
                                              (req.speculative_tree_topk, req.speculative_tree_depth), grammar)
        if receiving is None:  # no room for its blocks (it waits to prefill here), or it ended at once
            self.stats.local_prefills["no_room"] += 1
            await self._release(handoff, ok=False)
            return queue
        # the pull goes on if the client leaves meanwhile: the blocks are freed only once it ended
        task = asyncio.ensure_future(self._pull(loop, rid, record, receiving, handoff))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)
        await asyncio.shield(task)
        return queue

    async def _local(self, loop: StepLoop, rid: str, req: GenerateRequest, grammar, handoff: KvHandoff,
                     why: str) -> asyncio.Queue:
        self.stats.local_prefills[why] += 1
        await self._release(handoff, ok=False)
        return loop.submit(rid, list(req.token_ids), req.sampling, list(req.output_ids), req.num_speculative_tokens,
                           (req.speculative_tree_topk, req.speculative_tree_depth), grammar)

    async def _pull(self, loop: StepLoop, rid: str, record: KvAgentRecord, receiving: Receiving,
                    handoff: KvHandoff) -> None:
        ok, quarantine = True, False
        self.stats.reused_blocks += receiving.first_block
        if receiving.local:
            try:
                # the pull must end before the prefill worker may free the blocks: within its ttl, less a margin
                timeout = min(self.timeout, self._time_left(handoff))
                pulled = await self.agent.pull(record, receiving.local, receiving.remote, timeout)
                self.stats.transfer_bytes += pulled.bytes
                self.stats.transfer_seconds.observe(pulled.seconds)
                log.debug("request %s: pulled %d blocks (%d bytes, %d descriptors) from %s in %.2f ms", rid,
                          len(receiving.local), pulled.bytes, pulled.descriptors, handoff.worker_id,
                          1e3 * pulled.seconds)
            except TransferFailed as exc:
                ok, quarantine = False, not exc.cancelled
                self.stats.failures["timeout" if "timed out" in str(exc) else "error"] += 1
                log.warning("request %s: %s; prefilling it here", rid, exc)
            except Exception as exc:  # a bug: the request still must not be lost
                ok = False
                self.stats.failures["error"] += 1
                log.exception("request %s: KV pull failed (%r); prefilling it here", rid, exc)
        if ok:
            self.stats.remote_prefills += 1
        else:
            self.stats.local_prefills["pull_failed"] += 1
        await loop.call(lambda engine: engine.finish_receive(rid, ok, quarantine))
        await self._release(handoff, ok)

    @staticmethod
    def _time_left(handoff: KvHandoff) -> float:
        """Seconds a pull of ``handoff`` may still take: until it expires, less a margin for clock skew
        between the two hosts (EXPIRY_MARGIN)."""
        if not handoff.expires_at:
            return float("inf")
        return handoff.expires_at - time.time() - EXPIRY_MARGIN

    async def _release(self, handoff: KvHandoff, ok: bool) -> None:
        await release_handoff(self._publish, handoff, ok)

    async def stop(self) -> None:
        """Wait for pulls in flight (their blocks must not be freed under them)."""
        if self._pulls:
            await asyncio.gather(*self._pulls, return_exceptions=True)
