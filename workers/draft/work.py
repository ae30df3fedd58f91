"""The draft service's work: the typed messages its batcher takes, and where the drafter's work runs.

Each stream's reader (:class:`.service.DraftService`) turns what its target sends into these
messages, in the order they came, and queues them for the service's one batcher, which takes
everything queued at once and handles it in that order: a verdict is never applied after a later
round's requests, and a release ends only the news that came before it.

- :class:`Requests`: a round's requests from one stream: for each sequence the tokens it committed
  since its last news, and the budget to draft;
- :class:`Verdicts`: what the target made of proposals (accepted, emitted; hidden rows for a head);
- :class:`Release`: sequences the target is done with (all of a stream's, when the stream ended);
- :class:`Weights`: new head weights from online distillation, taken between two drafting calls.

:class:`DrafterCalls` is the one place that decides where the drafter's work runs: on the event
loop for a drafter that drafts in microseconds (``caps.on_loop`` of :class:`.drafter.Capabilities`:
n-gram, suffix), where a thread hop each way would cost more than the work, else in one worker
thread, so that torch runs off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from ..openmp import torch_thread
from ..speculation.payloads import DraftInput, VerifyResult


class Stream(Protocol):
    """The stream a message came on (:class:`.service._Stream`), as far as the batcher tells streams apart."""

    pipelined: bool  # its seam, agreed at its handshake


@dataclass(frozen=True)
class Requests:
    """A round's requests from one stream."""

    stream: Stream
    inputs: list[DraftInput]

    def without(self, gone: set[str]) -> Requests:
        """These requests but those of the sequences in ``gone``."""
        return Requests(self.stream, [d for d in self.inputs if d.seq_id not in gone])


@dataclass(frozen=True)
class Verdicts:
    """The target's verdicts on one stream's proposals."""

    stream: Stream
    results: list[VerifyResult]

    def without(self, gone: set[str]) -> Verdicts:
        """These verdicts but those on the sequences in ``gone``."""
        return Verdicts(self.stream, [r for r in self.results if r.seq_id not in gone])


@dataclass(frozen=True)
class Release:
    """Sequences one stream's target is done with: the drafter forgets them."""

    stream: Stream
    seq_ids: list[str]


@dataclass(frozen=True)
class Weights:
    """New head weights (online distillation): the drafter takes them between two drafting calls."""

    state: object


Work = Requests | Verdicts | Release | Weights
News = Requests | Verdicts  # what a pipelined stream's stager applies in order before it drafts


class DrafterCalls:
    """Runs the drafter's work where it belongs, decided once: here on the event loop (``on_loop``),
    or in one worker thread (``executor``, the thread that loaded the drafter, when given: one
    OpenMP team for its torch work, see :mod:`workers.openmp`; else one made on first use)."""

    def __init__(self, on_loop: bool, executor: ThreadPoolExecutor | None = None):
        self.on_loop = on_loop
        self._executor = executor
        self._own: ThreadPoolExecutor | None = None

    async def run(self, fn, *args):
        """``fn(*args)``, here or in the worker thread; its result."""
        if self.on_loop:
            return fn(*args)
        executor = self._executor
        if executor is None:
            executor = self._own = self._own or torch_thread("draft-torch")
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args))

    def close(self) -> None:
        """Let go of a worker thread made here (one given is its owner's)."""
        if self._own is not None:
            self._own.shutdown(wait=False)
            self._own = None
