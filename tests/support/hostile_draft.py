"""Hostile draft workers for end-to-end tests of the target worker.

A :class:`HostileDraft` serves ``DraftService.Speculate`` from ``proto/spec.proto`` alone (the
generated ``spec_pb2`` modules, none of ``workers/``) over gRPC on loopback, and registers in etcd
the way a real draft worker does: its own runtime lease, a ``draft`` model card, and an instance
``draft.speculate`` whose record carries the gRPC address. Closing it stops the server (open streams
end with CANCELLED) and revokes the lease, so the draft disappears from discovery at once.

What it says is up to a :class:`Behaviour`: the ``HelloAck`` it sends, and what (if anything) it
sends back for each ``ProposeBatch``: proposals, nothing, or a gRPC abort. An :class:`Oracle`
knows the target's greedy continuations of the test prompts, so a hostile draft can also propose
correct tokens: a lax target would accept those together with the garbage sent around them.

Contract of the wire as this module reads it: ``ProposeRequest.new_tokens`` are the tokens of the
sequence the draft has not been told yet (the prompt, and more, on round 0), so their concatenation
over rounds is the sequence so far; each proposal names the ``(seq_id, round)`` it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from proto import spec_pb2, spec_pb2_grpc
from runtime import Runtime, RuntimeConfig
from runtime.messages import ModelCard

log = logging.getLogger(__name__)

METHOD = "hostile"


@dataclass(frozen=True)
class Ask:
    """One sequence a target asked about, as the draft saw it when the request arrived."""

    seq_id: str
    round: int
    num_speculative_tokens: int  # γ asked for
    max_depth: int  # 0: no bound but num_speculative_tokens
    context: tuple[int, ...]  # every token of the sequence the target has told this stream about
    greedy: bool

    @property
    def chain_budget(self) -> int:
        """The tokens a well-behaved draft proposes as a chain."""
        return min(self.num_speculative_tokens, self.max_depth) if self.max_depth else self.num_speculative_tokens


@dataclass(frozen=True)
class Abort:
    """Send this in an answer to end the stream with a gRPC error status."""

    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    details: str = "hostile draft aborts the stream"


Answer = list  # of spec_pb2.DraftMessage | Abort, sent in order; [] sends nothing


@dataclass
class StreamState:
    """One target's stream: what the draft was told per sequence and how often it answered."""

    index: int  # 0 for the first stream this draft accepted, 1 for the next, ...
    contexts: dict[str, list[int]] = field(default_factory=dict)
    answers: int = 0  # ProposeBatches this stream answered (with anything)


@dataclass
class Counts:
    """What a hostile draft saw, for a test's assertions and failure messages."""

    streams: int = 0
    hellos: int = 0
    batches: int = 0  # ProposeBatches received
    asks: int = 0  # ProposeRequests received (one per sequence and round)
    answers: int = 0  # ProposeBatches answered with at least one message
    verdicts: int = 0
    releases: int = 0
    aborts: int = 0


class Oracle:
    """The target's greedy continuation of each known prompt: ``references`` maps a prompt (tuple of
    ids) to at least as many output ids as the tests generate."""

    def __init__(self, references: dict[tuple[int, ...], list[int]]):
        self._full = [(len(p), list(p) + list(out)) for p, out in references.items()]

    def continuation(self, context: tuple[int, ...], n: int) -> list[int]:
        """The next ``n`` tokens the target will emit after ``context`` (fewer near the end of the
        reference; [] for a sequence the oracle does not know)."""
        for prompt_len, full in self._full:
            if prompt_len <= len(context) <= len(full) and full[: len(context)] == list(context):
                return full[len(context) : len(context) + n]
        return []


def proposal(ask: Ask, tokens: list[int], *, seq_id: str | None = None, round_: int | None = None,
             parents: list[int] = (), distributions: list[tuple[list[int], list[float]]] = ()) -> spec_pb2.Proposal:
    """A Proposal answering ``ask`` unless ``seq_id``/``round_`` say otherwise."""
    return spec_pb2.Proposal(
        seq_id=ask.seq_id if seq_id is None else seq_id, round=ask.round if round_ is None else round_,
        token_ids=tokens, parents=list(parents),
        distributions=[spec_pb2.SparseDistribution(ids=ids, probs=probs) for ids, probs in distributions])


