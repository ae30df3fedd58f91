"""What a target's step loop is handed and hands back: the commands request handlers queue for the
engine's thread (:class:`AddRequest`, :class:`AbortRequest`, :class:`EngineCall`), what a cycle needs
of the current draft stream (:class:`DraftContext`), and what one cycle produced (:class:`Cycle`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from runtime.messages import KvEvent, SamplingParams, TokenDelta

from ..engine.engine import Engine
from ..engine.grammar import Grammar
from ..speculation.staging import StagedUse

NO_USE = StagedUse()  # nothing seen of a stream's proposals (shared: read only)


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_speculative_tokens: int | None = None  # None: the engine's default γ
    tree: tuple[int | None, int | None] = (None, None)  # (top-k, depth); None: the engine's setting
    grammar: Grammar | None = None  # params.structured, compiled off the loop
    prefill_only: bool = False  # a prefill worker's request: its last delta carries the KV handoff
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    priority: int = 0  # vLLM's (lower first), read by an engine with the priority scheduling policy
    draft: str = ""  # the draft worker the router chose for it ("": the target places it)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class EngineCall:
    """Run ``fn(engine)`` on the engine's thread between steps; its result (or exception) goes to ``future``."""

    fn: Callable[[Engine], object]
    future: asyncio.Future


Command = AddRequest | AbortRequest | EngineCall


@dataclass(frozen=True)
class DraftContext:
    """What a cycle needs of the current draft stream: its draft worker's id, the stream (a new one,
    even to the same worker, knows none of the engine's sequences: a change resets the engine's
    drafts), the hidden layers it reads and the dtype it takes them in, and whether to ask it this round."""

    draft_id: str
    layers: tuple[int, ...]
    dtype: str
    ask: bool
    pipelined: bool = False  # the stream's seam, fixed at its handshake: proposals streamed ahead, none awaited
    plane: object = None  # the hidden-state data plane's writer (workers.speculation.hidden_plane); None: inline
    # pipelined, a draft that reads no hidden states: sends requests (converted) on the stream from the
    # engine's thread, ahead of the cycle's news (new requests' prompts, before their prefill)
    early: Callable[[list], None] | None = None
    stream: int = 0  # the stream's serial number (DraftClient.serial): one per stream the target opened
    method: str = ""  # the draft method it serves (placement compares the kinds' fit per sequence)
    lora: str = ""  # the LoRA adapter its head was trained against ("": the base model)


@dataclass(slots=True)
class StreamNews:
    """One draft stream's share of a cycle: what goes to it after the step (each a list once there is
    any), and what the step saw of its proposals."""

    verdicts: Sequence = ()  # spec_pb2.VerifyOutcome
    released: Sequence[str] = ()
    requests: Sequence = ()  # spec_pb2.ProposeRequest
    dropped: int = 0  # its proposals the engine refused as malformed this step
    staged: StagedUse = field(default_factory=lambda: NO_USE)  # pipelined: what this cycle saw of its proposals


@dataclass
class Cycle:
    """What one cycle on the engine's thread produced."""

    results: list[tuple[Command, object, BaseException | None]] = field(default_factory=list)
    outputs: list[tuple[str, TokenDelta]] = field(default_factory=list)
    failed: list[tuple[str, BaseException]] = field(default_factory=list)  # requests to fail, and why
    stepped: bool = False
    decode_seconds: float = 0.0  # the step, when it was a decode/verify step (the draft's pace)
    news: dict[int, StreamNews] = field(default_factory=dict)  # per draft stream (its serial)
    kv_events: list[KvEvent] = field(default_factory=list)
    has_work: bool = False
    handoffs: dict = field(default_factory=dict)  # request id -> KvHandoff (prefill role)
