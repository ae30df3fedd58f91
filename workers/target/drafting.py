"""The target step loop's side of speculation: its draft streams, what each cycle takes from them and
sends them, and how each is judged.

:class:`Drafting` is owned by :class:`.step_loop.StepLoop`. On the event loop it takes the streams to
use from the :class:`.draft_pool.DraftPool` without waiting (:meth:`Drafting.contexts`, primary first),
collects their proposals before a step (:meth:`Drafting.collect`: every stream's round waited for
together on the synchronous seam, streamed ones taken on the pipelined seam), sends each stream its
share of the step's news after it (:meth:`Drafting.talk`) and judges each stream by its own
:class:`.draft_watch.DraftWatch` (:meth:`Drafting.observe`: the primary's is :attr:`Drafting.watch`).
On the engine's thread it keeps each sequence's placement on a stream in step (:mod:`.placement`),
hands the engine only proposals from the stream a sequence is placed on (:meth:`Drafting.proposals`)
and builds each stream's news (:meth:`Drafting.messages`).
"""

from __future__ import annotations

import asyncio
import copy
import logging

from ..engine.engine import Engine
from ..speculation.convert import DTYPES, draft_input_to_pb, verify_to_pb
from ..speculation.payloads import DraftOutput
from ..speculation.staging import StagedUse
from .commands import NO_USE, Cycle, DraftContext, StreamNews
from .draft_client import DraftClient
from .draft_pool import DraftPool
from .draft_watch import DraftWatch
from .placement import Placement
from .seam import Proposals

log = logging.getLogger(__name__)

FLUSH_TIMEOUT = 0.005  # pipelined: the most a step waits for the draft stream's writes (normally ~0.1 ms)


def _counts(spec, draft_id: str) -> tuple[int, int, int, int, int]:
    """A draft's malformed proposals and staged use so far: (bad, looked, found, arrived, late)."""
    use = spec.staged_by.get(draft_id, NO_USE)
    return spec.bad_by.get(draft_id, 0), use.looked, use.found, use.arrived, use.late


