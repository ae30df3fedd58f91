"""The seam to one draft stream, chosen once at its handshake: synchronous or pipelined.

A :class:`~.draft_client.DraftClient` builds one seam object when its handshake agrees on the mode
(the target asks for the pipelined seam in ``Hello.pipelined``, the draft serves it when it says so
in ``HelloAck.pipelined``), and the step loop talks to the draft through it for the stream's
lifetime; nothing asks again which mode a stream runs. Both seams have one face:

- :meth:`flush` before a step (the pipelined seam hands the previous step's news to the stream's
  writer; the synchronous one has nothing to hand over);
- :meth:`collect` at the start of a step: :class:`Proposals`, the answers to the round asked
  (synchronous: waited for up to a deadline) or every proposal streamed since the last step
  (pipelined: nothing waited for);
- :meth:`news` after a step: its verdicts, released sequences and the next round's requests, sent on
  the stream; True when the step loop should give the stream's writer one turn of the event loop;
- :attr:`prompts_early` and :meth:`send_prompts`: the pipelined seam to a draft that reads no hidden
  states hears new requests' prompts from the engine's thread, before their prefill.

What a seam needs of its stream is :class:`DraftStream` (``DraftClient``; test fakes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from ..speculation.hidden_plane import PlaneWriter
from ..speculation.payloads import DraftOutput

log = logging.getLogger(__name__)


@dataclass
class Proposals:
    """What a step takes from the draft: ``answers`` to the round asked, by sequence id (synchronous
    seam), or ``streamed``, every proposal streamed since the last step, oldest first (pipelined seam:
    checked and kept until they fit); and the round's figures for :class:`~.draft_watch.DraftWatch`."""

    answers: dict[str, DraftOutput] = field(default_factory=dict)
    streamed: list[DraftOutput] = field(default_factory=list)
    asked: int = 0  # sequences of the round waited for (synchronous seam)
    # of those, answered in time; pipelined: the sequences asked at the end of the previous step (a
    # streamed round counts as arrived whole: nothing is waited for)
    arrived: int = 0
    waited: float = 0.0  # seconds spent waiting for them


class DraftStream(Protocol):
    """What a seam uses of its draft stream (:class:`~.draft_client.DraftClient`)."""

    broken: bool
    hidden_layers: list[int]

    def news(self, verdicts: list, released: list[str], requests: list) -> dict[str, asyncio.Future]: ...

    async def collect(self, futures: dict[str, asyncio.Future], timeout: float) -> dict[str, DraftOutput]: ...

    def take(self) -> list[DraftOutput]: ...

    async def flush(self, timeout: float) -> bool: ...


class SynchronousSeam:
    """The target asks a round of proposals after each step and waits for the answers (up to a
    deadline) before the next one."""

    pipelined = False
    prompts_early = False

    def __init__(self, stream: DraftStream, plane: PlaneWriter | None = None):
        self.stream = stream
        self.plane = plane  # the hidden-state data plane agreed at the handshake (None: inline)
        self._pending: dict[str, asyncio.Future] = {}  # the round asked after the last step

    async def flush(self, timeout: float) -> float:
        """Nothing to hand over: the round's answers are awaited in :meth:`collect`. Seconds spent: 0."""
        return 0.0

    async def collect(self, deadline: float) -> Proposals:
        """The answers to the round asked after the last step that arrive within ``deadline`` seconds."""
        pending, self._pending = self._pending, {}
        if not pending:
            return Proposals()
        started = time.perf_counter()
        try:
            got = await self.stream.collect(pending, deadline)
        except Exception as exc:  # speculation is optional: decode plainly this step
            log.warning("draft proposals failed: %r", exc)
            got = {}
        waited = time.perf_counter() - started
        if len(got) < len(pending):
            log.debug("draft round: %d of %d proposals within the %.1f ms deadline (waited %.1f ms)", len(got),
                      len(pending), 1e3 * deadline, 1e3 * waited)
        return Proposals(answers=got, asked=len(pending), arrived=len(got), waited=waited)

    def news(self, verdicts: list, released: list[str], requests: list) -> bool:
        """Send a step's news; its requests are the round :meth:`collect` waits for next. False: the
        answers are awaited anyway, no turn of the event loop is worth giving the writer now."""
        if not self.stream.broken:
            self._pending = self.stream.news(verdicts, released, requests)
        return False

    def forget(self) -> None:
        """Give up the round asked (its sequences are gone, or the loop starts afresh)."""
        self._pending = {}

    def send_prompts(self, requests: list) -> None:
        raise RuntimeError("the synchronous seam sends no prompts ahead")


class PipelinedSeam:
    """The draft streams proposals ahead (see :mod:`workers.speculation.staging`); the target takes
    whatever has arrived at each step and waits for nothing."""

    pipelined = True

    def __init__(self, stream: DraftStream, plane: PlaneWriter | None = None):
        self.stream = stream
        self.plane = plane
        self._streamed = 0  # sequences asked at the end of the previous step
        self._loop = asyncio.get_running_loop()  # where the engine's thread hands prompts (send_prompts)

    @property
    def prompts_early(self) -> bool:
        """A draft that reads no hidden states can hear a new request's prompt before its prefill."""
        return not self.stream.hidden_layers

    async def flush(self, timeout: float) -> float:
        """The last step's verdicts and round requests leave before this step takes the interpreter
        (normally taken already: the step loop gives the writer a turn after :meth:`news`). Seconds spent."""
        started = time.perf_counter()
        await self.stream.flush(timeout)
        return time.perf_counter() - started

    async def collect(self, deadline: float) -> Proposals:
        """Every proposal streamed since the last step, at once; ``deadline`` is unused (nothing is
        waited for: a round counts as arrived whole, and malformed proposals strike; a draft whose
        proposals fit too few steps is backed off by use, see the step loop)."""
        asked, self._streamed = self._streamed, 0
        return Proposals(streamed=self.stream.take() if not self.stream.broken else [], arrived=asked)

    def news(self, verdicts: list, released: list[str], requests: list) -> bool:
        """Send a step's news; True when anything went (then one turn of the event loop lets gRPC take
        it, and on a fast lane, where it is written at once, lets a fast draft's proposals in before
        the next step: 429-446 drafts verified against 392 without it, tiny target, n-gram)."""
        if self.stream.broken:
            return False
        self.stream.news(verdicts, released, requests)
        self._streamed = len(requests)
        return bool(verdicts or released or requests)

    def forget(self) -> None:
        """Nothing is pending: streamed proposals for sequences that are gone are dropped by the engine."""

    def send_prompts(self, requests: list) -> None:
        """New requests' prompts (converted), from the engine's thread: sent on the event loop."""
        self._loop.call_soon_threadsafe(self.stream.news, [], [], requests)


Seam = SynchronousSeam | PipelinedSeam