def batch(proposals: list[spec_pb2.Proposal]) -> spec_pb2.DraftMessage:
    return spec_pb2.DraftMessage(proposals=spec_pb2.ProposalBatch(proposals=proposals))


class Behaviour:
    """A well-behaved but useless draft: a valid ``HelloAck`` (no hidden layers) and an empty
    proposal for every sequence, at once. Subclasses change one thing."""

    hidden_layers: tuple[int, ...] = ()
    hidden_dtype = ""
    max_num_speculative_tokens = 16

    def hello_ack(self, hello: spec_pb2.Hello, draft_id: str) -> spec_pb2.HelloAck:
        return spec_pb2.HelloAck(draft_id=draft_id, method=METHOD, hidden_layers=self.hidden_layers,
                                 max_num_speculative_tokens=self.max_num_speculative_tokens, hidden_dtype=self.hidden_dtype)

    async def answer(self, asks: list[Ask], stream: StreamState) -> Answer:
        return [batch([proposal(a, []) for a in asks])]


class BadHandshake(Behaviour):
    """Announces what the target cannot give: hidden layers it does not have, a dtype that does not
    exist. Asked for proposals anyway, it answers with empty ones."""

    def __init__(self, hidden_layers: list[int], hidden_dtype: str = ""):
        self.hidden_layers = list(hidden_layers)
        self.hidden_dtype = hidden_dtype


class Silent(Behaviour):
    """Accepts the stream with a valid ``HelloAck`` and never answers a proposal request."""

    async def answer(self, asks: list[Ask], stream: StreamState) -> Answer:
        return []


class AbortAfterFirst(Behaviour):
    """Answers the first ``ProposeBatch`` of each stream with correct proposals, then aborts the
    stream with UNAVAILABLE; a target that reconnects gets the same again (a draft that keeps failing)."""

    def __init__(self, oracle: Oracle):
        self.oracle = oracle

    async def answer(self, asks: list[Ask], stream: StreamState) -> Answer:
        if stream.answers > 0:  # the abort raced a second batch: that one gets nothing
            return []
        good = [proposal(a, self.oracle.continuation(a.context, a.chain_budget)) for a in asks]
        return [batch(good), Abort(details="hostile draft: failing after one answer")]


class Slow(Behaviour):
    """Answers every ``ProposeBatch`` correctly (the oracle's tokens, so every draft is accepted),
    but ``delay`` seconds late: each batch is answered on its own timer, so a target that waits
    for it pays ``delay`` per step."""

    def __init__(self, oracle: Oracle, delay: float):
        self.oracle = oracle
        self.delay = delay

    async def answer(self, asks: list[Ask], stream: StreamState) -> Answer:
        await asyncio.sleep(self.delay)
        return [batch([proposal(a, self.oracle.continuation(a.context, a.chain_budget)) for a in asks])]


def _filler(vocab: int, n: int, offset: int = 0) -> list[int]:
    """``n`` valid token ids that are almost surely wrong (what a poor but well-formed draft sends)."""
    return [(7 * (i + offset) + 3) % vocab for i in range(n)]


Good = Callable[[int], list[int]]  # n -> n tokens: the correct ones where the oracle knows them, then filler


