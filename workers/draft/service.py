"""The draft worker's gRPC service: one bidirectional stream per target worker, proposals batched
across every sequence of every stream.

Each stream reads TargetMessages (a target step's ``step`` news is its ``verify``, ``release`` and
``propose`` batches in that order, in one message) and queues them, in arrival order, as typed work
(:mod:`.work`: :class:`~.work.Requests`, :class:`~.work.Verdicts`, :class:`~.work.Release`) for the
one batcher, with new head weights from online distillation (:class:`~.work.Weights`,
:meth:`DraftService.swap_weights`). The batcher takes everything queued, applies verdicts and
releases in order, runs one ``propose`` call for the requests between them, and routes each proposal
back to its stream; where the drafter's work runs (the event loop or a worker thread) is
:class:`~.work.DrafterCalls`'s to say.

Every method is a :class:`.drafter.Drafter`, and both seams ask it the same thing: branches to draft.
A target on the synchronous seam gets one branch per sequence, answered per round
(:meth:`.drafter.Drafter.propose`); for a drafter that ``drafts_ahead`` (draft_model, oracle) the
service then asks, while the target verifies, for a longer one (``2γ + 1``: what the next round
needs if this one is wholly accepted), which the drafter keeps. A target that runs the pipelined
seam (``Hello.pipelined``) gets, from a drafter that stages (ngram, suffix and EAGLE drafting chains,
oracle), streamed proposals instead of answers (:class:`.stager.Stager`): the news of everything
queued is applied in order, then, once per sequence, a proposal from its committed tokens if none
streamed fits them, and staged proposals for the outcomes of the one the target verifies next.
Other methods (draft_model, heads, trees) serve every target through the synchronous seam.

Hidden states come inline (protobuf Tensors) or, when the target's Hello offers a data plane, from
it (:mod:`workers.speculation.hidden_plane`): the stream maps the target's shared-memory ring when it
can (same host), else takes streamed chunks, and resolves each message's descriptors into rows as
the message is read, in order, before anything is queued. Drafters run torch in a worker thread
only: proposals, verdicts (a head's projection of the hidden states), releases and new weights; a
pure-Python drafter that drafts in microseconds (``caps.on_loop``: n-gram, suffix) is called on the
event loop instead (:class:`~.work.DrafterCalls`).

A target on this host may take the service's fast lane (:mod:`workers.speculation.lane`): the
service listens on one Unix-domain socket, hands each stream a token in its HelloAck, and once the
target binds a connection with it, reads that stream's messages from the lane and writes its
proposals there. Either the lane or the gRPC stream ending ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from proto import spec_pb2, spec_pb2_grpc

from ..speculation.convert import draft_input_from_pb, draft_output_to_pb, verify_from_pb
from ..speculation import lane
from ..speculation.hidden_plane import PlaneReader, open_reader
from ..speculation.lane import LaneProtocol, LaneServer
from ..speculation.tree import tree_depths
from .drafter import Branch, DraftInput, Drafter
from .metrics import DraftStats
from .stager import Stager
from .work import DrafterCalls, News, Release, Requests, Verdicts, Weights, Work

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    target_id: str
    out: asyncio.Queue  # DraftMessage or None (end), for the gRPC stream
    pipelined: bool = False  # the stream's seam, agreed at its handshake: the target asked and the drafter stages
    plane: PlaneReader | None = None  # the hidden-state data plane agreed at the handshake (None: inline)
    lane: LaneProtocol | None = None  # the fast lane the target bound (None: everything on gRPC)
    lane_token: bytes = b""  # the token the target binds the lane with (until it does)
    lane_task: asyncio.Task | None = None  # handles the lane's messages in order
    seqs: set = dataclasses.field(default_factory=set)  # the sequences this target has told of
    ended: bool = False

    def send(self, msg: spec_pb2.DraftMessage) -> None:
        """To the target: on the lane once it is bound, else on the gRPC stream."""
        if self.lane is not None and not self.lane.closed:
            self.lane.send(msg.SerializeToString())
        else:
            self.out.put_nowait(msg)


# Drafting ahead pays only when a whole proposal is accepted. Each sequence keeps a moving average
# of how often that happened (weight AHEAD_WEIGHT for the newest round, starting at 1); below
# AHEAD_MIN the service stops drafting ahead for it until full acceptances bring the average back.
AHEAD_WEIGHT = 0.3
AHEAD_MIN = 0.15
FLUSH_TIMEOUT = 0.005  # the most staging waits for its proposals to be written (normally ~0.1 ms)
ROWS_ON_LOOP = 256  # hidden rows a message may take off the data plane on the event loop (more: in a thread)


class DraftService(spec_pb2_grpc.DraftServiceServicer):
    """Serves a :class:`Drafter`'s proposals to any number of target workers."""

    takes_step_news = True  # HelloAck.step_news: a target may send each step's news as one StepNews

    def __init__(self, drafter: Drafter, draft_id: str, max_num_speculative_tokens: int = 16, overlap: bool = True,
                 alternatives: int = 1, lanes: bool = True, executor: ThreadPoolExecutor | None = None,
                 incarnation: int = 0, lora: str = ""):
        self.drafter = drafter
        self.lora = lora  # the LoRA adapter its head was trained against (HelloAck.lora; "": the base model)
        caps = drafter.caps
        self._calls = DrafterCalls(caps.on_loop, executor)  # where the drafter's work runs
        # The pipelined seam: staged proposals, ``alternatives`` bonus guesses per rejected depth.
        self.stager = Stager(drafter, alternatives) if caps.stages else None
        # Synchronous seam: draft ahead (round n+1, assuming round n is fully accepted) while the target verifies.
        self.overlap = overlap and caps.drafts_ahead
        self._ahead: dict[str, int] = {}  # seq id -> γ of its last proposal, to draft ahead for
        self._proposed: dict[str, int] = {}  # seq id -> tokens in its last proposal
        self._full_rate: dict[str, float] = {}  # seq id -> moving average of whole proposals accepted
        self.draft_id = draft_id
        self.incarnation = incarnation  # this start of the worker (its record's; HelloAck.incarnation)
        self.max_num_speculative_tokens = max_num_speculative_tokens
        self._work: asyncio.Queue[Work] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.streams: dict[int, _Stream] = {}
        self.stats = DraftStats()
        self.distiller = None  # online distillation (workers.draft.online.Distiller), when on
        self._want_lanes = lanes  # offer targets on this host a fast lane (workers.speculation.lane)
        self._lanes: LaneServer | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="draft-batcher")
        if self._want_lanes and self._lanes is None:
            lanes = LaneServer()
            self._lanes = lanes if await lanes.start() else None

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._lanes is not None:
            await self._lanes.close()
            self._lanes = None
        self._calls.close()

    async def _run(self) -> None:
        while True:
            items = [await self._work.get()]
            while not self._work.empty():
                items.append(self._work.get_nowait())
            try:
                await self._process(items)
                if self.overlap and self._ahead and self._work.empty():
                    await self._draft_ahead()
            except Exception:
                log.exception("draft batch failed; answering with empty proposals")
                for item in items:
                    # empty proposals: the target decodes these rounds plainly (a pipelined one waits for nothing)
                    if isinstance(item, Requests) and not item.stream.pipelined:
                        empty = [spec_pb2.Proposal(seq_id=d.seq_id, round=d.round) for d in item.inputs]
                        item.stream.send(spec_pb2.DraftMessage(proposals=spec_pb2.ProposalBatch(proposals=empty)))

    async def _process(self, items: list[Work]) -> None:
        # Verdicts and releases that arrived before requests apply first, in order. News of pipelined
        # streams is kept in order (``news``) and drafted on once per sequence at the end (_stage).
        batch: list[tuple[_Stream, DraftInput]] = []  # synchronous streams' requests: one propose call
        news: list[News] = []
        staged: dict[str, tuple[_Stream, DraftInput]] = {}
        for item in items:
            if isinstance(item, Requests | Verdicts) and item.stream.pipelined:
                news.append(item)
                if isinstance(item, Requests):
                    staged.update((d.seq_id, (item.stream, d)) for d in item.inputs)
                else:
                    self._note_verdicts(item.results)
                continue
            if isinstance(item, Requests):
                batch.extend((item.stream, d) for d in item.inputs)
                continue
            if batch:
                await self._propose(batch)
                batch = []
            match item:
                case Verdicts(results=results):  # torch (a head's projection) runs where proposals do
                    await self._calls.run(self.drafter.verified, results)
                    self._note_verdicts(results)
                case Weights(state=state):  # between two proposal batches, never during one
                    try:
                        await self._calls.run(self.drafter.load_weights, state)
                    except Exception:
                        log.exception("new head weights not taken; serving goes on with the old ones")
                    else:
                        self._ahead.clear()  # tails drafted with the old weights are gone
                        self.stats.weight_swaps += 1
                case Release(seq_ids=seq_ids):
                    if news:  # what was heard of these sequences before they ended must not revive them
                        gone = set(seq_ids)
                        news = [x.without(gone) for x in news]
                        for seq_id in gone:
                            staged.pop(seq_id, None)
                    await self._calls.run(self.stager.release if self.stager is not None else self.drafter.release,
                                          seq_ids)
                    for seq_id in seq_ids:
                        self._ahead.pop(seq_id, None)
                        self._proposed.pop(seq_id, None)
                        self._full_rate.pop(seq_id, None)
        if batch:
            await self._propose(batch)
        if news or staged:
            await self._stage(news, staged)

    async def _stage(self, news: list[News], streams: dict[str, tuple[_Stream, DraftInput]]) -> None:
        """Pipelined seam: apply the news in order, answer the sequences nothing streamed fits, then
        stream staged proposals for the outcomes of what each verifies next (see :mod:`.stager`)."""
        stager = self.stager

        # A model's drafting call (in the worker thread) takes a while: what each call drafted leaves
        # at once, and as soon as it exists: a drafter paying per depth says so before its last pass,
        # whose tokens only guess what follows; the stager then hands them to ``send_early``. A
        # drafter on the loop takes microseconds: all of it leaves as one message, one read for the
        # target.
        each = not self._calls.on_loop
        early: set[int] = set()  # ids of the proposals that left before their call returned
        send_early = None
        if each:
            loop = asyncio.get_running_loop()

            def send_early(proposals: list) -> None:  # (in the drafting thread)
                early.update(id(p) for p in proposals)
                loop.call_soon_threadsafe(self._send_now, proposals, streams)

        def apply_and_draft() -> tuple[list, list[str]]:
            for item in news:
                if isinstance(item, Requests):
                    for x in item.inputs:
                        stager.commit(x.seq_id, x.round, list(x.new_tokens), x.chain_budget, x.hidden_states,
                                      x.sampling)
                else:
                    stager.verified(item.results)
            # one drafting call: answers for the sequences nothing fits, the others' outcomes staged
            return stager.answer_and_stage(list(streams), send_early)

        async def send_rest(proposals: list) -> None:  # what each call drafted and did not send early
            if each:
                await self._send_staged([p for p in proposals if id(p) not in early], streams)

        started = time.perf_counter()
        staged, answered = await self._calls.run(apply_and_draft)
        await send_rest(staged)
        # Their answers exist now: stage what verifying them may lead to, unless news is waiting.
        # Then this stager is behind the target, and a second drafting call would put it further
        # behind (and a late stager drafts spare tokens, so each call gets longer: at batch 8 on
        # two cores such a draft stayed steps late for whole runs); the answers' outcomes are
        # staged with it.
        if answered and self._work.empty():
            more = await self._calls.run(stager.stage, answered, send_early)
            await send_rest(more)
            staged += more
        # no news yet: one level further for the likeliest outcome, if it is behind
        if self._work.empty() and stager.behind(list(streams)):
            ahead = await self._calls.run(stager.stage_ahead, list(streams), send_early)
            await send_rest(ahead)
            staged += ahead
        if not each:
            await self._send_staged(staged, streams)
        stats = self.stats
        stats.latency.observe(time.perf_counter() - started)
        stats.batch_size.observe(len(streams))
        stats.propose_calls += 1
        stats.proposals += len(staged)
        stats.draft_tokens += sum(len(p.token_ids) for p in staged)

    @staticmethod
    def _send_now(proposals, streams: dict[str, tuple[_Stream, DraftInput]]) -> list[_Stream]:
        """Stream staged proposals, one message per stream; the streams sent to."""
        per_stream: dict[int, list] = {}
        for prop in proposals:
            stream = streams[prop.seq_id][0]
            per_stream.setdefault(id(stream), [stream]).append(draft_output_to_pb(prop))
        for stream, *batch in per_stream.values():
            stream.send(spec_pb2.DraftMessage(proposals=spec_pb2.ProposalBatch(proposals=batch)))
        return [stream for stream, *_ in per_stream.values()]

    @classmethod
    async def _send_staged(cls, proposals, streams: dict[str, tuple[_Stream, DraftInput]]) -> None:
        """Stream staged proposals, and wait (briefly) until they are written: the next drafting call
        runs in a thread that, for a model-based draft, holds the interpreter for most of a switch
        interval at a time, and a proposal still queued behind it reaches the target that much late."""
        # (a stream on a fast lane wrote them already: its gRPC queue is empty)
        queued = [stream for stream in cls._send_now(proposals, streams) if not stream.out.empty()]
        if queued:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLUSH_TIMEOUT):
                    for stream in queued:
                        await stream.out.join()

    def swap_weights(self, state) -> None:
        """Queue new head weights (online distillation): the drafter takes them between drafting
        batches, in order with the proposals and verdicts around them. Call on the event loop."""
        self._work.put_nowait(Weights(state))

    async def _draft_ahead(self) -> None:
        # The round's branch, longer: γ drafts + a guess of the target's bonus token + γ drafts for the
        # next round, in one drafting call; the drafter keeps them (what it returns now goes nowhere).
        branches = [Branch(seq_id, (), 2 * n + 1, sampled=True) for seq_id, n in self._ahead.items()]
        self._ahead.clear()
        await self._calls.run(self.drafter.draft, branches)
        self.stats.drafted_ahead += 1

    def _note_verdicts(self, results) -> None:
        self.stats.verdicts += len(results)
        self.stats.accepted_tokens += sum(result.num_accepted for result in results)
        for result in results:
            proposed = self._proposed.get(result.seq_id, 0)
            if proposed:
                full = float(result.num_accepted >= proposed)
                rate = self._full_rate.get(result.seq_id, 1.0)
                self._full_rate[result.seq_id] = (1 - AHEAD_WEIGHT) * rate + AHEAD_WEIGHT * full

    async def _propose(self, batch: list[tuple[_Stream, DraftInput]]) -> None:
        inputs = [d for _, d in batch]
        if self.overlap:
            self._ahead.update((d.seq_id, d.chain_budget) for d in inputs
                               if d.chain_budget > 0 and self._full_rate.get(d.seq_id, 1.0) >= AHEAD_MIN)
        started = time.perf_counter()
        outputs = await self._calls.run(self.drafter.propose, inputs)
        stats = self.stats
        stats.latency.observe(time.perf_counter() - started)
        stats.batch_size.observe(len(inputs))
        for out in outputs:  # drafting ahead extends a chain; a tree is drafted afresh each round
            if out.is_tree:
                self._ahead.pop(out.seq_id, None)
        self._proposed.update((out.seq_id, max(tree_depths(out.parents)) if out.is_tree else len(out.token_ids))
                              for out in outputs)
        stats.propose_calls += 1
        stats.proposals += len(outputs)
        stats.draft_tokens += sum(len(out.token_ids) for out in outputs)
        per_stream: dict[int, list] = {}
        for (stream, _), out in zip(batch, outputs):
            per_stream.setdefault(id(stream), [stream]).append(draft_output_to_pb(out))
        for stream, *proposals in per_stream.values():
            stream.send(spec_pb2.DraftMessage(proposals=spec_pb2.ProposalBatch(proposals=proposals)))

    async def Speculate(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802 (gRPC name)
        stream = _Stream("?", asyncio.Queue())
        self.streams[id(stream)] = stream
        reader = asyncio.create_task(self._read(request_iterator, stream))
        try:
            while True:
                msg = await stream.out.get()
                # done once handed over: gRPC starts its write as it takes it (and asks for the next
                # message only once that write completed), so a flush (join) need not wait for that
                stream.out.task_done()
                if msg is None:
                    if reader.done() or stream.ended:
                        break
                    continue
                yield msg
        finally:
            reader.cancel()
            self.streams.pop(id(stream), None)
            self._end_lane(stream)
            if stream.seqs:  # the target went away: forget its sequences
                self._work.put_nowait(Release(stream, sorted(stream.seqs)))
                stream.seqs.clear()
            if stream.plane is not None:  # waits for a resolve in progress (PlaneReader's lock)
                stream.plane.close()
                stream.plane = None
            log.info("stream from target %s closed", stream.target_id)

    # ------------------------------------------------------------------ the fast lane

    def _lane_for(self, stream: _Stream, hello: spec_pb2.Hello) -> bytes:
        """A token for the target to bind the lane with, when it offers one this service listens on."""
        if self._lanes is None or lane.UNIX not in hello.lanes:
            return b""
        stream.lane_token = self._lanes.expect(lambda proto: self._bind_lane(stream, proto))
        return stream.lane_token

    def _bind_lane(self, stream: _Stream, proto: LaneProtocol):
        """The target connected the lane: its frames are the stream's messages from now on."""
        if stream.ended or stream.lane is not None:
            raise ValueError("lane for a stream that ended or has one")
        stream.lane, stream.lane_token = proto, b""
        queue: asyncio.Queue = asyncio.Queue()  # messages read off the lane, for lane_task
        proto.on_lost = lambda reason: self._lane_lost(stream, reason)
        stream.lane_task = asyncio.create_task(self._read_lane(stream, queue), name="draft-lane")
        return lambda frame: queue.put_nowait(spec_pb2.TargetMessage.FromString(frame))

    async def _read_lane(self, stream: _Stream, queue: asyncio.Queue) -> None:
        try:
            while True:
                await self._on_message(stream, await queue.get(), on_lane=True)
        except asyncio.CancelledError:
            raise
        except Exception:  # a malformed message: end this stream (the target falls back), say why
            log.exception("lane from target %s: bad message", stream.target_id)
            self._lane_lost(stream, "bad message")

    def _lane_lost(self, stream: _Stream, reason: str) -> None:
        if not stream.ended:
            log.info("lane from target %s closed (%s): ending its stream", stream.target_id, reason)
        stream.ended = True
        stream.out.put_nowait(None)

    def _end_lane(self, stream: _Stream) -> None:
        if stream.lane_token and self._lanes is not None:
            self._lanes.forget(stream.lane_token)
        if stream.lane_task is not None:
            stream.lane_task.cancel()
        if stream.lane is not None:
            stream.lane.close()

    async def _with_rows(self, stream: _Stream, items: list) -> list:
        """``items`` (DraftInputs or VerifyResults) with their hidden rows taken off the data plane,
        in one copy per block (a large block in a thread: the event loop serves every stream)."""
        refs = [item.hidden_ref for item in items]
        if all(ref is None for ref in refs):
            return items
        plane = stream.plane
        if plane is None:
            raise ValueError("hidden-state descriptors on a stream without a data plane")
        before = plane.bytes
        if sum(ref.count for ref in refs if ref is not None) > ROWS_ON_LOOP:
            rows = await asyncio.to_thread(plane.resolve, refs)  # (not the drafter: a large copy)
        else:
            rows = plane.resolve(refs)
        self.stats.hidden_bytes += plane.bytes - before
        return [item if ref is None else dataclasses.replace(item, hidden_states=r, hidden_ref=None)
                for item, ref, r in zip(items, refs, rows)]

    async def _on_propose(self, stream: _Stream, batch: spec_pb2.ProposeBatch) -> None:
        self.stats.hidden_bytes += sum(len(t.data) for r in batch.requests for t in r.hidden_states)
        inputs = []
        for r in batch.requests:
            d = draft_input_from_pb(r)
            if d.num_speculative_tokens > self.max_num_speculative_tokens:
                d = dataclasses.replace(d, num_speculative_tokens=self.max_num_speculative_tokens)
            stream.seqs.add(d.seq_id)
            inputs.append(d)
        self._work.put_nowait(Requests(stream, await self._with_rows(stream, inputs)))

    async def _on_verify(self, stream: _Stream, batch: spec_pb2.VerifyBatch) -> None:
        self.stats.hidden_bytes += sum(len(t.data) for o in batch.outcomes for t in o.hidden_states)
        results = [verify_from_pb(o) for o in batch.outcomes]
        self._work.put_nowait(Verdicts(stream, await self._with_rows(stream, results)))

    def _on_release(self, stream: _Stream, batch: spec_pb2.ReleaseBatch) -> None:
        stream.seqs.difference_update(batch.seq_ids)
        self._work.put_nowait(Release(stream, list(batch.seq_ids)))

    async def _read(self, request_iterator, stream: _Stream) -> None:
        try:
            async for msg in request_iterator:
                await self._on_message(stream, msg)
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        except Exception:  # a malformed message: end this stream (the target falls back), say why
            log.exception("stream from target %s: bad message", stream.target_id)
        finally:
            stream.out.put_nowait(None)

    async def _on_message(self, stream: _Stream, msg: spec_pb2.TargetMessage, on_lane: bool = False) -> None:
        """One message of a stream (from gRPC or its lane), handled in the order it came."""
        body = msg.WhichOneof("body")
        if body == "hello":
            if on_lane:
                raise ValueError("Hello on the lane")
            hello = msg.hello
            stream.target_id = hello.target_id
            stream.pipelined = hello.pipelined and self.stager is not None
            if stream.plane is not None:
                stream.plane.close()
            caps = self.drafter.caps
            plane, stream.plane = open_reader(hello.hidden_planes, hello.hidden_shm, caps.hidden_layers,
                                              hello.hidden_size, hello.hidden_plane_dtype)
            token = self._lane_for(stream, hello)
            log.info("target %s connected (model %s, %s seam, hidden states %s%s)", stream.target_id,
                     hello.model, "pipelined" if stream.pipelined else "synchronous",
                     f"on plane {plane}" if plane else "inline", ", fast lane offered" if token else "")
            stream.out.put_nowait(spec_pb2.DraftMessage(hello_ack=spec_pb2.HelloAck(
                draft_id=self.draft_id, method=caps.method, hidden_layers=caps.hidden_layers,
                max_num_speculative_tokens=self.max_num_speculative_tokens,
                hidden_dtype=caps.hidden_dtype, vocab_size=caps.vocab_size,
                pipelined=self.stager is not None, hidden_plane=plane, step_news=self.takes_step_news,
                lane=lane.UNIX if token else "", lane_address=self._lanes.address if token else "",
                lane_token=token, incarnation=self.incarnation, lora=self.lora)))
        elif body == "hidden_rows":
            if stream.plane is None:
                raise ValueError("hidden rows on a stream without a data plane")
            before = stream.plane.bytes
            stream.plane.chunk(msg.hidden_rows)
            self.stats.hidden_bytes += stream.plane.bytes - before
        elif body == "step":  # one target step's news: verdicts, releases, requests, in that order
            step = msg.step
            if step.verify.outcomes:
                await self._on_verify(stream, step.verify)
            if step.release.seq_ids:
                self._on_release(stream, step.release)
            if step.propose.requests:
                await self._on_propose(stream, step.propose)
        elif body == "propose":
            await self._on_propose(stream, msg.propose)
        elif body == "verify":
            await self._on_verify(stream, msg.verify)
        elif body == "release":
            self._on_release(stream, msg.release)