class Drafting:
    """A target's draft streams as its step loop uses them."""

    def __init__(self, engine: Engine, pool: DraftPool | None, watch: DraftWatch):
        self.engine = engine
        self.pool = pool
        self.watch = watch  # the primary stream's judge; every other stream gets one like it (watch_of)
        self._clients: list[DraftClient] = []  # the streams the latest news went to (their seams hold the round)
        self._contexts: tuple[DraftContext, ...] = ()  # what contexts() gave for them, and whether each asked
        self._asks: tuple[bool, ...] = ()
        self._synced: tuple[DraftContext, ...] | None = None  # the contexts placement last followed
        self._streams: tuple[int, ...] = ()  # their serials, primary first
        self._watches: dict[int, DraftWatch] = {}  # per stream but the primary's
        self.methods: dict[str, str] = {}  # draft id -> its method, for the spec-decode statistics
        self.placement = Placement()  # which stream each sequence speculates with (the engine's thread's)
        self.wait_seconds = 0.0  # time spent waiting for rounds of proposals (pipelined: none)
        self.flush_seconds = 0.0  # pipelined: time handing each step's news to the streams
        self.proposals_dropped = 0

    @property
    def streams(self) -> int:
        """Draft streams in use."""
        return len(self._clients)

    def sequences_by_draft(self) -> dict[str, int]:
        """Sequences placed on each draft worker (a gauge; read off the engine's thread, so approximate)."""
        spec = self.engine.spec
        out: dict[str, int] = {}
        for st in list(spec.states.values()):
            if st.num_speculative_tokens > 0 and (draft := spec.draft_of(st)):
                out[draft] = out.get(draft, 0) + 1
        return out

    async def hand_over(self) -> None:
        """One turn of the event loop, before the deliveries wake anything: the streams' writers take
        this step's news (gRPC starts writing it as it takes it). Otherwise it would wait behind every
        request handler the deliveries wake, or, once the next step's thread holds the interpreter, a
        switch interval; the flush before the next step then finds nothing left to wait for."""
        handed = asyncio.get_running_loop().time()
        await asyncio.sleep(0)
        self.flush_seconds += asyncio.get_running_loop().time() - handed

    def counts(self, contexts: tuple[DraftContext, ...]) -> tuple[int, list[tuple[int, int, int, int, int]]]:
        """Per stream, its draft's malformed proposals and staged use so far (engine's thread): a cycle's
        share is what :meth:`shares` finds after the step, less these (plain ints)."""
        spec = self.engine.spec
        return spec.seen, [_counts(spec, c.draft_id) for c in contexts]

    def shares(self, contexts: tuple[DraftContext, ...], before: tuple[int, list[tuple[int, int, int, int, int]]] | None
               ) -> dict[int, StreamNews]:
        """Per stream, what this cycle's step saw of its proposals (its news follows: :meth:`messages`);
        ``before``: :meth:`counts` before the step (None: it had none to see)."""
        spec = self.engine.spec
        if before is None or spec.seen == before[0]:  # it saw no proposal of any stream (a declined step: the usual one)
            return {c.stream: StreamNews() for c in contexts}
        counts = before[1]
        out = {}
        for c, (bad, looked, found, arrived, late) in zip(contexts, counts):
            now = _counts(spec, c.draft_id)
            staged = NO_USE if now[1:] == (looked, found, arrived, late) else StagedUse(
                now[1] - looked, now[2] - found, now[3] - arrived, now[4] - late)
            out[c.stream] = StreamNews(dropped=now[0] - bad, staged=staged)
        return out

    def converted(self, requests: list, dtype: str, what: str) -> list:
        """``requests`` (DraftInput) for the wire; one that cannot be converted is not sent, and the
        draft hears of its sequence from scratch next time."""
        converted = []
        for request in requests:
            try:
                converted.append(draft_input_to_pb(request, dtype))
            except Exception as exc:
                log.warning("request %s: %s not sent to the draft (%r)", request.seq_id, what, exc)
                self.engine.spec.forget_told(request.seq_id)
        return converted

    def follow(self, contexts: tuple[DraftContext, ...]) -> None:
        """Keep the placement of sequences in step with this cycle's streams (:meth:`.placement.Placement.sync`)."""
        self.placement.sync(self.engine.spec, contexts)
        self._synced = contexts

    def unchanged(self, contexts: tuple[DraftContext, ...], proposals: dict[int, Proposals]) -> bool:
        """One stream, the very one placement followed last cycle (:meth:`contexts` reuses them), and
        it brought nothing: a quiet round has no placement or proposals to look at."""
        if contexts is not self._synced or len(contexts) != 1:
            return False
        got = proposals.get(contexts[0].stream)
        return got is None or not (got.answers or got.streamed)

    def quiet_round(self, contexts: tuple[DraftContext, ...]) -> bool:
        """Whether a quiet round goes on (the engine's speculator takes it): the draft has nothing to
        hear this cycle, having verified nothing, released nothing and been asked nothing."""
        spec = self.engine.spec
        return contexts[0].ask and not spec.released and spec.quiet_round(self.engine.scheduler.running)

    def proposals(self, proposals: dict[int, Proposals], contexts: tuple[DraftContext, ...]
                   ) -> tuple[dict[str, DraftOutput], list[DraftOutput]]:
        """The answers and streamed proposals of the streams in use, each only for the sequences placed
        on its draft (a sequence that moved, or a stream that ended, leaves nothing behind)."""
        if len(contexts) == 1:  # (the usual target: one stream, every sequence's draft)
            got = proposals.get(contexts[0].stream)
            return (got.answers, got.streamed) if got is not None else ({}, [])
        states, spec = self.engine.spec.states, self.engine.spec
        answers: dict[str, DraftOutput] = {}
        streamed: list[DraftOutput] = []
        for c in contexts:
            got = proposals.get(c.stream)
            if got is None:
                continue
            mine = (lambda sid: (st := states.get(sid)) is not None and spec.draft_of(st) == c.draft_id)
            answers.update((sid, p) for sid, p in got.answers.items() if mine(sid))
            streamed.extend(p for p in got.streamed if mine(p.seq_id))
        return answers, streamed

    def prompt_news(self, added: list, contexts: tuple[DraftContext, ...]) -> None:
        """New requests' prompts to their drafts before their prefill step, where the stream takes them
        early (see :meth:`Engine.prompt_inputs`)."""
        engine = self.engine
        self.placement.place(engine.spec, (seq.request_id for seq in added), contexts)
        for c in contexts:
            if not c.ask or c.early is None:
                continue
            mine = added if len(contexts) == 1 else [
                seq for seq in added if (st := engine.spec.states.get(seq.request_id)) is not None
                and engine.spec.draft_of(st) == c.draft_id]
            converted = self.converted(engine.prompt_inputs(mine), c.dtype, "prompt") if mine else []
            if not converted:
                continue
            try:
                c.early(converted)
            except Exception as exc:  # (the event loop closing): they hear of these after the prefill instead
                log.warning("prompts not sent to the draft (%r)", exc)
                for request in converted:
                    engine.spec.forget_told(request.seq_id)

    def messages(self, out: Cycle, contexts: tuple[DraftContext, ...]) -> None:
        """Per stream: verdicts, released sequences and the next round's requests, converted for the wire."""
        engine = self.engine
        if len(contexts) == 1:  # every sequence speculates with the one stream (every step: kept lean)
            c = contexts[0]
            news = out.news[c.stream]
            verdicts, news.released, requests = engine.draft_news(c.layers, DTYPES.get(c.dtype), c.plane, c.ask)
            if verdicts:
                self._verdicts(news, verdicts, c.dtype)
            if requests:
                news.requests = self.converted(requests, c.dtype, "proposal request")
            return
        spec, running = engine.spec, engine.scheduler.running
        self.placement.place(spec, (seq.request_id for seq in running), contexts)
        groups = {c.draft_id: (c.layers, DTYPES.get(c.dtype), c.plane) for c in contexts}
        asking = {d: g for d, g in groups.items() if any(c.ask for c in contexts if c.draft_id == d)}
        verdicts, released, requests = engine.draft_news_by(groups, asking)
        if not asking:
            spec.unasked(running, "draft_backoff")
        for c in contexts:
            news = out.news[c.stream]
            self._verdicts(news, verdicts.get(c.draft_id, ()), c.dtype)
            news.released = released.get(c.draft_id, [])
            news.requests = self.converted(requests.get(c.draft_id, []), c.dtype, "proposal request")

    def _verdicts(self, news: StreamNews, verdicts, dtype: str) -> None:
        if not verdicts:
            return
        news.verdicts = []
        for verdict in verdicts:
            try:
                news.verdicts.append(verify_to_pb(verdict, dtype))
            except Exception as exc:  # the draft's view of this sequence is lost: start it afresh
                log.warning("request %s: verdict not sent (%r); the draft starts it again", verdict.seq_id, exc)
                self.engine.spec.forget_told(verdict.seq_id)

    async def contexts(self) -> tuple[DraftContext, ...]:
        """The draft streams to use this cycle, primary first (none: decode plainly), from the pool
        without waiting."""
        if self.pool is None:
            return ()
        try:
            clients = await self.pool.streams()
        except Exception as exc:
            log.warning("choosing draft workers failed: %r", exc)
            clients = []
        asks = tuple(self.watch_of(c.serial).allowed() for c in clients)
        if clients is self._clients and asks == self._asks:  # the same streams as last cycle (the usual one)
            return self._contexts
        serials = tuple(c.serial for c in clients)
        if serials != self._streams:
            known = set(self._streams)
            for client in clients:
                if client.serial not in known:
                    self.methods[client.draft_id] = client.method
                    log.info("speculating with draft worker %s (%s, incarnation %d)", client.draft_id, client.method,
                             client.incarnation)
            if not clients and self._streams:
                log.warning("no draft worker reachable: plain decoding until one appears")
            if not clients or (self._streams and serials[0] != self._streams[0]):
                self.watch.reset()  # a different primary draft (or none)
            self._watches = {s: self._watches.get(s) or self._new_watch() for s in serials[1:]}
            self._streams = serials
            asks = tuple(self.watch_of(c.serial).allowed() for c in clients)  # (a primary's watch starts afresh)
        self._clients, self._asks = clients, asks
        self._contexts = tuple(DraftContext(c.draft_id, tuple(c.hidden_layers), c.hidden_dtype, ask, c.seam.pipelined,
                                            c.seam.plane, c.seam.send_prompts if c.seam.prompts_early else None,
                                            c.serial, c.method, c.lora) for c, ask in zip(clients, asks))
        return self._contexts

    def watch_of(self, serial: int) -> DraftWatch:
        """The watch judging a stream: ``watch`` for the primary, one of its own for each other."""
        return self._watches.get(serial, self.watch)

    def _new_watch(self) -> DraftWatch:
        watch = copy.copy(self.watch)  # the primary's settings, none of its state
        watch.reset()
        watch.step_seconds = None
        watch.rounds = watch.late_rounds = watch.bad_rounds = watch.backoffs_total = 0
        return watch

    async def collect(self) -> dict[int, Proposals]:
        """Per stream serial, its proposals for this step (see :mod:`.seam`); the streams' rounds are
        waited for together."""
        clients = self._clients
        if not clients:
            return {}
        for client in clients:
            # pipelined: the last step's verdicts and round requests leave before this step takes the
            # interpreter (normally taken already: see after the cycle)
            self.flush_seconds += await client.seam.flush(FLUSH_TIMEOUT)
        if len(clients) == 1:
            got = [await clients[0].seam.collect(self.watch.deadline())]
        else:
            got = await asyncio.gather(*(c.seam.collect(self.watch_of(c.serial).deadline()) for c in clients))
        self.wait_seconds += max(p.waited for p in got)
        return {c.serial: p for c, p in zip(clients, got)}

    def forget(self) -> None:
        """Give up the rounds of proposals asked for, if any."""
        for client in self._clients:
            client.seam.forget()

    def observe(self, cycle: Cycle, proposals: dict[int, Proposals]) -> None:
        for client in self._clients:
            watch = self.watch_of(client.serial)
            if cycle.decode_seconds:
                watch.observe_step(cycle.decode_seconds)
            got = proposals.get(client.serial, Proposals())
            news = cycle.news.get(client.serial, StreamNews())
            if got.asked:
                watch.observe_round(got.asked, got.arrived, news.dropped)
            elif got.arrived:  # pipelined
                watch.observe_round(got.arrived, got.arrived, news.dropped)
            watch.observe_staged(news.staged, bool(client.hidden_layers))  # (counts nothing but pipelined)
            self.proposals_dropped += news.dropped

    def talk(self, cycle: Cycle) -> bool:
        """Send the step's news on each draft stream's seam; True when a seam wants the streams' writers
        given a turn of the event loop (the pipelined one, when anything went)."""
        turn = False
        for client in self._clients:
            news = cycle.news.get(client.serial)
            if news is not None:
                turn |= client.seam.news(news.verdicts, news.released, news.requests)
        return turn