def _malformed_kinds(vocab: int) -> dict[str, Callable[[Ask, Good], list[spec_pb2.Proposal]]]:
    """Name -> the proposals a hostile draft sends for ``ask``."""

    def chain(n: int) -> list[int]:  # parents of a chain written as a tree
        return list(range(-1, n - 1))

    def dists(tokens: list[int], make) -> list[tuple[list[int], list[float]]]:
        return [make(t) for t in tokens]

    nan, inf = math.nan, math.inf
    n = lambda a: max(a.chain_budget, 2)  # noqa: E731 (kinds that need two tokens get two)
    return {
        # well-formed and correct: speculation that works, between the garbage
        "valid": lambda a, g: [proposal(a, g(a.chain_budget))],
        # token ids outside the vocabulary
        "negative_id": lambda a, g: [proposal(a, g(n(a) - 1) + [-1])],
        "id_equals_vocab": lambda a, g: [proposal(a, g(n(a) - 1) + [vocab])],
        "id_int32_max": lambda a, g: [proposal(a, [2**31 - 1] + g(n(a))[1:])],
        # parents that do not describe a tree
        "self_parent": lambda a, g: [proposal(a, g(n(a)), parents=[-1, 1] + chain(n(a))[2:])],
        "forward_parent": lambda a, g: [proposal(a, g(n(a)), parents=[1, 0] + chain(n(a))[2:])],
        "parent_below_root": lambda a, g: [proposal(a, g(n(a)), parents=[-2] + chain(n(a))[1:])],
        "parent_out_of_range": lambda a, g: [proposal(a, g(n(a)), parents=chain(n(a))[:-1] + [10**6])],
        "parents_too_long": lambda a, g: [proposal(a, g(n(a)), parents=chain(n(a) + 3))],
        "parents_too_short": lambda a, g: [proposal(a, g(n(a)), parents=[-1])],
        # distributions that are not distributions (a greedy request may ignore them; a sampled
        # request must not use them)
        "nan_probs": lambda a, g: [proposal(a, g(n(a)), distributions=dists(g(n(a)), lambda t: ([t], [nan])))],
        "inf_probs": lambda a, g: [proposal(a, g(n(a)), distributions=dists(g(n(a)), lambda t: ([t], [inf])))],
        "negative_probs": lambda a, g: [proposal(a, g(n(a)), distributions=dists(
            g(n(a)), lambda t: ([t, (t + 1) % vocab], [-0.5, 1.5])))],
        "probs_above_one": lambda a, g: [proposal(a, g(n(a)), distributions=dists(
            g(n(a)), lambda t: ([t, (t + 1) % vocab], [1.5, 0.9])))],
        "dist_ids_out_of_range": lambda a, g: [proposal(a, g(n(a)), distributions=dists(
            g(n(a)), lambda t: ([vocab + 5, -3], [0.5, 0.5])))],
        "dist_ids_probs_mismatch": lambda a, g: [proposal(a, g(n(a)), distributions=dists(
            g(n(a)), lambda t: ([t, 1, 2], [1.0])))],
        "too_few_distributions": lambda a, g: [proposal(a, g(n(a)), distributions=[([g(1)[0]], [1.0])])],
        "token_not_in_its_distribution": lambda a, g: [proposal(a, g(n(a)), distributions=dists(
            g(n(a)), lambda t: ([(t + 1) % vocab], [1.0])))],
        # more tokens than asked for: correct ones (a lax target would emit past max_tokens), and 5,000
        "longer_than_asked": lambda a, g: [proposal(a, g(a.num_speculative_tokens + 8))],
        "five_thousand_tokens": lambda a, g: [proposal(a, g(5000))],
        "five_thousand_siblings": lambda a, g: [proposal(a, _filler(vocab, 5000), parents=[-1] * 5000)],
        # answers addressed to nobody: unknown sequences, rounds from the future and from the past
        "unknown_seq_id": lambda a, g: [proposal(a, g(a.chain_budget), seq_id=f"ghost-{a.seq_id}")],
        "empty_seq_id": lambda a, g: [proposal(a, g(a.chain_budget), seq_id="")],
        "future_round": lambda a, g: [proposal(a, g(a.chain_budget), round_=a.round + 1000)],
        "past_round": lambda a, g: [proposal(a, g(a.chain_budget), round_=(a.round - 1) % 2**64)],
        # the right sequence twice: garbage first, then a valid answer
        "duplicate": lambda a, g: [proposal(a, [-7] * n(a)), proposal(a, g(a.chain_budget))],
        # no tokens, but parents and distributions for them anyway
        "empty_with_junk": lambda a, g: [proposal(a, [], parents=[3, -9], distributions=[([1], [nan])])],
    }


class Malformed(Behaviour):
    """Answers every ``ProposeBatch`` at once, each sequence with the next kind of garbage in turn
    (see :func:`_malformed_kinds`; one kind is a valid, correct proposal), so every kind comes up
    once per ``len(kinds)`` sequences asked about. ``counts`` (kind -> proposals) is filled in."""

    def __init__(self, oracle: Oracle, vocab_size: int):
        self.oracle = oracle
        self.vocab_size = vocab_size
        self.kinds = _malformed_kinds(vocab_size)
        self._next = itertools.cycle(self.kinds)
        self.counts: dict[str, int] = {}

    async def answer(self, asks: list[Ask], stream: StreamState) -> Answer:
        out = []
        for a in asks:
            kind = next(self._next)
            self.counts[kind] = self.counts.get(kind, 0) + 1

            def good(n: int, a: Ask = a) -> list[int]:
                right = self.oracle.continuation(a.context, n)
                return right + _filler(self.vocab_size, n - len(right), len(right))

            out.extend(self.kinds[kind](a, good))
        return [batch(out)]


