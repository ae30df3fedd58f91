"""Load-aware speculation: how many draft tokens each sequence gets this step, from measured costs.

Speculation trades target compute for fewer steps. At batch 1 on a memory-bound GPU a verify pass
costs what a decode step does and drafts are nearly free; in a big batch (or on a CPU) every draft
token costs compute, and drafts the target rejects only slow the batch down. So the target measures
its own steps and decides.

- **Cost model**: step time ≈ a + b · n for n query tokens in the forward pass, fitted by
  exponentially weighted least squares over recent steps (:class:`StepCost`), plus the time a step
  spends waiting for proposals (an EWMA), paid only when the step speculates at all.
- **Acceptance**: each sequence's per-token acceptance α (the draft token is accepted given the ones
  before it were), from weighted success/failure counts of its recent rounds (:class:`Acceptance`).
  A chain of k drafts then emits 1 + α + α² + … + α^k tokens on average; the j-th draft adds α^j.
- **Plan** (:func:`plan`): start from no drafts (every decoding sequence emits one token per step)
  and add draft tokens one at a time, the one with the largest expected gain first, while the gain
  per extra unit of step time beats the rate the step already has; the first draft of the step also
  pays the proposal wait. Then compare with not speculating at all and keep the better. The result is
  the γ of each sequence for this step, never above the sequence's own cap (adaptive γ, the request's
  γ, tokens left).

This maximises expected emitted tokens per second of the whole batch, under the linear cost model.
With too few measurements the plan is the caps themselves (no opinion yet).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass


@dataclass
class StepCost:
    """Step seconds ≈ a + b · tokens, fitted by least squares with weights decaying by ``decay`` per step."""

    decay: float = 0.97
    min_samples: int = 8
    _sw: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    samples: int = 0
    wait: float = 0.0  # EWMA of seconds a speculating step waits for its proposals

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._sw = d * self._sw + 1
        self._sx = d * self._sx + tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + tokens * tokens
        self._sxy = d * self._sxy + tokens * seconds
        self.samples += 1

    def observe_wait(self, seconds: float) -> None:
        self.wait = seconds if self.wait == 0 else 0.8 * self.wait + 0.2 * seconds

    @property
    def ready(self) -> bool:
        return self.samples >= self.min_samples

    def coefficients(self) -> tuple[float, float]:
        """(a, b): fixed seconds per step and seconds per query token (b ≥ 0, a ≥ 0)."""
        if self._sw == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._sx / self._sw, self._sy / self._sw
        var = self._sxx / self._sw - mean_x * mean_x
        b = (self._sxy / self._sw - mean_x * mean_y) / var if var > 1e-9 else 0.0
        b = max(b, 0.0)
        return max(mean_y - b * mean_x, 0.0), b

    def seconds(self, tokens: int, speculating: bool) -> float:
        a, b = self.coefficients()
        return a + b * tokens + (self.wait if speculating else 0.0)


@dataclass
class Acceptance:
    """Per-token acceptance α of one sequence's drafts: decayed counts of accepted and rejected drafts."""

    accepted: float = 1.0  # a weak prior of α = 0.5
    rejected: float = 1.0
    decay: float = 0.8

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < drafted else 0)

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step emits on average with k chained drafts of per-token acceptance α."""
    return sum(alpha ** j for j in range(k + 1))


def plan(caps: dict[str, int], alphas: dict[str, float], base_tokens: int, cost: StepCost) -> dict[str, int]:
    """γ per sequence for this step (see the module docstring). ``caps``: the most each may draft;
    ``base_tokens``: query tokens the step runs anyway (one per decoding sequence, prefill chunks)."""
    if not cost.ready or not caps:
        return dict(caps)
    gamma = {sid: 0 for sid in caps}
    emitted = float(len(caps))  # without drafts each decoding sequence emits one token
    tokens = base_tokens
    best_rate, best = emitted / max(cost.seconds(tokens, False), 1e-9), dict(gamma)
    heap = [(-alphas[sid], sid) for sid, cap in caps.items() if cap > 0 and alphas[sid] > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, sid = heapq.heappop(heap)
        emitted += -neg_gain
        tokens += 1
        gamma[sid] += 1
        rate = emitted / max(cost.seconds(tokens, True), 1e-9)
        if rate > best_rate * (1 + 1e-6):
            best_rate, best = rate, dict(gamma)
        if gamma[sid] < caps[sid]:
            next_gain = alphas[sid] ** (gamma[sid] + 1)
            if next_gain > 0 and not math.isclose(next_gain, 0.0):
                heapq.heappush(heap, (-next_gain, sid))
    return best
