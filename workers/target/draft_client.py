"""The target worker's side of the draft stream: one gRPC stream to one draft worker.

:class:`DraftClient` opens the stream and checks the draft's handshake against what this target
offers (:func:`workers.speculation.checks.hello_ack_problem`): an incompatible draft is refused
(:class:`IncompatibleDraft`) before anything of the target changes. It then sends batched proposal
requests and verdicts, already converted to protobuf on the engine's thread, and matches
proposals to requests by (sequence id, round); a proposal for anything else is counted
(``stray``) and ignored. Under the pipelined seam (the target asks for it in ``Hello.pipelined``
and the draft serves it, ``HelloAck.pipelined``) nothing is matched or awaited: every proposal the
draft streams goes to an inbox the step loop empties at each step (:meth:`DraftClient.take`) and the
engine reconciles (:mod:`workers.speculation.staging`). The handshake fixes the seam for the
stream's lifetime: :attr:`DraftClient.seam` (:mod:`.seam`), the object the step loop talks through.
Any stream failure marks the client broken; every pending and later round then returns no proposals
at once, so the target keeps decoding plainly. Which draft worker a target streams to, and when it
opens a new client, is :mod:`.draft_pool`'s.

Hidden states: the target offers data planes in its Hello (:mod:`workers.speculation.hidden_plane`:
a shared-memory ring made for this stream, and streamed chunks); the draft's HelloAck picks one, and
from then on the engine writes each batch's rows once to :attr:`DraftClient.plane` and the messages
carry descriptors. A draft that picks none (an older one) gets them inline, as before.

Messages: a draft on this host offers a fast lane in its HelloAck (:mod:`workers.speculation.lane`,
a Unix-domain socket bound to this stream by a token); the client then carries every message of
the stream on it, written at once, and keeps the gRPC stream open as the pair's control channel.
A lane out of reach leaves everything on gRPC; a lane that breaks breaks the client.

Incarnations: a draft worker restarted under the same worker id (``TANDEM_INSTANCE_ID``) is a new
process that knows nothing of the old one's sequences. Its HelloAck names its ``incarnation`` (its
discovery record's); a handshake from another worker id than the one dialled, or from an older
incarnation than the record dialled, is refused (:class:`IncompatibleDraft`). Once the pool learns of
a newer incarnation it :meth:`DraftClient.fence`\ s the stream to the old one: it is broken, and
anything that still arrives on it is counted (``fenced``) and dropped, never applied.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from proto import spec_pb2, spec_pb2_grpc
from runtime.messages import InstanceRecord
from runtime.tls import ClientTls

from ..speculation.checks import hello_ack_problem
from ..speculation.convert import DTYPES, draft_input_to_pb, draft_output_from_pb
from ..speculation import lane
from ..speculation.hidden_plane import PlaneOffer, PlaneWriter, Ring, RowLayout, distinct, make_ring
from ..speculation.lane import LaneProtocol
from ..speculation.payloads import DraftInput, DraftOutput
from .seam import PipelinedSeam, Seam, SynchronousSeam

log = logging.getLogger(__name__)

INBOX_MAX = 4096  # pipelined: proposals held for the step loop; past it the oldest go
MESSAGE_LIMIT = 64 << 20  # gRPC's message size limit on the draft stream, both ways
INLINE_BUDGET = 48 << 20  # inline hidden-state bytes one message may carry (the rest of it fits in what is left)


class IncompatibleDraft(ConnectionError):
    """The draft worker announced something this target cannot serve; ``reason`` says what."""

    def __init__(self, draft_id: str, label: str, reason: str):
        self.draft_id, self.label, self.reason = draft_id, label, reason
        super().__init__(f"draft worker {draft_id} refused: {reason}")


class DraftClient:
    """A bidirectional stream to one draft worker."""

    _serials = itertools.count(1)

    def __init__(self, target_id: str, model: str, vocab_size: int, instance: InstanceRecord, hidden_layers=(),
                 tls: ClientTls | None = None, pipelined: bool = False, plane: PlaneOffer | None = None,
                 lanes: bool = True):
        self.target_id = target_id
        self.serial = next(self._serials)  # tells this stream from every other this process opened
        self._offer_lanes = lanes and lane.available()  # offer the draft a fast lane (workers.speculation.lane)
        self.lane: LaneProtocol | None = None  # the lane agreed and connected (None: everything on gRPC)
        self._offer = plane if plane is not None and hidden_layers else None  # hidden-state planes offered
        self._segment = None  # the ring's segment from Hello until HelloAck says whether the draft took it
        self.plane: PlaneWriter | None = None  # the plane agreed at the handshake (None: inline Tensors)
        self._ask_pipelined = pipelined  # ask the draft for the pipelined seam (it may serve the synchronous one)
        self.seam: Seam | None = None  # the seam agreed at the handshake, for the stream's lifetime
        self.step_news = False  # the draft takes a step's news as one StepNews message (HelloAck.step_news)
        self._inbox: list[DraftOutput] = []  # pipelined: proposals streamed since the last take()
        self.tls = tls
        self.model = model
        self.vocab_size = vocab_size
        self.instance = instance
        self.draft_id = instance.instance_id
        self.incarnation = instance.incarnation  # the draft process's start (HelloAck's, once connected)
        self.fenced = 0  # proposals that arrived after the stream was fenced (a newer incarnation known): dropped
        self._fenced = False
        self.method = ""
        self.lora = ""
        self.hidden_layers: list[int] = []
        self.hidden_dtype = ""  # what the draft computes in; hidden states are sent in it
        self.hidden_bytes = 0  # hidden-state payload sent so far
        self._offered_layers = list(hidden_layers)
        self._channel: grpc.aio.Channel | None = None
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._pending: dict[tuple[str, int], asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self.broken = False
        self.stray = 0  # proposals for no pending (sequence, round): unknown, stale or from the future

    async def connect(self, timeout: float = 5.0) -> None:
        options = [("grpc.max_receive_message_length", MESSAGE_LIMIT), ("grpc.max_send_message_length", MESSAGE_LIMIT)]
        if self.tls is not None:
            self._channel = grpc.aio.secure_channel(self.instance.grpc_address, self.tls.credentials(), options=options)
        else:
            self._channel = grpc.aio.insecure_channel(self.instance.grpc_address, options=options)
        stub = spec_pb2_grpc.DraftServiceStub(self._channel)
        self._call = stub.Speculate(self._requests())
        offer, segment = self._offer, None
        planes = list(offer.planes) if offer is not None else []
        if "shm" in planes and (segment := make_ring(offer.ring_bytes)) is None:
            planes.remove("shm")  # no shared memory here: the streamed plane (if offered) serves
        self._segment = segment
        self._outgoing.put_nowait(spec_pb2.TargetMessage(hello=spec_pb2.Hello(
            target_id=self.target_id, model=self.model, vocab_size=self.vocab_size, hidden_layers=self._offered_layers,
            pipelined=self._ask_pipelined, hidden_planes=planes, hidden_shm=segment.name if segment else "",
            hidden_size=offer.hidden if planes else 0, hidden_plane_dtype=offer.dtype if planes else "",
            lanes=[lane.UNIX] if self._offer_lanes else [])))
        try:
            first = await asyncio.wait_for(self._call.read(), timeout)
        finally:
            if segment is not None:
                segment.unlink()  # the draft mapped it by now, or never will: no name outlives the handshake
        if first is grpc.aio.EOF or first.WhichOneof("body") != "hello_ack":
            raise ConnectionError(f"draft worker {self.draft_id} did not acknowledge the stream")
        ack = first.hello_ack
        if ack.draft_id and ack.draft_id != self.draft_id:
            raise IncompatibleDraft(self.draft_id, "draft_id", f"it says it is draft worker {ack.draft_id!r}")
        if ack.incarnation and ack.incarnation < self.instance.incarnation:
            raise IncompatibleDraft(self.draft_id, "incarnation", f"incarnation {ack.incarnation} is older than the "
                                    f"registered {self.instance.incarnation}")
        self.incarnation = ack.incarnation or self.instance.incarnation
        problem = hello_ack_problem(list(ack.hidden_layers), ack.hidden_dtype, ack.vocab_size,
                                    ack.max_num_speculative_tokens, tuple(self._offered_layers), self.vocab_size)
        if problem is not None:
            raise IncompatibleDraft(self.draft_id, *problem)
        self.method = ack.method
        self.lora = ack.lora  # the adapter it was trained against ("": the base model)
        self.hidden_layers = list(ack.hidden_layers)
        self.hidden_dtype = ack.hidden_dtype
        self.step_news = ack.step_news
        self.plane = self._plane(ack.hidden_plane, planes)
        seam = PipelinedSeam if self._ask_pipelined and ack.pipelined else SynchronousSeam
        self.seam = seam(self, self.plane)
        if ack.lane == lane.UNIX and self._offer_lanes:
            await self._connect_lane(ack.lane_address, ack.lane_token)
        self._reader = asyncio.create_task(self._read(), name=f"draft-stream {self.draft_id}")
        log.info("speculating with draft worker %s (%s, %s seam, hidden states %s, messages %s) at %s", self.draft_id,
                 self.method, "pipelined" if self.seam.pipelined else "synchronous",
                 f"on plane {self.plane.kind}" if self.plane else "inline",
                 "on a fast lane" if self.lane is not None else "on gRPC", self.instance.grpc_address)

    async def _connect_lane(self, address: str, token: bytes) -> None:
        """Carry the stream's messages on the draft's fast lane; keep to gRPC when it is out of reach."""
        try:
            self.lane = await lane.connect(address, token, self._on_lane_frame, self._lane_lost)
        except (OSError, TimeoutError) as exc:
            log.info("draft worker %s: its fast lane %s is out of reach (%r); messages stay on gRPC",
                     self.draft_id, address, exc)

    def _on_lane_frame(self, frame: bytes) -> None:
        self._on_message(spec_pb2.DraftMessage.FromString(frame))

    def _lane_lost(self, reason: str) -> None:
        self._break(f"fast lane: {reason}")

    def _put(self, msg: spec_pb2.TargetMessage) -> None:
        """To the draft: on the lane when there is one (written at once), else queued for gRPC."""
        if self.lane is not None:
            if not self.lane.closed:
                self.lane.send(msg.SerializeToString())
        else:
            self._outgoing.put_nowait(msg)

    def _plane(self, chosen: str, offered: list[str]) -> PlaneWriter | None:
        """The writer of the plane the draft chose (None: inline, as every draft before planes)."""
        segment, self._segment = self._segment, None
        if not chosen or chosen not in offered or not self.hidden_layers:
            if chosen:
                log.warning("draft worker %s chose hidden-state plane %r, not offered: sending them inline",
                            self.draft_id, chosen)
            if segment is not None:
                segment.close()
            return None
        layout = RowLayout(distinct(self.hidden_layers), self._offer.hidden, DTYPES[self._offer.dtype])
        if chosen == "shm":
            return PlaneWriter(layout, Ring(segment, layout), pin=True)
        if segment is not None:
            segment.close()
        return PlaneWriter(layout)

    async def _requests(self):
        # gRPC starts writing a message as it takes it, in the same turn of the event loop, and asks
        # for the next one only once that write completed: a message taken is as good as sent
        while (msg := await self._outgoing.get()) is not None:
            self._outgoing.task_done()
            yield msg

    async def flush(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, until gRPC has taken every message queued so far (and
        so started writing it). The step loop calls it before a step: otherwise the writer runs on
        the event loop while the step's thread holds the interpreter, and what the draft needs to
        stage ahead (this step's verdicts and round requests) can leave a whole switch interval
        late, the staged proposals with it. With one message a step (:meth:`news`) this costs a
        turn or two of the event loop; waiting for the writes to complete cost about 0.3 ms each
        on this CPU. True when taken (or nothing was waiting)."""
        if self.broken:
            return False
        if self._outgoing.empty():  # everything taken already (a lane takes each message as it is put)
            return True
        try:
            async with asyncio.timeout(timeout):  # (no task per call: this runs before every step)
                await self._outgoing.join()
            return True
        except TimeoutError:
            return False

    async def _read(self) -> None:
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    raise ConnectionError("draft stream ended")
                self._on_message(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._break(f"{exc!r}")

    def _on_message(self, msg: spec_pb2.DraftMessage) -> None:
        """A message from the draft (on gRPC or the lane): proposals to the inbox or their futures."""
        if msg.WhichOneof("body") != "proposals":
            return
        if self._fenced:  # from an incarnation older than one known: never applied
            self.fenced += len(msg.proposals.proposals)
            return
        if self.seam.pipelined:
            self._inbox.extend(draft_output_from_pb(p) for p in msg.proposals.proposals)
            if len(self._inbox) > INBOX_MAX:  # nobody takes them (an idle target): keep the newest
                self.stray += len(self._inbox) - INBOX_MAX
                del self._inbox[: len(self._inbox) - INBOX_MAX]
            return
        for proposal in msg.proposals.proposals:
            fut = self._pending.pop((proposal.seq_id, proposal.round), None)
            if fut is None or fut.done():
                self.stray += 1
            else:
                fut.set_result(draft_output_from_pb(proposal))

    def fence(self, newer: int) -> None:
        """A newer incarnation (``newer``) of this draft worker is known: this stream is to an older
        one. It is broken at once (nothing more is sent on it), the proposals waiting in its inbox are
        dropped, and whatever still arrives on it is counted in :attr:`fenced` and dropped."""
        if self._fenced:
            return
        self._fenced = True
        self.fenced += len(self._inbox)
        self._inbox = []
        log.warning("draft worker %s restarted (incarnation %d, this stream's %d): dropping the stream to the old "
                    "one and everything it sends", self.draft_id, newer, self.incarnation)
        self._break("an older incarnation", quiet=True)

    def _break(self, reason: str, quiet: bool = False) -> None:
        if not self.broken and not quiet:
            log.warning("draft worker %s lost (%s): falling back to plain decoding", self.draft_id, reason)
        self.broken = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_result(None)
        self._pending.clear()

    def news(self, verdicts: list[spec_pb2.VerifyOutcome], released: list[str],
             requests: list[spec_pb2.ProposeRequest]) -> dict[str, asyncio.Future]:
        """What one step has for the draft (already converted): its verdicts, the sequences it
        released, and the next round's requests, in that order; returns :meth:`send`'s futures. To a
        draft that takes them (``step_news``) they go as one StepNews message, one write on the
        stream instead of three; hidden states inline (no data plane) keep to one message each, as
        :meth:`_inline_batches` sizes them."""
        if self.broken or not (verdicts or released or requests):
            return {}
        if not self.step_news or (self.plane is None and self.hidden_layers):
            self.verified(verdicts)
            self.release(released)
            return self.send(requests)
        self._flush_rows()
        self._put(spec_pb2.TargetMessage(step=spec_pb2.StepNews(
            verify=spec_pb2.VerifyBatch(outcomes=verdicts), release=spec_pb2.ReleaseBatch(seq_ids=released),
            propose=spec_pb2.ProposeBatch(requests=requests))))
        return self._futures(requests)

    def send(self, requests: list[spec_pb2.ProposeRequest]) -> dict[str, asyncio.Future]:
        """Ask for proposals (requests already converted); returns a future per sequence id, which
        resolves to its :class:`DraftOutput` (or None: the stream broke). Pipelined: no futures, the
        proposals arrive in the inbox (:meth:`take`)."""
        if self.broken or not requests:
            return {}
        self._flush_rows()
        futures = self._futures(requests)
        for batch in self._inline_batches(requests):
            self._put(spec_pb2.TargetMessage(propose=spec_pb2.ProposeBatch(requests=batch)))
        return futures

    def _futures(self, requests: list[spec_pb2.ProposeRequest]) -> dict[str, asyncio.Future]:
        """Synchronous seam: a future per requested sequence, resolved by its proposal (None: the
        stream broke). Pipelined: none, the proposals arrive in the inbox."""
        if self.seam.pipelined or not requests:
            return {}
        loop = asyncio.get_running_loop()
        futures = {}
        for r in requests:
            futures[r.seq_id] = self._pending[(r.seq_id, r.round)] = loop.create_future()
        return futures

    def take(self) -> list[DraftOutput]:
        """Pipelined seam: every proposal streamed since the last call, oldest first; never waits."""
        out, self._inbox = self._inbox, []
        return out

    async def collect(self, futures: dict[str, asyncio.Future], timeout: float) -> dict[str, DraftOutput]:
        """The proposals of :meth:`send` that came within ``timeout`` seconds, by sequence id; the rest
        are given up (a late answer is then stray)."""
        if not futures:
            return {}
        pending = [f for f in futures.values() if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        out = {}
        for seq_id, fut in futures.items():
            if fut.done() and fut.result() is not None:
                out[seq_id] = fut.result()
            else:
                fut.cancel()
                for key in [k for k, f in self._pending.items() if f is fut]:
                    del self._pending[key]
        return out

    async def propose(self, inputs: list[DraftInput], timeout: float) -> dict[str, DraftOutput]:
        """Proposals by sequence id for ``inputs``; sequences whose proposal did not come in time are missing."""
        return await self.collect(self.send([draft_input_to_pb(d, self.hidden_dtype) for d in inputs]), timeout)

    def verified(self, outcomes: list[spec_pb2.VerifyOutcome]) -> None:
        """Send verdicts (already converted, see :func:`workers.speculation.convert.verify_to_pb`)."""
        if outcomes and not self.broken:
            self._flush_rows()
            for batch in self._inline_batches(outcomes):
                self._put(spec_pb2.TargetMessage(verify=spec_pb2.VerifyBatch(outcomes=batch)))

    def release(self, seq_ids: list[str]) -> None:
        if seq_ids and not self.broken:
            self._put(spec_pb2.TargetMessage(release=spec_pb2.ReleaseBatch(seq_ids=seq_ids)))

    def _flush_rows(self) -> None:
        """Streamed hidden rows go first: a batch never refers to rows the draft has not had."""
        if self.plane is not None:
            for chunk in self.plane.take_chunks():
                self._put(spec_pb2.TargetMessage(hidden_rows=chunk))

    def _inline_batches(self, msgs: list) -> list[list]:
        """``msgs`` (requests or verdicts) in batches whose inline hidden states stay under
        :data:`INLINE_BUDGET`, so no message passes gRPC's limit and breaks the stream (on a plane
        they carry descriptors only: one batch). One whose own rows pass the budget goes without them:
        the draft proposes nothing for that sequence, and the stream and every other sequence live."""
        out, size = [[]], 0
        for msg in msgs:
            n = sum(len(h.data) for h in msg.hidden_states)
            if n > INLINE_BUDGET:
                log.warning("request %s: %d bytes of inline hidden states pass the %d a message may carry; sent "
                            "without them (no proposals for it; a hidden-state plane has no such limit)",
                            msg.seq_id, n, INLINE_BUDGET)
                del msg.hidden_states[:]
                n = 0
            if out[-1] and size + n > INLINE_BUDGET:
                out.append([])
                size = 0
            out[-1].append(msg)
            size += n
            self.hidden_bytes += n
        return out if out[0] else []

    @property
    def plane_bytes(self) -> int:
        """Hidden-state bytes written to the data plane so far."""
        return self.plane.bytes if self.plane is not None else 0

    def hidden_bytes_by_plane(self) -> dict[str, int]:
        """Hidden-state bytes sent so far, by plane ("inline", "shm", "stream")."""
        out = {"inline": self.hidden_bytes} if self.hidden_bytes else {}
        if self.plane is not None:
            streamed = self.plane.streamed_rows * self.plane.layout.row_bytes
            out["stream"] = streamed
            if self.plane.kind == "shm":
                out["shm"] = self.plane.bytes - streamed
        return out

    async def close(self) -> None:
        self._outgoing.put_nowait(None)
        if self._reader:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._break("closed", quiet=True)
        if self.lane is not None:
            self.lane.close()
        if self._channel is not None:
            await self._channel.close()
        segment, self._segment = getattr(self, "_segment", None), None
        if segment is not None:  # the handshake never finished
            segment.unlink()
            segment.close()
        if self.plane is not None:
            self.plane.close()
