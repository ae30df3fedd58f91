"""Speculative-decoding counters of one target worker, per draft worker.

Counters only grow; they are published as cumulative :class:`runtime.messages.SpecStatsEvent`s (one
per (target, draft) pair, with the target's start time as epoch), so a router that misses events or
starts late still aggregates exactly. Acceptance rate = accepted / draft tokens; mean accepted
length = 1 + accepted / drafts (the tokens one verify step emits).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runtime.messages import SpecStatsEvent


@dataclass
class SpecCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified proposal of ``num_draft_tokens`` tokens of which the first ``num_accepted`` were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def event(self, target_id: str, draft_id: str, epoch: float, method: str = "") -> SpecStatsEvent:
        return SpecStatsEvent(target_id, draft_id, epoch, self.num_drafts, self.num_draft_tokens,
                              self.num_accepted_tokens, list(self.accepted_per_pos), method, time.time())
