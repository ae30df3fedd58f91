"""Draft workers of several kinds side by side: ``tandem up --draft-kinds suffix:1,eagle3=HEAD:2``.

A kind is a draft method, optionally the draft model or head directory it runs, and how many workers
of it the stack starts: ``METHOD[=PATH][:COUNT]`` (COUNT 1 when left out), kinds separated by commas.
Every worker of a kind gets that method and path, and of ``--speculative-config`` the keys that apply
to it (one method's keys are left out of another's workers).

When a planner grows the pool, the launcher starts the kind furthest below its share of the pool
(fewest running for the count asked for: :func:`kind_to_add`), the first kind named among equals, so the
pool keeps the proportions the operator asked for and a kind that lost workers is made up first. When
it shrinks the pool, the planner's choice goes first (least loaded), but the last worker of a kind
goes only after every other (:func:`pick_victims`), so every kind keeps serving while the pool can.

Pure functions of plain values: no processes, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from workers.speculation.methods import HEAD_METHODS, METHODS

FLAG = "--draft-kinds"
# the --speculative-config key prefixes that belong to one method only
METHOD_KEYS = (("prompt_lookup_", "ngram"), ("suffix_decoding_", "suffix"), ("oracle_", "oracle"))


@dataclass(frozen=True)
class DraftKind:
    """Draft workers of one method (and model or head directory), ``count`` of them at start."""

    method: str
    model: str | None = None  # draft model or head directory (draft_model and the heads)
    count: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"{FLAG}: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.count < 1:
            raise ValueError(f"{FLAG}: {self.label} needs a count of at least 1, got {self.count}")
        if self.model is not None and self.method not in ("draft_model", *HEAD_METHODS):
            raise ValueError(f"{FLAG}: {self.method} takes no model or head path (got {self.model!r})")
        if self.model is not None and not self.model:
            raise ValueError(f"{FLAG}: {self.method}= needs a path after '='")

    @property
    def label(self) -> str:
        """How the kind is named: ``suffix``, ``eagle3=/heads/a`` (the flag's words without the count)."""
        return self.method if self.model is None else f"{self.method}={self.model}"

    @property
    def reads_hidden_states(self) -> bool:
        return self.method in HEAD_METHODS

    def speculative_keys(self, keys: dict) -> dict:
        """Of ``keys`` (``--speculative-config``'s), those a worker of this kind may be given: another
        method's own keys (``suffix_decoding_*`` for an eagle3 worker, ...) are left out."""
        return {key: value for key, value in keys.items()
                if not any(key.startswith(prefix) and owner != self.method for prefix, owner in METHOD_KEYS)}


def parse_draft_kinds(text: str) -> tuple[DraftKind, ...]:
    """``"suffix:1,eagle3=/heads/a:2"`` -> the kinds, in order; ``ValueError`` naming the bad part."""
    kinds: list[DraftKind] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ValueError(f"{FLAG} {text!r}: an empty kind (write METHOD[=PATH][:COUNT], comma-separated)")
        spec, sep, count = item.rpartition(":")
        if not sep or not count.strip().isdigit():  # no count (or a ':' inside a path)
            spec, count = item, "1"
        method, eq, model = spec.partition("=")
        kinds.append(DraftKind(method.strip(), model.strip() if eq else None, int(count)))
    labels = [k.label for k in kinds]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(f"{FLAG}: {', '.join(twice)} named twice (give one kind a count instead)")
    return tuple(kinds)


def format_draft_kinds(kinds: Sequence[DraftKind]) -> str:
    """The flag's text for ``kinds`` (what :func:`parse_draft_kinds` reads back)."""
    return ",".join(f"{k.label}:{k.count}" for k in kinds)


def kind_to_add(kinds: Sequence[DraftKind], running: dict[str, int]) -> DraftKind:
    """The kind a grown pool adds: the one with the fewest running (``running``: label -> workers) for
    its count, the first named among equals."""
    return min(kinds, key=lambda k: running.get(k.label, 0) / k.count)  # min keeps the first of equals


def pick_victims(active: Sequence[tuple[str, str]], count: int, rank: Callable[[str], int]) -> list[str]:
    """``count`` of ``active`` (``(name, kind label)``, oldest first) to stop: the last of a kind after
    every other, then the lowest ``rank`` (the planner's order), then the newest."""
    left = list(enumerate(active))
    per_kind: dict[str, int] = {}
    for _, (_, label) in left:
        per_kind[label] = per_kind.get(label, 0) + 1
    out: list[str] = []
    for _ in range(min(count, len(left))):
        i, (name, label) = min(left, key=lambda e: (per_kind[e[1][1]] == 1, rank(e[1][0]), -e[0]))
        left.remove((i, (name, label)))
        per_kind[label] -= 1
        out.append(name)
    return out
