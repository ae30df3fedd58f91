"""Which draft stream each sequence speculates with, for a target that holds streams to several draft
workers (:class:`.draft_pool.DraftPool` with ``streams`` > 1). Runs on the engine's thread, between
steps; plain values in.

The engine's *default* draft is the pool's primary stream: with one stream every sequence speculates
with it and nothing here places anything. With several, each sequence is placed on one of the
streams that are asking (:attr:`DraftContext.ask`: not backed off):

- a sequence its draft worker already knows stays with it while that stream asks;
- the router's choice for the request (``SpecState.hint``, a draft worker id), when that stream asks;
- otherwise the asking stream holding the fewest sequences (ties: a hash of sequence and draft), so
  each target splits its sequences evenly over its drafts, and a draft's load follows its share;
  among those trained against the request's LoRA adapter (``HelloAck.lora``, the draft's
  ``draft_lora`` key) when there are any, else among the base model's drafts, else among all.

Fit, where the asking streams serve more than one draft method (say suffix and EAGLE-3): each sequence
keeps, per draft it speculated with, its decode steps there and the draft tokens accepted
(``SpecState.fit``). After ``FIT_STEPS`` steps on a draft that gains it under ``EXPLORE_BELOW`` of its
γ a step, it tries a stream of a method it has not tried; once it has tried what there is, it goes to
(or stays with) the draft that gained it most a step, and stays there (``SpecState.settled``) unless
that stream goes. What settled sequences gained on each method adds up (:attr:`Placement.kinds`): a
new sequence starts on the method that has gained most a step so far, and only a sequence it serves
poorly pays for trying the other. So a repetitive request ends on the suffix draft and a chat request on the head, each
by what it measured, and a sequence whose first draft serves it well never moves.

A stream that ended, or was replaced by a new one to the same draft worker (a new incarnation, a
broken stream reopened), takes its sequences with it: they are placed afresh and the draft they move
to hears each from its start (:meth:`~workers.engine.speculator.Speculator.unassign_draft`); nothing
the old stream sent is used. A sequence on a stream that stopped asking (backed off) moves to one
that asks, and its old draft is told to forget it.
"""

from __future__ import annotations

import logging
import zlib
from collections import Counter
from collections.abc import Iterable

from ..engine.speculator import SpecState, Speculator
from .commands import DraftContext

log = logging.getLogger(__name__)

FIT_STEPS = 16  # decode steps on a draft before its fit for a sequence is judged
EXPLORE_BELOW = 0.5  # a draft gaining a sequence less than this share of its γ a step: try another kind


