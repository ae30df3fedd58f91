"""Which draft worker a target streams to: :class:`DraftPool` keeps one healthy
:class:`~.draft_client.DraftClient` to a live draft worker, when there is one.

It picks a draft worker from discovery by rendezvous hashing (:func:`rendezvous_choice`) and opens
a new client when the old one broke or a draft worker (re)appears. A draft worker that failed is
retried after a backoff (2 s, doubling, at most 30 s; a refused one after 30 s). The target's step
loop never waits for a stream to open (:meth:`DraftPool.poll`).

Incarnation fencing: every draft registration carries an incarnation (``InstanceRecord.incarnation``,
the process's start; HelloAck says it too). The pool keeps the newest one known per worker id, from
discovery and from handshakes. A record of an older incarnation than known (an old process that
re-registered, or etcd's view held across a data loss) is no candidate; a stream to an older
incarnation is fenced (:meth:`~.draft_client.DraftClient.fence`: broken, and nothing that still
arrives on it applied) and a stream to the new one opened. The step loop takes every new stream as
one that knows none of its sequences (they are committed afresh), so nothing of the old incarnation's
per-sequence state reaches the new one. A newer incarnation also clears the worker id's retry backoff:
it is another process. Counted: :attr:`DraftPool.streams_fenced`, :meth:`DraftPool.proposals_fenced`.
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
        self._incarnations: dict[str, int] = {}  # draft id -> the newest incarnation known of it
        self.streams_fenced = 0  # streams dropped because a newer incarnation of their draft worker appeared
        self._closed_fenced = 0  # proposals of closed clients dropped as an older incarnation's

    def hidden_bytes(self) -> dict[str, int]:
        """Hidden-state bytes sent to draft workers so far, by plane (every client, closed or current)."""
        out = dict(self._closed_bytes)
        if self.client is not None:
            for plane, n in self.client.hidden_bytes_by_plane().items():
                out[plane] = out.get(plane, 0) + n
        return out

    def proposals_fenced(self) -> int:
        """Proposals that came from an older incarnation of their draft worker once a newer one was
        known, and were dropped (every client, closed or current)."""
        return self._closed_fenced + (self.client.fenced if self.client is not None else 0)

    async def _close(self, client: DraftClient) -> None:
        await client.close()
        for plane, n in client.hidden_bytes_by_plane().items():
            self._closed_bytes[plane] = self._closed_bytes.get(plane, 0) + n
        self._closed_fenced += client.fenced
        client.fenced = 0

    def _live(self) -> list[InstanceRecord]:
        """The registered draft workers, learning their incarnations: a newer one than known clears
        that worker id's retry backoff (another process), and fences a stream to an older one."""
        live = self._instances()
        for r in live:
            self._learn(r.instance_id, r.incarnation)
        return live

    def _learn(self, draft_id: str, incarnation: int) -> None:
        known = self._incarnations.get(draft_id, 0)
        if incarnation <= known:
            return
        self._incarnations[draft_id] = incarnation
        if known:
            log.info("draft worker %s restarted (incarnation %d, was %d)", draft_id, incarnation, known)
            self._failed.pop(draft_id, None)
        self._fence_stale()

    def _stale(self, draft_id: str, incarnation: int) -> bool:
        """``incarnation`` of ``draft_id`` is older than one known (0, an incarnation not said, never is)."""
        return bool(incarnation) and incarnation < self._incarnations.get(draft_id, 0)

    def _fence_stale(self) -> None:
        """Fence the current stream if it is to an older incarnation than known (it is then broken:
        the next :meth:`get` replaces it, not counting it a failure of the worker)."""
        client = self.client
        if client is not None and not client.broken and self._stale(client.draft_id, client.incarnation):
            self.streams_fenced += 1
            client.fence(self._incarnations[client.draft_id])

    def _preferred(self, candidates: list[InstanceRecord]) -> InstanceRecord:
        """The rendezvous choice among ``candidates`` (hashed once per set of candidates: the step loop
        asks before every step)."""
        ids = tuple(r.instance_id for r in candidates)
        if ids != self._preferred_of:
            self._preferred_of, self._preferred_id = ids, rendezvous_choice(self._target_id, candidates).instance_id
        return next(r for r in candidates if r.instance_id == self._preferred_id)

    def _candidates(self) -> list[InstanceRecord]:
        now = asyncio.get_running_loop().time()
        live = self._live()
        registered = {r.instance_id for r in live}
        for draft_id in [d for d in self._failed if d not in registered]:
            del self._failed[draft_id]
        return [r for r in live if r.grpc_address and now >= self._failed.get(r.instance_id, (0.0, 0))[0]
                and (not r.model or r.model == self._model) and not self._stale(r.instance_id, r.incarnation)]

    def _mark_failed(self, draft_id: str) -> float:
        """Record a failure; returns the seconds until the draft worker is tried again."""
        failures = self._failed.get(draft_id, (0.0, 0))[1] + 1
        wait = backoff_delay(failures - 1, RETRY_BASE_S, RETRY_MAX_S)
        self._failed[draft_id] = (asyncio.get_running_loop().time() + wait, failures)
        return wait

    async def prune(self) -> None:
        """Close the stream to a draft worker that deregistered (e.g. while this target is idle)."""
        live = {r.instance_id for r in self._live()}  # (fences a stream to an older incarnation)
        client = self.client
        if client is not None and (client.draft_id not in live or self._stale(client.draft_id, client.incarnation)):
            client._break("deregistered")
            if self.client is client:
                self.client = None
            await self._close(client)

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
                if not self._stale(current.draft_id, current.incarnation):  # (a restarted worker did not fail)
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
            if exc.label in ("draft_id", "incarnation"):  # another process than the record says: the record lags
                wait = self._mark_failed(choice.instance_id)
                log.warning("%s (trying again in %.0f s)", exc, wait)
                await client.close()
                return current
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
        self._learn(choice.instance_id, client.incarnation)  # (a handshake may know a newer one than discovery)
        if self._stale(choice.instance_id, client.incarnation):  # a newer one appeared while it connected
            await self._close(client)
            return current
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
