"""Load-aware budgets: the plan follows the cost model — drafts when verifying is cheap and drafts
hit, fewer (down to none) as the batch grows or acceptance falls."""

from __future__ import annotations

import pytest

from runtime.messages import SamplingParams
from tests.unit.workers.engine.test_spec_engine import CFG, plain, prompts, run_spec
from tests.unit.workers.engine.test_tree_verify import target_dir  # noqa: F401 (fixture)
from workers.draft.ngram import NgramProposer
from workers.engine.engine import Engine
from workers.engine.weights import load_model
from workers.engine.budget import Acceptance, StepCost, plan

pytestmark = pytest.mark.unit


def fitted(fixed: float, per_token: float, wait: float = 0.0, per_verify: float = 0.0) -> StepCost:
    """A cost model fed exact steps: ``wait`` is paid by every step that speculates at all."""
    cost = StepCost()
    for n, v in ((1, 0), (4, 1), (8, 0), (16, 3), (32, 2), (64, 8), (8, 4), (2, 0), (40, 5), (24, 1), (12, 0)):
        cost.observe(n, fixed + per_token * n + per_verify * v + (wait if v else 0.0), v)
    return cost


def test_cost_model_recovers_its_plane():
    a, b, c, d = fitted(0.05, 0.002, wait=0.004, per_verify=0.003).coefficients()
    assert a == pytest.approx(0.05, rel=1e-2) and b == pytest.approx(0.002, rel=1e-2)
    assert c == pytest.approx(0.003, rel=1e-2) and d == pytest.approx(0.004, rel=1e-2)
    assert not StepCost().ready