_END = object()


class HostileDraft(spec_pb2_grpc.DraftServiceServicer):
    """A draft worker that does what ``behaviour`` says; see :func:`hostile_draft`."""

    def __init__(self, behaviour: Behaviour):
        self.behaviour = behaviour
        self.counts = Counts()
        self.draft_id = ""
        self.address = ""
        self._server: grpc.aio.Server | None = None
        self._stack = contextlib.AsyncExitStack()
        self._open = 0  # Speculate handlers still running

    async def start(self, config: RuntimeConfig, model: str) -> None:
        rt = await self._stack.enter_async_context(Runtime.connect(config))
        self.draft_id = rt.instance_id
        # no SO_REUSEPORT: a second server could otherwise bind this port too (grpc/grpc#10755)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        spec_pb2_grpc.add_DraftServiceServicer_to_server(self, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        self.address = f"127.0.0.1:{port}"
        await rt.register_model(ModelCard(name=model, role="draft", spec_method=METHOD,
                                          num_speculative_tokens=self.behaviour.max_num_speculative_tokens))
        await rt.register("draft", "speculate", role="draft", model=model, grpc_address=self.address)
        log.info("hostile draft %s (%s) on %s", self.draft_id, type(self.behaviour).__name__, self.address)

    async def stop(self) -> None:
        """Kill the streams and deregister (idempotent)."""
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
            # let the cancelled handlers finish on this event loop (a test's loop closes after it)
            for _ in range(100):
                if not self._open:
                    break
                await asyncio.sleep(0.01)
        await self._stack.aclose()

    async def Speculate(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802 (gRPC name)
        stream = StreamState(self.counts.streams)
        self.counts.streams += 1
        self._open += 1
        out: asyncio.Queue = asyncio.Queue()
        answering: set[asyncio.Task] = set()

        async def respond(asks: list[Ask]) -> None:
            try:
                items = await self.behaviour.answer(asks, stream)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in the test's behaviour, not hostility: make it visible
                log.exception("hostile draft %s: behaviour failed", self.draft_id)
                return
            if items:
                stream.answers += 1
                self.counts.answers += 1
            for item in items:
                out.put_nowait(item)

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    body = msg.WhichOneof("body")
                    if body == "hello":
                        self.counts.hellos += 1
                        out.put_nowait(spec_pb2.DraftMessage(hello_ack=self.behaviour.hello_ack(msg.hello,
                                                                                                 self.draft_id)))
                    elif body == "propose":
                        self.counts.batches += 1
                        self.counts.asks += len(msg.propose.requests)
                        asks = []
                        for r in msg.propose.requests:
                            seen = stream.contexts.setdefault(r.seq_id, [])
                            seen.extend(r.new_tokens)
                            asks.append(Ask(r.seq_id, r.round, r.num_speculative_tokens, r.max_depth, tuple(seen),
                                            r.sampling.temperature == 0))
                        task = asyncio.create_task(respond(asks))
                        answering.add(task)
                        task.add_done_callback(answering.discard)
                    elif body == "verify":
                        self.counts.verdicts += 1
                    elif body == "release":
                        self.counts.releases += 1
                        for seq_id in msg.release.seq_ids:
                            stream.contexts.pop(seq_id, None)
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                pass
            finally:
                out.put_nowait(_END)

        reader = asyncio.create_task(read())
        try:
            while (item := await out.get()) is not _END:
                if isinstance(item, Abort):
                    self.counts.aborts += 1
                    await context.abort(item.code, item.details)
                yield item
        finally:
            reader.cancel()
            for task in list(answering):
                task.cancel()
            await asyncio.gather(reader, *answering, return_exceptions=True)
            self._open -= 1


@contextlib.asynccontextmanager
async def hostile_draft(config: RuntimeConfig, behaviour: Behaviour, model: str) -> AsyncIterator[HostileDraft]:
    """A registered :class:`HostileDraft` for targets serving ``model``; gone (streams killed,
    lease revoked) when the block exits or after ``await draft.stop()``."""
    draft = HostileDraft(behaviour)
    try:
        await draft.start(config, model)
        yield draft
    finally:
        await draft.stop()
