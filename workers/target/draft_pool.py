"""Which draft workers a target streams to: :class:`DraftPool` keeps healthy
:class:`~.draft_client.DraftClient` streams to up to ``streams`` live draft workers of its model.

It ranks the draft workers from discovery by rendezvous hashing (:func:`rendezvous_rank`): each
target keeps streams to its top ``streams`` of them, so targets spread evenly over drafts and a new
draft takes over ~1/M of the targets' streams at once. The first healthy stream in that order is
the *primary* (:attr:`DraftPool.client`, :meth:`DraftPool.poll`); the step loop places each
sequence on one of the healthy streams (:meth:`DraftPool.streams`, :mod:`.placement`), so a draft's
death or backoff affects only its sequences, which move to another. A stream that broke is
replaced; a draft worker that failed is retried after a backoff (2 s, doubling, at most 30 s; a
refused one after 30 s). The target's step loop never waits for a stream to open.

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
REVISE_EVERY_S = 0.05  # the step loop's streams() looks at discovery again at most this often (at once
# when a stream it was given broke, or while one opens)


def rendezvous_rank(target_id: str, candidates: list[InstanceRecord]) -> list[InstanceRecord]:
    """Rendezvous hashing: every target ranks the drafts by hash(target, draft), best first. Targets
    spread evenly over drafts, and a new draft takes over ~1/M of the targets at once (the others
    keep their streams)."""
    def weight(r: InstanceRecord) -> int:
        digest = hashlib.blake2b(f"{target_id}/{r.instance_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    return sorted(candidates, key=weight, reverse=True)


def rendezvous_choice(target_id: str, candidates: list[InstanceRecord]) -> InstanceRecord:
    """The draft a target ranks first (:func:`rendezvous_rank`)."""
    return rendezvous_rank(target_id, candidates)[0]


class DraftPool:
    """Keeps healthy :class:`DraftClient` streams to up to ``streams`` live draft workers."""

    def __init__(self, target_id: str, model: str, vocab_size: int,
                 instances: Callable[[], list[InstanceRecord]], hidden_layers=(), tls: ClientTls | None = None,
                 pipelined: bool = False, plane: PlaneOffer | None = None, lanes: bool = True, streams: int = 1):
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self._target_id = target_id
        self.max_streams = streams
        self._lanes = lanes  # offer drafts a fast lane
        self._ranked_of: tuple[str, ...] = ()  # the candidates _wanted last ranked, and its ranking
        self._ranked: list[str] = []
        self._plane = plane  # hidden-state planes offered to drafts (None: inline Tensors only)
        self._pipelined = pipelined  # ask drafts for the pipelined seam
        self._tls = tls
        self._model = model
        self._vocab = vocab_size
        self._instances = instances
        self._hidden_layers = list(hidden_layers)
        self.clients: dict[str, DraftClient] = {}  # draft id -> its stream, in rank order when opened
        self._failed: dict[str, tuple[float, int]] = {}  # draft id -> (when it may be tried again, failures in a row)
        self._connecting: dict[str, asyncio.Task] = {}  # draft id -> a background open started by poll()
        self._closing: set[asyncio.Task] = set()
        self._retired: set[DraftClient] = set()  # streams let go of and still closing
        self.refused: dict[str, int] = {}  # drafts refused at the handshake, by reason
        self._closed_bytes: dict[str, int] = {}  # hidden-state bytes of closed clients, by plane
        self._incarnations: dict[str, int] = {}  # draft id -> the newest incarnation known of it
        self.streams_fenced = 0  # streams dropped because a newer incarnation of their draft worker appeared
        self._given: list[DraftClient] | None = None  # what streams() gave last, and until when it holds
        self._given_until = 0.0
        self._closed_fenced = 0  # proposals of closed clients dropped as an older incarnation's

    @property
    def client(self) -> DraftClient | None:
        """The primary stream: the healthy one to the best-ranked draft worker (None: none)."""
        healthy = self._healthy()
        return healthy[0] if healthy else None

    def _healthy(self) -> list[DraftClient]:
        """The healthy streams, best-ranked draft worker first."""
        order = {draft_id: i for i, draft_id in enumerate(self._ranked)}
        return sorted((c for c in self.clients.values() if not c.broken),
                      key=lambda c: order.get(c.draft_id, len(order)))

    def hidden_bytes(self) -> dict[str, int]:
        """Hidden-state bytes sent to draft workers so far, by plane (every client, closed or current)."""
        out = dict(self._closed_bytes)
        for client in [*self.clients.values(), *self._retired]:
            for plane, n in client.hidden_bytes_by_plane().items():
                out[plane] = out.get(plane, 0) + n
        return out

    def proposals_fenced(self) -> int:
        """Proposals that came from an older incarnation of their draft worker once a newer one was
        known, and were dropped (every client, closed or current)."""
        return self._closed_fenced + sum(c.fenced for c in [*self.clients.values(), *self._retired])

    async def _close(self, client: DraftClient) -> None:
        await client.close()
        for plane, n in client.hidden_bytes_by_plane().items():
            self._closed_bytes[plane] = self._closed_bytes.get(plane, 0) + n
        self._closed_fenced += client.fenced
        client.fenced = 0
        self._retired.discard(client)

    def _drop(self, client: DraftClient, reason: str) -> None:
        """Let go of a stream now (its close runs in the background: the step loop never waits)."""
        if self.clients.get(client.draft_id) is client:
            del self.clients[client.draft_id]
            self._given = None
        client._break(reason, quiet=reason in ("no longer preferred", "replaced"))
        self._retired.add(client)
        task = asyncio.create_task(self._close(client), name="draft-close")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

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
        """Fence every stream to an older incarnation than known (it is then broken: the next
        :meth:`poll` replaces it, not counting it a failure of the worker)."""
        for client in self.clients.values():
            if not client.broken and self._stale(client.draft_id, client.incarnation):
                self.streams_fenced += 1
                client.fence(self._incarnations[client.draft_id])

    def _candidates(self) -> list[InstanceRecord]:
        now = asyncio.get_running_loop().time()
        live = self._live()
        registered = {r.instance_id for r in live}
        for draft_id in [d for d in self._failed if d not in registered]:
            del self._failed[draft_id]
        return [r for r in live if r.grpc_address and now >= self._failed.get(r.instance_id, (0.0, 0))[0]
                and (not r.model or r.model == self._model) and not self._stale(r.instance_id, r.incarnation)]

    def _wanted(self, candidates: list[InstanceRecord]) -> list[InstanceRecord]:
        """The top ``streams`` candidates by rank (ranked once per set of candidates: the step loop
        asks before every step)."""
        ids = tuple(r.instance_id for r in candidates)
        if ids != self._ranked_of:
            self._ranked_of, self._ranked = ids, [r.instance_id for r in rendezvous_rank(self._target_id, candidates)]
        by_id = {r.instance_id: r for r in candidates}
        return [by_id[d] for d in self._ranked[: self.max_streams]]

    def _mark_failed(self, draft_id: str) -> float:
        """Record a failure; returns the seconds until the draft worker is tried again."""
        failures = self._failed.get(draft_id, (0.0, 0))[1] + 1
        wait = backoff_delay(failures - 1, RETRY_BASE_S, RETRY_MAX_S)
        self._failed[draft_id] = (asyncio.get_running_loop().time() + wait, failures)
        return wait

    def _revise(self) -> list[InstanceRecord]:
        """Drop the streams that broke, to drafts that deregistered or that are no longer wanted (a
        better-ranked draft appeared and its stream is up); the draft workers to open streams to."""
        candidates = self._candidates()
        registered = {r.instance_id for r in self._instances()}
        wanted = self._wanted(candidates)
        wanted_ids = {r.instance_id for r in wanted}
        for client in list(self.clients.values()):
            live = client.draft_id in registered
            if client.broken or not live:
                if client.broken and not self._stale(client.draft_id, client.incarnation):
                    self._mark_failed(client.draft_id)  # (a restarted worker did not fail)
                self._drop(client, "deregistered" if not live else "stream broken")
            elif client.draft_id not in wanted_ids and candidates and self._covered(wanted):
                log.info("moving from draft worker %s to the newly preferred %s", client.draft_id,
                         ", ".join(r.instance_id for r in wanted if r.instance_id not in self.clients))
                self._drop(client, "no longer preferred")
        return [r for r in wanted if r.instance_id not in self.clients]

    def _covered(self, wanted: list[InstanceRecord]) -> bool:
        """Whether the wanted draft workers' streams are up (a stream kept past its rank stays until then)."""
        return all(r.instance_id in self.clients for r in wanted)

    async def prune(self) -> None:
        """Close the streams to draft workers that deregistered (e.g. while this target is idle)."""
        live = {r.instance_id for r in self._live()}  # (fences a stream to an older incarnation)
        for client in list(self.clients.values()):
            if client.draft_id not in live or self._stale(client.draft_id, client.incarnation):
                if self.clients.get(client.draft_id) is client:
                    del self.clients[client.draft_id]
                    self._given = None
                client._break("deregistered")
                await self._close(client)

    async def _open(self, choice: InstanceRecord) -> DraftClient | None:
        """A connected stream to ``choice``, kept in :attr:`clients`; None when it could not be opened."""
        client = DraftClient(self._target_id, self._model, self._vocab, choice, self._hidden_layers, self._tls,
                             self._pipelined, self._plane, self._lanes)
        try:
            await client.connect()
        except IncompatibleDraft as exc:
            self.refused[exc.label] = self.refused.get(exc.label, 0) + 1
            if exc.label in ("draft_id", "incarnation"):  # another process than the record says: the record lags
                wait = self._mark_failed(choice.instance_id)
                log.warning("%s (trying again in %.0f s)", exc, wait)
            else:
                self._failed[choice.instance_id] = (asyncio.get_running_loop().time() + RETRY_MAX_S, 99)  # the longest
                log.error("%s; not speculating with it (trying again in %.0f s)", exc, RETRY_MAX_S)
            await client.close()
            return None
        except Exception as exc:
            wait = self._mark_failed(choice.instance_id)
            log.warning("could not open a stream to draft worker %s (trying again in %.0f s): %r",
                        choice.instance_id, wait, exc)
            await client.close()
            return None
        self._failed.pop(choice.instance_id, None)
        self._learn(choice.instance_id, client.incarnation)  # (a handshake may know a newer one than discovery)
        old = self.clients.get(choice.instance_id)
        if self._stale(choice.instance_id, client.incarnation) or (old is not None and not old.broken):
            await self._close(client)  # a newer one appeared while it connected, or a stream is there already
            return None
        if old is not None:
            self._drop(old, "replaced")
        self.clients[choice.instance_id] = client
        self._given = None
        return client

    async def get(self) -> DraftClient | None:
        """The primary stream, opening the wanted ones first (waits while they open); None without
        draft workers. A healthy stream is kept until the one that replaces it is up."""
        for choice in self._revise():
            task = self._connecting.pop(choice.instance_id, None)
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
                if choice.instance_id in self.clients:
                    continue
            await self._open(choice)
        self._revise()  # a stream now up may make another unwanted
        return self.client

    async def streams(self) -> list[DraftClient]:
        """The healthy streams to use now, primary first, without waiting: for the target's step loop,
        which must not stall while a stream is opened (an unreachable draft worker takes up to the
        connect timeout). Streams the pool wants and lacks are opened in the background; a later call
        picks them up. The step loop asks before every step: between looks at discovery (at most every
        ``REVISE_EVERY_S``) the same healthy streams are given again, as long as none of them broke
        and no stream is opening."""
        now = asyncio.get_running_loop().time()
        given = self._given
        if given is not None and now < self._given_until and not self._connecting and not any(c.broken for c in given):
            return given
        for draft_id, task in list(self._connecting.items()):
            if task.done():
                del self._connecting[draft_id]
                if not task.cancelled() and task.exception() is not None:
                    log.warning("opening a draft stream failed: %r", task.exception())
        for choice in self._revise():
            if choice.instance_id not in self._connecting:
                self._connecting[choice.instance_id] = asyncio.create_task(self._open(choice), name="draft-connect")
        self._given, self._given_until = self._healthy(), now + REVISE_EVERY_S
        return self._given

    async def poll(self) -> DraftClient | None:
        """The primary stream to use now, without waiting (see :meth:`streams`)."""
        healthy = await self.streams()
        return healthy[0] if healthy else None

    async def close(self) -> None:
        tasks = list(self._connecting.values())
        self._connecting.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in list(self.clients.values()):
            await self._close(client)
        self.clients.clear()
        self._given = None
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
