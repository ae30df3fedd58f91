"""Speculative-decoding counters and the one definition of their rates, shared by every process.

Definitions (vLLM's, from ``v1/spec_decode/metrics.py``):

- ``num_drafts``: verification steps that had a draft;
- ``num_draft_tokens``: tokens proposed;
- ``num_accepted_tokens``: proposed tokens the target accepted;
- ``accepted_per_pos[i]``: drafts whose token at position ``i`` was accepted (for a token tree:
  whose accepted path reached depth ``i + 1``);
- acceptance rate = accepted tokens / draft tokens;
- mean accepted length = 1 + accepted tokens / drafts (the ``1`` is the token the target adds
  itself, so this is the tokens one verify step emits).

With no draft tokens (or no drafts) a rate is undefined and reported as absent: ``None`` here, a
missing key in JSON, no sample for a Prometheus gauge. Never 0 or 1, which would read as a real
(and very bad) measurement.

The target worker counts with :meth:`SpecCounters.observe_draft` and publishes cumulative events
(:class:`~runtime.messages.SpecStatsEvent`, from :meth:`SpecCounters.event`); the router rebuilds
counters with :meth:`SpecCounters.of` and subtracts them for windows (:meth:`SpecCounters.add` with
``sign=-1``). Prometheus exports the counters only; rates are computed in PromQL, e.g. per target
over the last minute (the frontend's series have the prefix ``tandem_frontend_``)::

    acceptance rate:
      sum by (target) (rate(tandem_spec_decode_num_accepted_tokens_total[1m]))
        / sum by (target) (rate(tandem_spec_decode_num_draft_tokens_total[1m]))
    mean accepted length:
      1 + sum by (target) (rate(tandem_spec_decode_num_accepted_tokens_total[1m]))
        / sum by (target) (rate(tandem_spec_decode_num_drafts_total[1m]))
    acceptance at position p:
      rate(tandem_spec_decode_num_accepted_tokens_per_pos_total{position="p"}[1m])
        / rate(tandem_spec_decode_num_drafts_total[1m])
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .messages import SpecStatsEvent


def acceptance_rate(accepted: int, draft_tokens: int) -> float | None:
    """Accepted / draft tokens; None when nothing was proposed."""
    return accepted / draft_tokens if draft_tokens else None


def mean_accepted_length(accepted: int, drafts: int) -> float | None:
    """1 + accepted tokens / drafts (tokens per verify step); None when there were no drafts."""
    return 1 + accepted / drafts if drafts else None


@dataclass
class SpecCounters:
    """One set of speculative-decoding counters (cumulative; see the module docstring)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted: int, depth: int | None = None) -> None:
        """One verified proposal of ``num_draft_tokens`` tokens of which ``num_accepted`` were kept: the
        first ones of a chain, or a path of a tree ``depth`` deep (None: a chain, as deep as it is long)."""
        depth = num_draft_tokens if depth is None else depth
        if not 0 <= num_accepted <= depth <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_draft_tokens} draft tokens {depth} deep")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < depth:
            self.accepted_per_pos.extend([0] * (depth - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @classmethod
    def of(cls, event: SpecStatsEvent) -> SpecCounters:
        """The counters an event carries."""
        return cls(event.num_drafts, event.num_draft_tokens, event.num_accepted_tokens, list(event.accepted_per_pos))

    def event(self, target_id: str, draft_id: str, epoch: float, method: str = "") -> SpecStatsEvent:
        """These counters as the cumulative event of one (target, draft) pair, stamped now."""
        return SpecStatsEvent(target_id, draft_id, epoch, self.num_drafts, self.num_draft_tokens,
                              self.num_accepted_tokens, list(self.accepted_per_pos), method, time.time())

    def add(self, other: SpecCounters, sign: int = 1) -> SpecCounters:
        """A new set: ``self + sign * other`` (position lists are padded with zeros)."""
        a, b = self.accepted_per_pos, other.accepted_per_pos
        n = max(len(a), len(b))
        per_pos = [(a[i] if i < len(a) else 0) + sign * (b[i] if i < len(b) else 0) for i in range(n)]
        return SpecCounters(self.num_drafts + sign * other.num_drafts,
                            self.num_draft_tokens + sign * other.num_draft_tokens,
                            self.num_accepted_tokens + sign * other.num_accepted_tokens, per_pos)

    def covers(self, other: SpecCounters) -> bool:
        """True if no counter of ``self`` is below ``other``'s (``self`` is the same or later)."""
        return (self.num_drafts >= other.num_drafts and self.num_draft_tokens >= other.num_draft_tokens
                and self.num_accepted_tokens >= other.num_accepted_tokens)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / draft tokens; None with no draft tokens."""
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float | None:
        """1 + accepted tokens / drafts; None with no drafts."""
        return mean_accepted_length(self.num_accepted_tokens, self.num_drafts)
