"""The pipelined seam's reconciliation: which streamed proposal a step may use. Pure Python: no torch,
no gRPC, no clock.

Under the pipelined seam a draft worker streams proposals ahead of the target. Each names the
committed prefix it assumes: its first token would be token number ``start`` of the sequence, and
``assumed`` are the last tokens before that position (at least every token the draft has not seen
committed). Committed tokens never change, so a proposal *fits* a sequence whose committed tokens
are ``c`` when

- ``start <= len(c)`` and ``c[start - len(assumed) : start] == assumed`` (the prefix it assumed is
  the one committed: position and tokens), and
- the ``over = len(c) - start`` tokens committed since ``start`` equal its first ``over`` tokens
  (``over == 0``: it starts exactly where the sequence ends; ``over > 0``: the target committed some
  of its tokens on its own, a partial overlap, and the rest of the proposal is still a draft of what
  follows), with at least one token left. A tree fits only exactly (``over == 0``).

A fitting proposal is trimmed to the tokens after the committed ones (:func:`trimmed`). Using it is
lossless whatever was guessed: each remaining token was drawn from its distribution given exactly
the tokens before it, which are now committed, and the choice among fitting proposals looks only at
tokens already committed and at lengths, never at the tokens it lets the target verify.

:class:`Staged` keeps, per sequence, the freshest few proposals received and hands out the best one
that fits (the most usable tokens; the freshest on a tie). Proposals that can no longer fit (the
sequence moved past them, or committed something else) are dropped and counted as ``stale``: a guess
that did not come true is no fault of the draft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

from .payloads import DraftOutput

ASSUMED_MAX = 64  # most assumed tokens a proposal may carry
KEEP = 32  # proposals kept per sequence (a round's staged branches: (γ + 1) × a few guesses)
SPARE_MAX = 4  # tokens a streamed proposal may carry past γ (it may arrive after a few plain steps)


@dataclass
class StagedUse:
    """What the target saw of a pipelined draft's proposals: sequence steps that had streamed proposals
    to look through (``looked``) and those that found one that fits (``found``); sound proposals kept
    (``arrived``) and those drafted from news too old to keep up (``late``). Counts add and subtract
    (a step's share is the counts after it minus those before)."""

    looked: int = 0
    found: int = 0
    arrived: int = 0
    late: int = 0

    def __add__(self, other: StagedUse) -> StagedUse:
        return StagedUse(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: StagedUse) -> StagedUse:
        return StagedUse(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


def position_problem(prop: DraftOutput, vocab_size: int) -> str | None:
    """Why a streamed proposal's position cannot be right for any sequence (None: it may fit)."""
    if prop.start <= 0:
        return "position"
    if len(prop.assumed) > min(prop.start, ASSUMED_MAX) or any(not 0 <= t < vocab_size for t in prop.assumed):
        return "assumed"
    return None


def overlap(prop: DraftOutput, committed: Sequence[int]) -> int | None:
    """How many of ``prop``'s leading tokens are already committed when it fits ``committed`` (the
    sequence's committed tokens), None when it does not fit (see the module docstring)."""
    start, n, assumed = prop.start, len(committed), prop.assumed
    if start <= 0 or start > n or len(assumed) > start:
        return None
    if list(committed[start - len(assumed) : start]) != list(assumed):
        return None
    over = n - start
    if over == 0:
        return 0 if prop.token_ids else None
    if prop.is_tree or over >= len(prop.token_ids):
        return None
    return over if list(committed[start:n]) == list(prop.token_ids[:over]) else None


def one_ahead(prop: DraftOutput, committed: Sequence[int]) -> bool:
    """Whether ``prop`` would fit once the target commits one more token, the one it assumes last
    (what it does in a plain step when that guess is right)."""
    start, assumed = prop.start, prop.assumed
    if start != len(committed) + 1 or not assumed or len(assumed) > start:
        return False
    before = assumed[:-1]
    return list(committed[len(committed) - len(before) :]) == list(before) if before else True


def trimmed(prop: DraftOutput, over: int) -> DraftOutput:
    """``prop`` without its first ``over`` tokens (already committed), positioned after them."""
    if over == 0:
        return prop
    return replace(prop, token_ids=prop.token_ids[over:], distributions=prop.distributions[over:],
                   parents=[], start=prop.start + over, assumed=list(prop.token_ids[:over]),
                   confidence=given(prop.confidence, over))


def given(confidence: Sequence[float], over: int) -> list[float]:
    """A chain's cumulative confidences after its first ``over`` tokens came true: each conditional on
    them (divided by the ``over``-th), at most 1; empty stays empty (no estimate)."""
    if not confidence or over <= 0:
        return list(confidence)
    base = confidence[over - 1]
    return [min(1.0, c / base) if base > 0 else 0.0 for c in confidence[over:]]


class Staged:
    """The freshest proposals received per sequence, and the one a step may use; plain values in."""

    def __init__(self, keep: int = KEEP, on_drop: Callable[[str], None] | None = None):
        if keep <= 0:
            raise ValueError(f"keep must be positive, got {keep}")
        self.keep = keep
        self._by_seq: dict[str, list[DraftOutput]] = {}  # oldest first
        self.dropped: dict[str, int] = {}  # proposals given up, by why (stale, overflow)
        self._on_drop = on_drop

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_seq.values())

    def offer(self, prop: DraftOutput) -> None:
        """Keep ``prop`` (already checked); the oldest of its sequence's go past ``keep``."""
        props = self._by_seq.setdefault(prop.seq_id, [])
        props.append(prop)
        if len(props) > self.keep:
            del props[0]
            self._count("overflow")

    def has(self, seq_id: str) -> bool:
        """Whether any proposal is kept for ``seq_id`` (fitting or not)."""
        return bool(self._by_seq.get(seq_id))

    def take(self, seq_id: str, committed: Sequence[int]) -> DraftOutput | None:
        """The proposal that fits ``committed`` with the most usable tokens (the freshest on a tie),
        trimmed; proposals that can no longer fit are dropped. It stays kept: a step that does not
        verify it (cut away, preempted) may use it next time."""
        props = self._by_seq.get(seq_id)
        if not props:
            return None
        n = len(committed)
        best, best_left = None, 0
        keep = []
        for prop in props:
            if prop.start > n:  # assumes tokens not committed yet: a later step may use it
                keep.append(prop)
                continue
            over = overlap(prop, committed)
            if over is None:
                self._count("stale")
                continue
            keep.append(prop)
            left = len(prop.token_ids) - over
            if left >= best_left:
                best, best_left = trimmed(prop, over), left
        self._by_seq[seq_id] = keep
        return best

    def drop(self, seq_id: str) -> None:
        """Forget a sequence (it finished, or the draft worker changed)."""
        self._by_seq.pop(seq_id, None)

    def clear(self) -> None:
        self._by_seq.clear()

    def _count(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1
        if self._on_drop is not None:
            self._on_drop(why)
