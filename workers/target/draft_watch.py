"""How long a target waits for its draft worker, and when it stops asking: judged from its own steps.

A proposal is worth waiting for only while it arrives in about the time a few steps take: waiting
w for a round that saves at most γ steps pays only if w is well under γ steps, and a draft that
needs longer costs more than speculation can win back. So the deadline for a round of proposals is
``factor`` (3) × the target's recent decode step time (an exponential average of its own step
durations), at least ``min_wait`` (20 ms: a loopback gRPC round trip on a busy host) and at most
``max_wait`` (``--propose-timeout``). Sequences whose proposal misses it decode plainly that step.

A round *fails* when most of its proposals missed the deadline, or when the target dropped any of
them as malformed (:mod:`workers.speculation.checks`). After ``strikes`` failed rounds in a row the
draft is put on a backoff: no proposals are asked for (everything decodes plainly) for
``backoff_base`` seconds, doubling with every backoff in a row up to ``backoff_max``; then one
round probes it again. A good round clears the strikes and the backoff. So a slow, silent or
garbage-sending draft costs a few deadlines now and then, not a timeout per step.

Under the pipelined seam nothing is waited for, so the deadline is unused: the step loop reports
every round as arrived, and malformed proposals (dropped as they are offered) strike as above. A
late draft costs no wait there, but asking still costs the target every step (the news, the hidden
rows an EAGLE head reads, and on shared hardware the draft's own work). So the pipelined seam is
judged by use (:meth:`DraftWatch.observe_staged`): over every ``staged_window`` sequence steps for
which proposals had been streamed, if under ``staged_min_use`` of them found one that fits, the
draft is backed off as above when

- at least half the proposals that arrived meanwhile came late (drafted from news too old to keep
  up: :data:`workers.engine.speculator.LATE_ROUNDS`): a draft that always arrives after the target
  has moved on, such as an EAGLE head staging on a target that steps faster than it drafts; or
- the draft reads hidden states: asking it costs the target the hidden rows of every token, and a
  head that keeps up yet never fits is broken, not unlucky.

A draft that reads no hidden states, keeps up and guesses wrong (a suffix draft before its tree
holds anything like the text) is not backed off: asking it costs the news alone, and its next
request may be the repeat it exists for; each request's acceptance is its measure. Sequences for
which nothing was streamed (an n-gram draft with no match) do not count.
"""

from __future__ import annotations

import logging
import time

from runtime.backoff import backoff_delay

from ..speculation.staging import StagedUse

log = logging.getLogger(__name__)


class DraftWatch:
    """Deadline and backoff for one target's draft stream; plain values in."""

    def __init__(self, max_wait: float = 2.0, *, min_wait: float = 0.02, factor: float = 3.0,
                 first_wait: float = 0.25, strikes: int = 3, backoff_base: float = 0.5, backoff_max: float = 30.0,
                 staged_window: int = 64, staged_min_use: float = 0.02, clock=time.monotonic):
        if max_wait <= 0 or min_wait <= 0 or factor <= 0 or strikes <= 0:
            raise ValueError("max_wait, min_wait, factor and strikes must be positive")
        self.max_wait = max_wait
        self.min_wait = min(min_wait, max_wait)
        self.factor = factor
        self.first_wait = min(first_wait, max_wait)
        self.strikes = strikes
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.staged_window = staged_window
        self.staged_min_use = staged_min_use
        self._clock = clock
        self._window = StagedUse()  # pipelined: what the current window saw of streamed proposals
        self._unused = 0  # pipelined: backoffs for want of use in a row (their own doubling: rounds that
        # arrive whole, as every pipelined round does, say nothing of use)
        self.step_seconds: float | None = None  # exponential average of decode/verify steps
        self._failed_rounds = 0
        self._backoffs = 0  # backoffs in a row
        self._until = 0.0  # no proposals before this time
        # counters (metrics)
        self.rounds = 0
        self.late_rounds = 0
        self.bad_rounds = 0
        self.backoffs_total = 0

    def observe_step(self, seconds: float) -> None:
        """One decode/verify step of the target took ``seconds`` (prefill steps are not the pace)."""
        self.step_seconds = seconds if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * seconds

    def deadline(self) -> float:
        """Seconds to wait for a round of proposals."""
        if self.step_seconds is None:
            return self.first_wait
        return min(self.max_wait, max(self.min_wait, self.factor * self.step_seconds))

    def allowed(self) -> bool:
        """Whether to ask for proposals now (False while the draft is backed off)."""
        return self._clock() >= self._until

    @property
    def backed_off(self) -> bool:
        return not self.allowed()

    def observe_round(self, asked: int, arrived: int, dropped: int) -> None:
        """A round asked ``asked`` sequences; ``arrived`` proposals came by the deadline, of which the
        target dropped ``dropped`` as malformed."""
        if asked <= 0:
            return
        self.rounds += 1
        late = 2 * arrived < asked
        if late:
            self.late_rounds += 1
        if dropped:
            self.bad_rounds += 1
        if not late and not dropped:
            self._failed_rounds = 0
            self._backoffs = 0
            return
        self._failed_rounds += 1
        if self._failed_rounds >= self.strikes:
            self._failed_rounds = 0
            wait = backoff_delay(self._backoffs, self.backoff_base, self.backoff_max)
            self._backoffs += 1
            self._back_off(wait, "too slow or silent" if late else "sends malformed proposals",
                           f"deadline {1e3 * self.deadline():.1f} ms")

    def observe_staged(self, use: StagedUse, reads_hidden: bool) -> None:
        """Pipelined seam, one step: what it saw of the streamed proposals (``use``: sequences that had
        some to look through, those that found one that fits; proposals kept, those that came late);
        ``reads_hidden``: the draft reads hidden states. Every ``staged_window`` sequence steps that
        had proposals are judged: a window under ``staged_min_use`` whose arrivals were at least half late,
        or any such window of a draft that reads hidden states, backs the draft off (doubling with
        each such window in a row, apart from the late rounds' doubling); one at or above it clears
        that doubling; one under it of a draft that keeps up and reads no hidden states does neither."""
        w = self._window = self._window + use
        if w.looked < self.staged_window:
            return
        fits, late_share = w.found / w.looked, w.late / max(w.arrived, 1)
        self._window = StagedUse()
        if fits >= self.staged_min_use:
            self._unused = 0
            return
        late = late_share >= 0.5
        if not late and not reads_hidden:  # it keeps up, guesses wrong, and asking it costs little
            return
        wait = backoff_delay(self._unused, self.backoff_base, self.backoff_max)
        self._unused += 1
        self._back_off(wait, "streams proposals too late to fit a step" if late else
                       "streams proposals on time that fit no step (hidden states are sent for nothing)",
                       f"{100 * fits:.1f} % of sequence steps found one, {100 * late_share:.0f} % of proposals late")

    def _back_off(self, wait: float, why: str, detail: str) -> None:
        self.backoffs_total += 1
        self._until = self._clock() + wait
        log.warning("draft worker %s: decoding plainly for %.1f s (step %.1f ms, %s)", why, wait,
                    1e3 * (self.step_seconds or 0.0), detail)

    def reset(self) -> None:
        """A different draft worker: no strikes, no backoff."""
        self._failed_rounds = self._backoffs = 0
        self._window = StagedUse()
        self._unused = 0
        self._until = 0.0
