"""Which draft worker a target streams to: :class:`DraftPool` keeps one healthy
:class:`~.draft_client.DraftClient` to a live draft worker, when there is one.

It picks a draft worker from discovery by rendezvous hashing (:func:`rendezvous_choice`) and opens
a new client when the old one broke or a draft worker (re)appears. A draft worker that failed is
retried after a backoff (2 s, doubling, at most 30 s; a refused one after 30 s). The target's step
loop never waits for a stream to open (:meth:`DraftPool.poll`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

from runtime.backoff import backoff_delay
from runtime.messages import InstanceRecord
from runtime.tls import ClientTls

from ..speculation.hidden_plane import PlaneOffer
from .draft_client import DraftClient, IncompatibleDraft

log = logging.getLogger(__name__)

RETRY_BASE_S = 2.0  # a draft worker that failed is skipped this long, doubling per failure in a row
RETRY_MAX_S = 30.0


def rendezvous_choice(target_id: str, candidates: list[InstanceRecord]) -> InstanceRecord:
    """Rendezvous hashing: every target ranks the drafts by hash(target, draft) and takes the top one.
    Targets spread evenly over drafts, and a new draft takes over ~1/M of the targets at once (the
    others keep their streams)."""
    def weight(r: InstanceRecord) -> int:
        digest = hashlib.blake2b(f"{target_id}/{r.instance_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    return max(candidates, key=weight)


class DraftPool:
    """Keeps one healthy :class:`DraftClient` to some live draft worker, when there is one."""

    def __init__(self, target_id: str, model: str, vocab_size: int,
                 instances: Callable[[], list[InstanceRecord]], hidden_layers=(), tls: ClientTls | None = None,
                 pipelined: bool = False, plane: PlaneOffer | None = None, lanes: bool = True):
        self._target_id = target_id
        self._lanes = lanes  # offer drafts a fast lane
        self._preferred_of: tuple[str, ...] = ()  # the candidates _preferred last chose among, and its choice
        self._preferred_id = ""
        self._plane = plane  # hidden-state planes offered to drafts (None: inline Tensors only)
        self._pipelined = pipelined  # ask drafts for the pipelined seam
        self._tls = tls
        self._model = model
        self._vocab = vocab_size
        self._instances = instances
        self._hidden_layers = list(hidden_layers)
        self.client: DraftClient | None = None
        self._failed: dict[str, tuple[float, int]] = {}  # draft id -> (when it may be tried again, failures in a row)
        self._connecting: asyncio.Task | None = None  # a background get() started by poll()
        self.refused: dict[str, int] = {}  # drafts refused at the handshake, by reason
        self._closed_bytes: dict[str, int] = {}  # hidden-state bytes of closed clients, by plane

    def hidden_bytes(self) -> dict[str, int]:
        """Hidden-state bytes sent to draft workers so far, by plane (every client, closed or current)."""
        out = dict(self._closed_bytes)
        if self.client is not None:
            for plane, n in self.client.hidden_bytes_by_plane().items():
                out[plane] = out.get(plane, 0) + n
        return out

    async def _close(self, client: DraftClient) -> None:
        await client.close()
        for plane, n in client.hidden_bytes_by_plane().items():
            self._closed_bytes[plane] = self._closed_bytes.get(plane, 0) + n

    def _preferred(self, candidates: list[InstanceRecord]) -> InstanceRecord:
        """The rendezvous choice among ``candidates`` (hashed once per set of candidates: the step loop
        asks before every step)."""
        ids = tuple(r.instance_id for r in candidates)
        if ids != self._preferred_of:
            self._preferred_of, self._preferred_id = ids, rendezvous_choice(self._target_id, candidates).instance_id
        return next(r for r in candidates if r.instance_id == self._preferred_id)

    def _candidates(self) -> list[InstanceRecord]:
        now = asyncio.get_running_loop().time()
        live = self._instances()
        registered = {r.instance_id for r in live}
        for draft_id in [d for d in self._failed if d not in registered]:
            del self._failed[draft_id]
        return [r for r in live if r.grpc_address and now >= self._failed.get(r.instance_id, (0.0, 0))[0]
                and (not r.model or r.model == self._model)]

    def _mark_failed(self, draft_id: str) -> float:
        """Record a failure; returns the seconds until the draft worker is tried again."""
        failures = self._failed.get(draft_id, (0.0, 0))[1] + 1
        wait = backoff_delay(failures - 1, RETRY_BASE_S, RETRY_MAX_S)
        self._failed[draft_id] = (asyncio.get_running_loop().time() + wait, failures)
        return wait

    async def prune(self) -> None:
        """Close the stream to a draft worker that deregistered (e.g. while this target is idle)."""
        if self.client is not None and self.client.draft_id not in {r.instance_id for r in self._instances()}:
            self.client._break("deregistered")
            await self._close(self.client)
            self.client = None

    def _keeps(self, current: DraftClient, candidates: list[InstanceRecord]) -> bool:
        """Whether ``current`` is healthy, registered and still the preferred draft worker."""
        if current.broken:
            return False
        if candidates:  # (the preferred one is registered: candidates are)
            return self._preferred(candidates).instance_id == current.draft_id
        return current.draft_id in {r.instance_id for r in self._instances()}

    async def get(self) -> DraftClient | None:
        """A connected client to the preferred live draft worker; None without draft workers.

        Waits while a stream is opened; a healthy current stream is kept until the new one is up."""
        candidates = self._candidates()
        current = self.client
        if current is not None:
            if self._keeps(current, candidates):
                return current
            live = current.draft_id in {r.instance_id for r in self._instances()}
            if current.broken or not live:
                self._mark_failed(current.draft_id)
                current._break("deregistered" if not live else "stream broken")
                await self._close(current)
                self.client = current = None
                candidates = self._candidates()
        if not candidates:
            return None
        choice = self._preferred(candidates)
        client = DraftClient(self._target_id, self._model, self._vocab, choice, self._hidden_layers, self._tls,
                             self._pipelined, self._plane, self._lanes)
        try:
            await client.connect()
        except IncompatibleDraft as exc:
            self.refused[exc.label] = self.refused.get(exc.label, 0) + 1
            self._failed[choice.instance_id] = (asyncio.get_running_loop().time() + RETRY_MAX_S, 99)  # the longest backoff
            log.error("%s; not speculating with it (trying again in %.0f s)", exc, RETRY_MAX_S)
            await client.close()
            return current
        except Exception as exc:
            wait = self._mark_failed(choice.instance_id)
            log.warning("could not open a stream to draft worker %s (trying again in %.0f s): %r",
                        choice.instance_id, wait, exc)
            await client.close()
            return current
        self._failed.pop(choice.instance_id, None)
        if current is not None:
            log.info("moving from draft worker %s to the newly preferred %s", current.draft_id, choice.instance_id)
            await self._close(current)
        self.client = client
        return client

    async def poll(self) -> DraftClient | None:
        """The client to use now, without waiting: for the target's step loop, which must not stall
        while a stream is opened (an unreachable draft worker takes up to the connect timeout).

        Returns the current healthy client (or None) and, when the choice needs revisiting, runs
        :meth:`get` in the background; a later call picks up what it opened."""
        current = self.client
        task = self._connecting
        if task is None or task.done():
            self._connecting = None
            if task is not None and not task.cancelled() and task.exception() is not None:
                log.warning("choosing a draft worker failed: %r", task.exception())
            candidates = self._candidates()
            if current is not None and self._keeps(current, candidates):
                return current
            if current is None and not candidates:
                return None
            self._connecting = asyncio.create_task(self.get(), name="draft-connect")
        return current if current is not None and not current.broken else None

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
            self._connecting = None
        if self.client is not None:
            await self._close(self.client)
            self.client = None