class Placement:
    """Keeps the engine's per-sequence draft placement in step with the target's draft streams."""

    def __init__(self) -> None:
        self.serials: dict[str, int] = {}  # draft id -> the stream the engine's state for it belongs to
        self.moved = 0  # sequences placed on another draft because theirs ended or stopped asking
        self.refits = 0  # sequences placed on another draft by fit (another kind tried, or the best kept)
        # per draft method: [decode steps, draft tokens accepted] of the sequences that settled, on it
        self.kinds: dict[str, list[int]] = {}

    def sync(self, spec: Speculator, contexts: tuple[DraftContext, ...]) -> None:
        """Follow the streams of this cycle: the first is the default draft; a draft whose stream ended
        or changed loses its sequences (placed afresh next)."""
        primary = contexts[0] if contexts else None
        if len(contexts) == 1 and len(self.serials) == 1 and self.serials.get(primary.draft_id) == primary.stream \
                and spec.draft_id == primary.draft_id:  # the same one stream as last cycle: every step
            spec.pipelined = primary.pipelined
            return
        default = primary.draft_id if primary is not None else ""
        live = {c.draft_id: c.stream for c in contexts}
        old = spec.draft_id
        if live != self.serials or default != old:
            if default != old and old in live and live[old] == self.serials.get(old):
                self._pin(spec)  # the old default lives on: its sequences stay with it, by name
            for draft, serial in list(self.serials.items()):
                if live.get(draft) != serial:
                    self.moved += len(spec.unassign_draft(draft))
                    del self.serials[draft]
            if default != old and old not in self.serials:
                spec.unassign_draft(old)  # a default no stream of ours stood for: its sequences start afresh
            self.serials = live
            spec.draft_id = default
        spec.pipelined = primary.pipelined if primary is not None else False

    @staticmethod
    def _pin(spec: Speculator) -> None:
        """Name the default draft on the sequences that speculate with it without a placement."""
        for st in spec.states.values():
            if st.draft is None:
                st.draft, st.pipelined = spec.draft_id, spec.pipelined

    def place(self, spec: Speculator, request_ids: Iterable[str], contexts: tuple[DraftContext, ...]) -> None:
        """Place the sequences ``request_ids`` that need it on the asking streams (see the module)."""
        asking = {c.draft_id: c for c in contexts if c.ask}
        if len(contexts) < 2 or not asking:
            return
        held: Counter[str] = Counter(st.draft for st in spec.states.values() if st.draft in asking)
        for rid in request_ids:
            st = spec.states.get(rid)
            if st is None or st.num_speculative_tokens <= 0:
                continue
            draft = spec.draft_of(st)
            if draft in asking and (st.draft is not None or st.told):
                if st.draft is None:  # known to the default draft: it stays there, by name now
                    spec.assign(rid, draft, asking[draft].pipelined)
                    held[draft] += 1
                better = self._refit(st, draft, _fitting(st, asking), held)
                if better is not None:
                    log.debug("sequence %s: %s -> %s by fit (%s)", rid, draft, better.draft_id, st.fit)
                    self.refits += 1
                    held[draft] -= 1
                    spec.assign(rid, better.draft_id, better.pipelined)
                    held[better.draft_id] += 1
                continue
            choice = asking.get(st.hint) or min(self._best_kind(_fitting(st, asking)).values(),
                                                key=lambda c: (held[c.draft_id], _tie(rid, c.draft_id)))
            if log.isEnabledFor(logging.DEBUG):
                why = ("router's hint" if choice.draft_id == st.hint else
                       f"adapter {st.lora!r}" if st.lora and choice.lora == st.lora else "fewest sequences")
                log.debug("sequence %s on draft %s (%s; was %s)", rid, choice.draft_id, why,
                          draft if st.told else "none")
            if st.told and draft not in asking:
                self.moved += 1
            if st.draft in held:
                held[st.draft] -= 1
            spec.assign(rid, choice.draft_id, choice.pipelined)
            held[choice.draft_id] += 1

    def _best_kind(self, asking: dict[str, DraftContext]) -> dict[str, DraftContext]:
        """The streams of the method that has gained settled sequences most a step (all: none measured)."""
        gains = {m: a / s for m, (s, a) in self.kinds.items() if s >= FIT_STEPS}
        methods = {c.method for c in asking.values()}
        if len(methods) < 2 or not gains.keys() & methods:
            return asking
        best = max(methods, key=lambda m: gains.get(m, -1.0))
        return {d: c for d, c in asking.items() if c.method == best}

    def _refit(self, st: SpecState, draft: str, asking: dict[str, DraftContext], held: Counter) -> DraftContext | None:
        """Another stream for ``st`` by fit (see the module), or None to stay on ``draft`` (``asking``:
        the streams that fit its adapter; on one that does not, it stays: it went there for want of one)."""
        mine = st.fit.get(draft)
        if (st.settled or mine is None or mine[0] < FIT_STEPS or draft not in asking
                or len({c.method for c in asking.values()}) < 2):
            return None
        tried = [d for d, (steps, _) in st.fit.items() if steps >= FIT_STEPS and d in asking]
        score = {d: st.fit[d][1] / st.fit[d][0] for d in tried}
        if score[draft] < EXPLORE_BELOW * st.num_speculative_tokens:
            methods = {asking[d].method for d in tried}
            untried = [c for c in asking.values() if c.method not in methods]
            if untried:
                return min(untried, key=lambda c: held[c.draft_id])
        st.settled = True
        for d in tried:  # what the kinds gained it: new sequences start on the kind that gains most
            kind = self.kinds.setdefault(asking[d].method, [0, 0])
            kind[0] += st.fit[d][0]
            kind[1] += st.fit[d][1]
        best = max(tried, key=score.get)
        return asking[best] if best != draft and score[best] > score[draft] else None


def _fitting(st: SpecState, asking: dict[str, DraftContext]) -> dict[str, DraftContext]:
    """The asking streams for a sequence's adapter: drafts trained against it, else the base model's,
    else every one."""
    if any(c.lora for c in asking.values()):
        for want in (st.lora, ""):
            same = {d: c for d, c in asking.items() if c.lora == want}
            if same:
                return same
    return asking


def _tie(request_id: str, draft_id: str) -> int:
    return zlib.crc32(f"{request_id}/{draft_id}".encode())
