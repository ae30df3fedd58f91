"""Load-aware speculation: how many draft tokens each sequence gets this step, from measured costs.

Speculation trades target compute for fewer steps. At batch 1 on a memory-bound GPU a verify pass
costs what a decode step does and drafts are nearly free; in a big batch (or on a CPU) every draft
token costs compute, and drafts the target rejects only slow the batch down. So the target measures
its own steps and decides.

- **Cost model**: decode/verify step time ≈ a + b · n + c · v + d · [v > 0] for n query tokens of
  which v sequences verify drafts (c: the per-sequence work of verifying — distributions, rejection
  sampling, commits, the proposal's share of the RPC; d: what speculating at all costs a step — the
  proposal round trip), fitted by exponentially weighted least squares over recent steps without
  prefill chunks (:class:`StepCost`). The target's step loop times whole cycles (proposals, the
  step, delivery), so the draft's share of this machine is in the fit too.
- **Acceptance**: each sequence's per-token acceptance α (the draft token is accepted given the ones
  before it were), from weighted success/failure counts of its recent rounds (:class:`Acceptance`);
  a new sequence starts from the engine-wide estimate.
  A chain of k drafts then emits 1 + α + α² + … + α^k tokens on average; the j-th draft adds α^j.
- **Plan** (:func:`plan`): start from no drafts (every decoding sequence emits one token per step)
  and add draft tokens one at a time, the one with the largest expected gain first, keeping the
  prefix with the best expected rate (a sequence's first draft also pays c, the step's first d). A plan must beat not speculating at all by ``MARGIN`` (3 %) to be used,
  so that noise in the model does not buy speculation that does not pay. The result is the γ of
  each sequence for this step, never above the sequence's own cap (adaptive γ, the request's γ,
  tokens left).

This maximises expected emitted tokens per second of the whole batch, under the linear cost model.
With too few measurements the plan is the caps themselves (no opinion yet). The model is checked
against what the engine achieves (:class:`RealizedRates`): at a batch size where speculating steps
have emitted fewer tokens per second than plain ones, the plan is overruled (and retried now and then).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

MARGIN = 0.03  # speculate only when the plan's expected rate beats plain decoding's by this much
REPLAN_EVERY = 8  # steps a plan not drafted holds while the batch and its caps stay the same
REPLAN_MAX = 64  # ... doubling while the plans made keep drafting nothing, up to this


class StepCost:
    """Step seconds ≈ a + b · tokens + c · verified sequences + d · [any verified], fitted by least
    squares with weights decaying by ``decay`` per step (``d``: what speculating at all costs a step —
    the proposal round trip and the work around it)."""

    def __init__(self, decay: float = 0.97, min_samples: int = 8):
        self.decay = decay
        self.min_samples = min_samples
        # Σ w x xᵀ (upper triangle) and Σ w x y, x = (1, tokens, verified, any), as plain floats: observe
        # runs every step on the host, between GPU steps, where small tensor ops would cost more than the
        # sums. Sample k is added with weight decay^-k (``_weight``) rather than every sum decayed each
        # step: the sums are the decayed ones times ``_weight``, and a plain step touches 5 of them.
        self._xx = [[0.0] * 4 for _ in range(4)]
        self._xy = [0.0] * 4
        self._weight = 1.0
        self._coef: tuple[float, float, float, float] | None = None  # the fit, until the next sample
        self.samples = 0

    def observe(self, tokens: int, seconds: float, verified: int = 0, attempted: bool = False) -> None:
        """One step: ``tokens`` query tokens, ``verified`` sequences verified drafts; ``attempted``:
        proposals were asked for it even if none came in time (a late round's wait is what
        speculating cost that step, so it counts toward ``d``, not toward plain steps' ``a``)."""
        w = self._weight = self._weight / self.decay
        if w > 1e100:  # bring the sums back to their decayed values before the weights overflow
            self._rescale(1.0 / w)
            w = self._weight
        xx, xy = self._xx, self._xy
        t = float(tokens)
        wt = w * t
        xx[0][0] += w
        xx[0][1] += wt
        xx[1][1] += wt * t
        xy[0] += w * seconds
        xy[1] += wt * seconds
        if verified > 0 or attempted:  # the speculating columns: x[2] = verified, x[3] = 1
            x = (1.0, t, float(verified), 1.0)
            for i in range(4):
                for j in range(max(i, 2), 4):
                    xx[i][j] += w * x[i] * x[j]
            xy[2] += w * x[2] * seconds
            xy[3] += w * seconds
        self.samples += 1
        self._coef = None

    def _rescale(self, factor: float) -> None:
        for row in self._xx:
            row[:] = [v * factor for v in row]
        self._xy = [v * factor for v in self._xy]
        self._weight *= factor

    @property
    def ready(self) -> bool:
        return self.samples >= self.min_samples

    def coefficients(self) -> tuple[float, float, float, float]:
        """(a, b, c, d), each ≥ 0: seconds per step, per query token, per verified sequence, and for
        speculating at all."""
        if self.samples == 0:
            return 0.0, 0.0, 0.0, 0.0
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    def _fit(self) -> tuple[float, float, float, float]:
        scale = 1.0 / self._weight  # the decayed sums (the upper triangle mirrored)
        xx = [[self._xx[min(i, j)][max(i, j)] * scale for j in range(4)] for i in range(4)]
        xy = [v * scale for v in self._xy]
        # a little ridge keeps the fit defined before verify steps (or varied batches) were seen
        ridge = 1e-6 * xx[0][0]
        system = [[xx[i][j] + (ridge if i == j and i else 0.0) for j in range(4)] + [xy[i]] for i in range(4)]
        coef = [max(c, 0.0) for c in _solve(system)]
        mean = [xx[0][j] / xx[0][0] for j in range(4)]  # weighted means of x
        a = max(xy[0] / xx[0][0] - sum(coef[j] * mean[j] for j in range(1, 4)), 0.0)
        return a, coef[1], coef[2], coef[3]

    def seconds(self, tokens: int, verified: int) -> float:
        """Predicted step seconds with ``tokens`` query tokens of which ``verified`` sequences speculate."""
        a, b, c, d = self.coefficients()
        return a + b * tokens + c * verified + (d if verified else 0.0)


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


def _solve(system: list[list[float]]) -> list[float]:
    """x of the augmented n×(n+1) system [A | y] (A x = y), by Gaussian elimination with partial
    pivoting: plain floats, so that a metrics scrape or a step never runs a tensor op for a 4×4 fit."""
    n = len(system)
    m = [row[:] for row in system]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            continue  # a direction never observed: its coefficient stays 0
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        if abs(m[r][r]) >= 1e-300:
            x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def plan(caps: dict[str, int], alphas: dict[str, float], base_tokens: int, cost: StepCost,
         gains: dict[str, list[float]] | None = None) -> dict[str, int]:
    """γ per sequence for this step (see the module docstring). ``caps``: the most each may draft;
    ``base_tokens``: query tokens the step runs anyway (one per decoding sequence, prefill chunks).
    ``gains``: for the sequences with evidence of their own (a proposal in hand and the draft's
    calibrated confidence in it), the expected tokens each of its drafts adds, in place of α^j."""
    if not cost.ready or not caps:
        return dict(caps)
    gains = gains or {}
    drafted = {sid: 0 for sid in caps}
    emitted = float(len(caps))  # without drafts each decoding sequence emits one token
    tokens, verified = base_tokens, 0
    plain_rate = emitted / max(cost.seconds(tokens, 0), 1e-9)
    # the drafts in the order they are added; the plan is the best prefix of it (no copy of the whole
    # plan at each improvement: this runs every step, for every decoding sequence)
    order: list[str] = []
    best_rate, best_n = plain_rate * (1 + MARGIN), 0

    def gain(sid: str, j: int) -> float:  # what the j-th draft (1-based) of ``sid`` adds
        own = gains.get(sid)
        if own is not None:
            return own[j - 1] if j <= len(own) else 0.0
        return alphas[sid] ** j

    heap = [(-gain(sid, 1), sid) for sid, limit in caps.items() if limit > 0 and gain(sid, 1) > 0]
    heapq.heapify(heap)
    # Every further draft adds at most the largest gain left and costs at least b seconds: once that
    # ratio and the current rate are both at most the best rate, no longer prefix can beat it (the
    # rate of a sum is at most the larger of the two ratios), so the search stops there.
    least_cost = cost.coefficients()[1]
    rate = plain_rate
    while heap:
        if least_cost > 0 and rate <= best_rate and -heap[0][0] <= best_rate * least_cost:
            break
        neg_gain, sid = heapq.heappop(heap)
        emitted -= neg_gain
        tokens += 1
        verified += drafted[sid] == 0
        drafted[sid] += 1
        order.append(sid)
        rate = emitted / max(cost.seconds(tokens, verified), 1e-9)
        if rate > best_rate:
            best_rate, best_n = rate, len(order)
        if drafted[sid] < caps[sid]:
            next_gain = min(gain(sid, drafted[sid] + 1), -neg_gain)  # never more than the draft before it
            if next_gain > 1e-6:
                heapq.heappush(heap, (-next_gain, sid))
    best = dict.fromkeys(caps, 0)
    for sid in order[:best_n]:
        best[sid] += 1
    return best


class Calibration:
    """How often a draft's confidence comes true: the draft's claimed per-token probability (its
    cumulative confidence divided by the one before) against whether the target accepted that token,
    in bins of the claim. A draft is untrusted: what its confidence is worth is what the target has
    seen it be worth, so a draft that claims certainty and is wrong earns the acceptance it achieves.

    Each bin starts from a weak prior of a quarter of its claim (``prior`` pseudo-tokens): evidence
    must be earned before a confident draft buys speculation the average would not."""

    EDGES = (0.25, 0.5, 0.75, 0.9, 0.97)  # bins: [0, .25), [.25, .5), …, [.97, 1]

    def __init__(self, prior: float = 4.0, decay: float = 0.995):
        self.decay = decay
        mids = [0.125, 0.375, 0.625, 0.825, 0.935, 0.985]
        self._hit = [prior * m * 0.25 for m in mids]
        self._seen = [prior] * len(mids)
        self.observed = 0

    @classmethod
    def bin(cls, claim: float) -> int:
        return next((i for i, e in enumerate(cls.EDGES) if claim < e), len(cls.EDGES))

    def rate(self, claim: float) -> float:
        i = self.bin(claim)
        return self._hit[i] / self._seen[i]

    def observe(self, confidence: list[float], accepted: int) -> None:
        """One verified chain: its cumulative ``confidence`` (one per verified token) and how many of
        its tokens were accepted (the first rejected one counts as a miss; those after it were not tried)."""
        prev = 1.0
        for j, c in enumerate(confidence[: accepted + 1]):
            claim = c / prev if prev > 0 else 0.0
            prev = c
            i = self.bin(claim)
            self._hit[i] = self.decay * self._hit[i] + (1.0 if j < accepted else 0.0)
            self._seen[i] = self.decay * self._seen[i] + 1.0
            self.observed += 1

    def gains(self, confidence: list[float]) -> list[float]:
        """Expected tokens each draft of a chain adds (the probability that it and all before it are
        accepted), from the draft's cumulative ``confidence`` through the calibration."""
        out, prev, p = [], 1.0, 1.0
        for c in confidence:
            claim = c / prev if prev > 0 else 0.0
            prev = c
            p *= self.rate(claim)
            out.append(p)
        return out


class RealizedRates:
    """Tokens per second the engine actually achieved, with and without speculation, per batch size.

    The cost model can be wrong (this machine's other processes, overheads it does not see); this
    is the check on it. Decoding steps are bucketed by batch size (powers of two); each bucket keeps
    an EWMA of emitted tokens per cycle-second for steps that speculated and for steps that did not.
    :meth:`allow` says not to speculate where speculating has measurably done worse, and now and
    then asks for the other choice than the one it favours, so that both rates stay current.
    """

    def __init__(self, weight: float = 0.1, min_samples: int = 3, explore_every: int = 16, explore_max: int = 256):
        self.weight = weight
        self.min_samples = min_samples
        self.explore_every = explore_every
        self.explore_max = explore_max
        self._rate: dict[tuple[int, bool], float] = {}
        self._count: dict[tuple[int, bool], int] = {}
        self._since: dict[int, int] = {}  # steps per bucket since the last exploring one
        self._every: dict[int, int] = {}  # per bucket: steps between explorations of a vetoed choice

    @staticmethod
    def bucket(batch: int) -> int:
        return max(batch, 1).bit_length()

    def observe(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        key = (self.bucket(batch), speculated)
        rate = tokens / seconds
        self._rate[key] = rate if key not in self._rate else (1 - self.weight) * self._rate[key] + self.weight * rate
        self._count[key] = self._count.get(key, 0) + 1

    def rate(self, batch: int, speculated: bool) -> float | None:
        key = (self.bucket(batch), speculated)
        return self._rate[key] if self._count.get(key, 0) >= self.min_samples else None

    def veto(self, batch: int) -> bool:
        """True where speculating has achieved fewer tokens/s than plain decoding at this batch size."""
        spec, plain_rate = self.rate(batch, True), self.rate(batch, False)
        return spec is not None and plain_rate is not None and spec < plain_rate

    def allow(self, batch: int) -> bool:
        """May a step at this batch size speculate (when the cost model says it pays)? No where
        speculating measurably did worse, but one step in ``explore_every`` tries it again, half as
        often after each try that leaves it worse (down to one in ``explore_max``; back to
        ``explore_every`` once it no longer is); yes
        elsewhere, but one step in ``explore_every`` (every other one while plain decoding has not
        been measured here) decodes plainly to keep that rate current."""
        b = self.bucket(batch)
        self._since[b] = self._since.get(b, 0) + 1
        vetoed = self.veto(batch)
        if not vetoed:
            self._every[b] = self.explore_every
        # until both rates are measured here, every other step takes the choice not yet measured
        known = self.rate(batch, True) is not None and self.rate(batch, False) is not None
        every = self._every.get(b, self.explore_every) if vetoed else self.explore_every
        explore = self._since[b] >= (every if known else 2)
        if explore:
            self._since[b] = 0
            if vetoed and known:  # the last try did not lift the veto: try half as often (a speculating
                # step that loses costs a proposal round trip; up to one in ``explore_max``)
                self._every[b] = min(2 * every, self.explore_max)
        return explore if vetoed else not explore


class PlanHold:
    """A load-aware plan that is not drafted (it drafts nothing, or the realized rates veto it) holds
    for ``REPLAN_EVERY`` rounds while the same sequences decode with the same caps, twice as long each
    time the plan made then still drafts nothing, up to ``REPLAN_MAX``; a plan that drafts is made
    afresh every round, and the next one not drafted holds ``REPLAN_EVERY`` again."""

    def __init__(self) -> None:
        self.key: object = None  # what the held plan was made for (the batch and its caps)
        self.plan: dict[str, int] | None = None
        self.left = 0  # rounds it still holds
        self.hold_for = REPLAN_EVERY  # how long the next plan not drafted holds

    def get(self, key: object) -> dict[str, int] | None:
        """The held plan, one of its rounds used, if it holds for ``key``."""
        if self.left > 0 and self.key == key:
            self.left -= 1
            return self.plan
        return None

    def hold(self, key: object, plan: dict[str, int]) -> None:
        """A plan not drafted, made now."""
        self.key, self.plan, self.left = key, plan, self.hold_for - 1
        self.hold_for = min(2 * self.hold_for, REPLAN_MAX)

    def drafted(self) -> None:
        """A plan drafts: plan afresh next round."""
        self.key, self.plan, self.left, self.hold_for = None, None, 0, REPLAN_EVERY

    def planned(self, key: object, make, realized: RealizedRates, batch: int) -> dict[str, int]:
        """The γ per sequence this round: the held plan while it holds for ``key``, else ``make()``'s,
        overruled where ``realized`` vetoes speculating at ``batch`` (:meth:`RealizedRates.allow`,
        consulted on every round the plan drafts, as its exploring schedule counts them); a held plan
        that drafts is made afresh on a round the realized rates let speculate."""
        raw = self.get(key)
        held = raw is not None
        if not held:
            raw = make()
        planned = raw
        if any(raw.values()):
            if not realized.allow(batch):  # speculating did worse here than the model thinks, or plain
                planned = dict.fromkeys(raw, 0)  # is due a measure: these sequences decode plainly for load
            elif held:  # this round speculates (an exploring one): on a plan made now
                raw = planned = make()
                held = False
        if not held:
            if any(planned.values()):  # its verdicts will move the acceptance: plan afresh next round
                self.drafted()
            else:
                self.hold(key, raw)
        return planned