def test_cost_model_forgets_old_steps_as_its_decay_says_over_a_long_run():
    """Recent steps weigh more (each sample's weight decays by ``decay`` a step, kept without touching
    every sum each step): after 20,000 steps, well past the weights' rescaling, a cost that changed
    10,000 steps ago is forgotten and the fit is the new plane's."""
    cost = StepCost()
    for step in range(20_000):
        n, v = (1, 0) if step % 3 else (4 + step % 5, (step // 3) % 3)  # v: 0, 1 or 2 verified
        fixed, per_token = (0.01, 0.001) if step < 10_000 else (0.02, 0.003)
        cost.observe(n, fixed + per_token * n + 0.002 * v + (0.004 if v else 0.0), v)
    a, b, c, d = cost.coefficients()
    assert a == pytest.approx(0.02, rel=1e-3) and b == pytest.approx(0.003, rel=1e-3)
    assert c == pytest.approx(0.002, rel=1e-3) and d == pytest.approx(0.004, rel=1e-3)


def test_small_gains_are_not_bought():
    """A plan that beats plain decoding by less than the margin is not taken."""
    cost = fitted(0.05, 0.0, wait=0.0, per_verify=0.0)
    assert plan({"s": 1}, {"s": 0.01}, 1, cost) == {"s": 0}
    assert plan({"s": 1}, {"s": 0.5}, 1, cost) == {"s": 1}


def test_memory_bound_steps_speculate_fully():
    """Verify is almost free (GPU at small batch): every sequence drafts its whole cap."""
    cost = fitted(0.02, 0.00001, wait=0.001)
    caps = {f"s{i}": 4 for i in range(4)}
    assert plan(caps, dict.fromkeys(caps, 0.6), 4, cost) == caps


def test_compute_bound_big_batches_stop_speculating():
    """Every token costs as much as a step's fixed part: drafts accepted 30 % of the time only lose."""
    cost = fitted(0.01, 0.002, wait=0.002)
    caps = {f"s{i}": 4 for i in range(32)}
    assert not any(plan(caps, dict.fromkeys(caps, 0.3), 32, cost).values())


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step emits on average with k chained drafts of per-token acceptance α."""
    return sum(alpha ** j for j in range(k + 1))


def test_budget_goes_to_the_sequences_whose_drafts_hit():
    cost = fitted(0.02, 0.001, wait=0.002)
    caps = {"good": 4, "bad": 4}
    got = plan(caps, {"good": 0.9, "bad": 0.05}, 2, cost)
    assert got["good"] >= 3 and got["bad"] == 0
    # the plan's expected rate beats both extremes under the model
    def rate(g):
        emitted = sum(expected_tokens(a, g[s]) for s, a in {"good": 0.9, "bad": 0.05}.items())
        return emitted / cost.seconds(2 + sum(g.values()), sum(1 for k in g.values() if k))
    assert rate(got) >= max(rate(dict.fromkeys(caps, 0)), rate(caps))


def test_acceptance_estimate_tracks_rounds():
    acc = Acceptance()
    for _ in range(20):
        acc.observe(4, 4)
    assert acc.alpha > 0.9
    for _ in range(20):
        acc.observe(4, 0)
    assert acc.alpha < 0.1


def test_load_aware_engine_is_still_lossless(target_dir):  # noqa: F811
    batch = prompts(16, seed=21)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = plain(target_dir, batch, params)
    engine = Engine(load_model(target_dir), CFG, num_speculative_tokens=4, load_aware=True)
    got = {}
    items = list(batch.items())
    for start in range(0, len(items), 8):
        got.update(run_spec(engine, NgramProposer(1, 3), dict(items[start : start + 8]), params))
    assert got == want
    assert engine.spec.cost.ready and engine.spec.cost.samples > 0


def test_realized_rates_veto_speculation_that_does_worse():
    from workers.engine.budget import RealizedRates

    rates = RealizedRates(min_samples=2, explore_every=4)
    for _ in range(3):
        rates.observe(8, False, 8, 0.10)  # plain: 80 tokens/s at batch 8
        rates.observe(8, True, 10, 0.20)  # speculating: 50 tokens/s
    assert rates.veto(8) and rates.veto(15)  # same bucket
    assert not rates.veto(16) and not rates.veto(2)  # nothing measured there
    # vetoed: speculation is tried again after four steps, then half as often while it stays worse
    # (each losing try costs a proposal round trip), up to one step in explore_max
    tries = [i for i in range(1, 61) if rates.allow(8)]
    assert tries == [4, 12, 28, 60]
    capped = RealizedRates(min_samples=2, explore_every=4, explore_max=8)
    for _ in range(3):
        capped.observe(8, False, 8, 0.10)
        capped.observe(8, True, 10, 0.20)
    assert [i for i in range(1, 30) if capped.allow(8)] == [4, 12, 20, 28]
    for _ in range(30):  # speculating got better: the veto lifts and the interval starts over
        rates.observe(8, True, 20, 0.10)
    assert not rates.veto(8) and [rates.allow(8) for _ in range(4)] == [True, True, True, False]
    for _ in range(40):
        rates.observe(8, True, 4, 0.10)
    assert rates.veto(8) and [i for i in range(1, 9) if rates.allow(8)] == [4]
    # not measured yet: every other step decodes plainly; once both rates are known, one in four
    assert [rates.allow(2) for _ in range(4)] == [True, False] * 2
    for _ in range(2):
        rates.observe(2, False, 2, 0.05)
        rates.observe(2, True, 3, 0.05)
    assert [rates.allow(2) for _ in range(8)] == [True, True, True, False] * 2


def test_steps_the_realized_rates_veto_say_load_not_draft_late():
    """When the realized-rate check overrules the plan, nothing is asked of the draft, so the steps
    are counted as ``load``; before, they kept the "draft_late" meant for an outstanding proposal."""
    from workers.engine.sequence import Sequence
    from workers.engine.speculator import Speculator

    spec = Speculator(100, 3, load_aware=True)
    spec.cost = fitted(0.05, 0.0, wait=0.0, per_verify=0.0)  # verifying is free: the plan drafts
    for _ in range(4):  # ... but speculating steps achieved half plain decoding's tokens/s at batch 1
        spec.realized.observe(1, False, 1, 0.05)
        spec.realized.observe(1, True, 1, 0.10)
    params = SamplingParams(temperature=0, max_tokens=64)
    seq = Sequence("s", list(range(8)), 8, 0, params, num_computed=7)
    spec.add("s", None, None, None)
    spec.states["s"].acceptance = Acceptance(9.0, 1.0)
    asked = [bool(spec.requests([seq], 1024)) for _ in range(16)]
    assert asked.count(True) == 1 and asked[-1]  # one exploring round in explore_every (16)
    for _ in range(3):
        if not spec.requests([seq], 1024):
            assert spec.states["s"].why_plain == "load"
            spec.count_plain(seq)
    assert spec.plain_steps == {"load": 3}


def test_calibration_earns_what_a_draft_claims_and_no_more():
    """A draft's confidence is worth what the target has seen it be worth: honest certainty earns
    near-certain gains, the same claims from a draft that is always wrong earn almost nothing."""
    from workers.engine.budget import Calibration

    fresh = Calibration()
    assert fresh.gains([1.0, 1.0])[0] < 0.5  # nothing earned yet: a weak, pessimistic prior
    honest, liar = Calibration(), Calibration()
    for _ in range(40):
        honest.observe([1.0, 1.0, 1.0, 1.0], 4)  # every claim came true (one rejection would follow)
        liar.observe([1.0, 1.0, 1.0, 1.0], 0)  # its first token is always rejected
    r = honest.rate(1.0)
    assert r > 0.97 and honest.gains([1.0, 1.0, 1.0]) == pytest.approx([r, r * r, r ** 3])
    assert liar.gains([1.0])[0] < 0.05
    # claims are per token (cumulative confidence divided by the one before), each in its own bin
    mixed = Calibration()
    for _ in range(60):
        mixed.observe([0.99, 0.2], 1)  # the sure token is accepted, the 0.2 one (claim 0.2) is not
    assert mixed.rate(0.99) > 0.9 and mixed.rate(0.2) < 0.1


def test_evidence_buys_drafts_the_average_would_not():
    """plan() with a sequence's own gains: where α says drafting does not pay, a proposal the
    calibrated evidence says is near certain still gets its drafts, and one with poor evidence none."""
    cost = fitted(0.05, 0.002, wait=0.01, per_verify=0.005)
    caps = {"sure": 4, "doubtful": 4, "plain": 4}
    alphas = dict.fromkeys(caps, 0.1)
    assert plan(caps, alphas, 3, cost) == dict.fromkeys(caps, 0)
    got = plan(caps, alphas, 3, cost, {"sure": [0.97, 0.95, 0.92, 0.9], "doubtful": [0.05, 0.01, 0.0, 0.0]})
    assert got == {"sure": 4, "doubtful": 0, "plain": 0}


def _pipelined_speculator(claim: float, accepted_of_4: int):
    """A load-aware Speculator on the pipelined seam whose cost model and realized rates both say
    speculating does not pay at batch 1, its draft's claims calibrated by 40 chains of 4 drafts that
    claimed ``claim`` per token and had ``accepted_of_4`` accepted."""
    from workers.engine.speculator import Speculator
    from workers.engine.budget import Calibration

    spec = Speculator(100, 4, load_aware=True)
    spec.pipelined = True
    spec.cost = fitted(0.05, 0.002, wait=0.01, per_verify=0.005)
    for _ in range(4):
        spec.realized.observe(1, False, 1, 0.05)
        spec.realized.observe(1, True, 1, 0.10)
    calib = spec.calibrations[""] = Calibration()
    for _ in range(40):
        calib.observe([claim ** (j + 1) for j in range(4)], accepted_of_4)
    return spec


@pytest.mark.parametrize("confident", [True, False])
def test_pipelined_policy_verifies_a_proposal_its_evidence_says_will_pay(confident):
    """Issue 37 item 4: under the pipelined seam a repeated request's suffix proposal (confidence 1,
    a draft whose claims came true) is verified although the average request's acceptance and the
    realized rates say speculating does not pay; without the confidence it waits (``load``), and the
    draft is still asked every step (asking costs the target nothing on this seam)."""
    from workers.engine.sequence import Sequence
    from workers.speculation.payloads import DraftOutput

    spec = _pipelined_speculator(1.0, 4)
    params = SamplingParams(temperature=0, max_tokens=64)
    seq = Sequence("s", list(range(8)), 8, 0, params, num_computed=7)
    spec.add("s", None, None, None)
    spec.states["s"].acceptance = Acceptance(1.0, 9.0)  # α = 0.1 so far
    verified = 0
    for step in range(4):
        asked = spec.requests([seq], 1024)
        assert [r.num_speculative_tokens for r in asked] == [4]  # asked every step
        spec.states["s"].round = step + 1  # (the engine counts the round when it converts the ask)
        spec.offer([DraftOutput("s", step, [20, 21, 22, 23], start=len(seq.token_ids),
                                assumed=seq.token_ids[-4:], confidence=[1.0] * 4 if confident else [])])
        drafted = spec.attach({}, [seq], 1024, None)
        if drafted:
            verified += 1
            assert drafted["s"].tokens == [20, 21, 22, 23]
            del seq.token_ids[-4:]
        else:
            assert spec.states["s"].why_plain == "load"
    assert verified == (4 if confident else 0)
    assert (spec.evidence_steps > 0) == confident


def test_a_draft_whose_confidence_lies_buys_nothing():
    """The same proposals from a draft whose claims of certainty were always wrong: not verified."""
    from workers.engine.sequence import Sequence
    from workers.speculation.payloads import DraftOutput

    spec = _pipelined_speculator(1.0, 0)
    seq = Sequence("s", list(range(8)), 8, 0, SamplingParams(temperature=0, max_tokens=64), num_computed=7)
    spec.add("s", None, None, None)
    spec.states["s"].acceptance = Acceptance(1.0, 9.0)  # its own record: α = 0.1
    spec.requests([seq], 1024)
    spec.states["s"].round = 1
    spec.offer([DraftOutput("s", 0, [20, 21, 22, 23], start=8, assumed=seq.token_ids[-4:], confidence=[1.0] * 4)])
    assert spec.attach({}, [seq], 1024, None) == {}
    assert spec.states["s"].why_plain == "load"


def test_low_confidence_never_takes_away_what_the_requests_record_earned():
    """A request whose drafts have been accepted keeps its drafts when the draft claims little."""
    from workers.engine.sequence import Sequence
    from workers.speculation.payloads import DraftOutput

    spec = _pipelined_speculator(0.2, 0)  # claims of 0.2 that never came true
    spec.realized = type(spec.realized)()  # nothing measured: no veto
    seq = Sequence("s", list(range(8)), 8, 0, SamplingParams(temperature=0, max_tokens=64), num_computed=7)
    spec.add("s", None, None, None)
    spec.states["s"].acceptance = Acceptance(19.0, 1.0)  # α = 0.95 so far
    spec.requests([seq], 1024)
    spec.states["s"].round = 1
    spec.offer([DraftOutput("s", 0, [20, 21, 22, 23], start=8, assumed=seq.token_ids[-4:], confidence=[0.2] * 4)])
    assert spec.attach({}, [seq], 1024, None)["s"].tokens == [20, 21, 22, 23]


def test_a_plan_of_no_drafts_holds_while_the_batch_does(monkeypatch):
    """Drafting does not pay: the plan is not made again on every step (the cost model's refit and
    the plan were most of what speculation added to a fast target's step), yet every step decodes
    plainly for ``load`` as before, a plan that keeps drafting nothing holds twice as long each time
    (``REPLAN_EVERY`` steps, then 2×, 4×, ... up to ``REPLAN_MAX``), a batch that changes is planned at
    once, and a cost model that turns in favour of drafting is heard within ``REPLAN_MAX`` steps."""
    from workers.engine import speculator as spec_module
    from workers.engine.sequence import Sequence
    from workers.engine.budget import REPLAN_EVERY, REPLAN_MAX
    from workers.engine.speculator import Speculator

    made = []

    def counting_plan(*args, **kwargs):
        made.append(args[0])
        return plan(*args, **kwargs)

    monkeypatch.setattr(spec_module, "plan", counting_plan)
    spec = Speculator(100, 3, load_aware=True)
    spec.cost = fitted(0.001, 0.01, wait=0.001, per_verify=0.001)  # every draft token costs 10 steps
    params = SamplingParams(temperature=0, max_tokens=64)
    a = Sequence("a", list(range(8)), 8, 0, params, num_computed=7)
    spec.add("a", None, None, None)
    holds = [REPLAN_EVERY, 2 * REPLAN_EVERY, 4 * REPLAN_EVERY, REPLAN_MAX, REPLAN_MAX]
    assert 4 * REPLAN_EVERY <= REPLAN_MAX
    steps = sum(holds)
    planned_at = []
    for i in range(steps):
        before = len(made)
        assert spec.requests([a], 1024) == []
        assert spec.states["a"].why_plain == "load"
        spec.count_plain(a)
        if len(made) > before:
            planned_at.append(i)
    assert planned_at == [sum(holds[:n]) for n in range(len(holds))] and spec.plans == len(made)
    assert spec.plain_steps == {"load": steps} and spec.unplanned_steps == steps
    # a round not asked (the draft backed off): the next one is planned afresh
    spec.requests([a], 1024)
    spec.unasked([a], "draft_backoff")
    made.clear()
    assert spec.requests([a], 1024) == [] and len(made) == 1
    # a sequence joins: planned at once
    b = Sequence("b", list(range(8)), 8, 0, params, num_computed=7)
    spec.add("b", None, None, None)
    made.clear()
    assert spec.requests([a, b], 1024) == [] and len(made) == 1
    # verifying becomes cheap and the drafts would hit: the held plan gives way within REPLAN_MAX steps
    spec.cost = fitted(0.02, 0.00001, wait=0.0001)
    for sid in ("a", "b"):
        spec.states[sid].acceptance = Acceptance(9.0, 1.0)
    asked = [bool(spec.requests([a, b], 1024)) for _ in range(REPLAN_MAX)]
    assert asked[-1] and not all(asked)
    # a plan that drafts is made again every step (the realized rates are consulted every step)
    made.clear()
    for _ in range(4):
        spec.requests([a, b], 1024)
    assert len(made) == 4


def test_a_vetoed_plan_holds_and_the_realized_rates_explore_as_before(monkeypatch):
    """The cost model says drafting pays, but speculating steps did worse than plain ones (a GPU whose
    draft's round trip eats the gain): the plan is not made again on every step to be overruled,
    and the steps that speculate are exactly those the realized rates' exploring schedule picks."""
    from workers.engine import speculator as spec_module
    from workers.engine.budget import RealizedRates
    from workers.engine.sequence import Sequence
    from workers.engine.budget import REPLAN_EVERY
    from workers.engine.speculator import Speculator

    made = []

    def counting_plan(*args, **kwargs):
        made.append(args[0])
        return plan(*args, **kwargs)

    def worse(rates: RealizedRates) -> RealizedRates:
        for _ in range(4):
            rates.observe(1, False, 1, 0.05)
            rates.observe(1, True, 1, 0.10)
        return rates

    monkeypatch.setattr(spec_module, "plan", counting_plan)
    spec = Speculator(100, 3, load_aware=True)
    spec.cost = fitted(0.05, 0.0, wait=0.0, per_verify=0.0)  # verifying is free: the plan drafts
    spec.realized = worse(spec.realized)
    seq = Sequence("s", list(range(8)), 8, 0, SamplingParams(temperature=0, max_tokens=512), num_computed=7)
    spec.add("s", None, None, None)
    spec.states["s"].acceptance = Acceptance(9.0, 1.0)
    steps = 64
    asked = [i for i in range(steps) if spec.requests([seq], 1024)]
    reference = worse(RealizedRates())
    assert asked == [i for i in range(steps) if reference.allow(1)] == [15, 47]
    assert len(made) <= steps // REPLAN_EVERY + len(asked) and spec.plans == len(made)
    assert spec.unplanned_steps == steps - len(asked)


def test_quiet_rounds_say_why_every_step_as_planning_each_step_would():
    """While a plan that drafts nothing holds, its rounds are quiet (the batch is only checked to be the
    same): every step still decodes plainly for ``load``, the last tokens a sequence may emit still say
    ``no_room``, a batch that changes is planned at once, and a round not asked ends the quiet."""
    from workers.engine.sequence import Sequence
    from workers.engine.speculator import Speculator

    def run(quiet: bool, max_tokens: int, steps: int):
        spec = Speculator(100, 3, load_aware=True)
        spec.cost = fitted(0.001, 0.01, wait=0.001, per_verify=0.001)  # every draft token costs 10 steps
        seq = Sequence("a", list(range(8)), 8, 0, SamplingParams(temperature=0, max_tokens=max_tokens), num_computed=7)
        spec.add("a", None, None, None)
        reasons, quiet_rounds = [], 0
        for _ in range(steps):
            if not quiet:
                spec._quiet = 0  # (reference: every round planned in full)
            quiet_rounds += spec._quiet > 0
            assert spec.requests([seq], 1024) == []
            reasons.append(spec.states["a"].why_plain)
            spec.count_plain(seq)
            seq.token_ids.append(5)  # the step decodes one token plainly
            seq.num_computed += 1
            seq.num_generated += 1
        return reasons, dict(spec.plain_steps), spec.unplanned_steps, quiet_rounds, spec, seq

    for max_tokens in (40, 90):
        quiet, reference = run(True, max_tokens, max_tokens), run(False, max_tokens, max_tokens)
        assert quiet[:3] == reference[:3]
        assert quiet[0][-1] == "no_room" and quiet[0][0] == "load"
        assert quiet[3] > max_tokens // 2  # most rounds were quiet
    # a sequence joins during a quiet stretch: planned at once; a round not asked ends the quiet
    *_, spec, a = run(True, 200, 20)
    assert spec._quiet > 0
    b = Sequence("b", list(range(8)), 8, 0, SamplingParams(temperature=0, max_tokens=64), num_computed=7)
    spec.add("b", None, None, None)
    plans = spec.plans
    assert spec.requests([a, b], 1024) == [] and spec.plans == plans + 1
    assert spec.states["b"].why_plain == "load"
    spec.unasked([a, b], "draft_backoff")
    assert spec._quiet == 0 and spec.states["a"].why_plain == "draft_backoff"
