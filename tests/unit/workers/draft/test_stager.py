"""The draft side of the pipelined seam (pure): answers and staged proposals, checked against the target's
own fitting rule."""

from __future__ import annotations

import pytest

from workers.draft.ngram import NgramProposer
from workers.draft.oracle import OracleProposer
from workers.draft.drafter import Branch, Capabilities, Draft
from workers.draft.stager import Stager
from workers.speculation.payloads import VerifyResult
from workers.speculation.staging import Staged

pytestmark = pytest.mark.unit

REF = list(range(100, 160))  # the target's greedy text: prompt = REF[:10]


def test_an_answer_then_staged_proposals_for_every_outcome_of_it():
    stager = Stager(OracleProposer([REF], 0.0, 1000), alternatives=1)
    stager.commit("s", 0, REF[:10], num_speculative_tokens=3)
    [answer] = stager.answer(["s"])
    # one token spare (the target decodes one plainly while it is drafted), γ = 3
    assert (answer.start, answer.token_ids, answer.assumed[-1]) == (10, REF[10:14], REF[9])
    assert stager.answer(["s"]) == []  # it fits: nothing more to answer
    staged = stager.stage(["s"])
    # expected to be verified after one plain step: x = REF[11:14]; every outcome a = 0..3 with the
    # oracle's alternatives (none: it drafted no wrong token) and, for a = 3, its own next token
    assert [(p.start, p.token_ids) for p in staged] == [(15, REF[15:18])]
    assert stager.stage(["s"]) == []  # once per proposal in use
    target = Staged()
    for p in staged:
        target.offer(p)
    assert target.take("s", REF[:15]).token_ids == REF[15:18]


def test_the_oracle_stages_the_truth_after_a_wrong_draft_token_and_pays_once_per_depth(monkeypatch):
    slept = []
    monkeypatch.setattr("workers.draft.oracle.time.sleep", slept.append)
    oracle = OracleProposer([REF], 0.0, 1000, token_cost_s=0.01)
    stager = Stager(oracle, alternatives=1)
    stager.commit("s", 0, REF[:10], num_speculative_tokens=2)
    chains = oracle.draft([Branch("s", (), 4, 1), Branch("s", (REF[10],), 2, 1)])
    assert [c.tokens for c in chains] == [REF[10:14], REF[11:13]]
    assert slept == [pytest.approx(0.04)]  # one batched pass per depth, the deepest branch's
    oracle.error_rate = 1.0  # every token a random one: where it is wrong, the alternative is the truth
    [chain] = oracle.draft([Branch("s", (), 2, 1)])
    assert [a for a in chain.alternatives if a] == [[r] for t, r in zip(chain.tokens, REF[10:12]) if t != r]


def test_verdicts_move_the_proposal_in_use_and_stale_ones_are_forgotten():
    stager = Stager(OracleProposer([REF], 0.0, 1000), alternatives=1)
    stager.commit("s", 0, REF[:10], num_speculative_tokens=2)
    stager.answer(["s"])
    stager.stage(["s"])
    # the target decoded REF[10] plainly, then verified the answer: 2 accepted + its bonus
    stager.commit("s", 1, [REF[10]], num_speculative_tokens=2)
    stager.verified([VerifyResult("s", 1, 2, REF[11:14])])
    stager.commit("s", 2, [], num_speculative_tokens=2)
    assert stager.answer(["s"]) == []  # a staged proposal fits
    more = stager.stage(["s"])
    assert more and all(p.start > 14 for p in more)
    stager.release(["s"])
    assert len(stager) == 0 and stager.answer(["s"]) == []


def test_ngram_branches_draft_after_the_assumed_tokens_with_alternatives():
    ngram = NgramProposer(1, 3)
    ngram.commit("s", [1, 2, 3, 9, 1, 2, 4, 1, 2])
    [plain, branch] = ngram.draft([Branch("s", (), 2, 1), Branch("s", (3,), 2, 1)])
    assert plain.tokens == [4, 1] and plain.alternatives[0] == [3]  # "1 2" was followed by 4, before that 3
    assert branch.tokens[0] == 9  # "1 2 3" was followed by 9


def test_staging_ahead_covers_the_likeliest_outcome_of_the_likeliest_outcome():
    stager = Stager(OracleProposer([REF], 0.0, 1000), alternatives=1)
    stager.commit("s", 0, REF[:10], num_speculative_tokens=2)
    stager.answer(["s"])
    [level1] = stager.stage(["s"])
    assert not stager.behind(["s"]) and stager.stage_ahead(["s"]) == []  # it keeps up (a step per news so far)
    stager._seqs["s"].lag = 2  # it runs a step late
    assert stager.behind(["s"])
    [level2] = stager.stage_ahead(["s"])
    assert level2.start == level1.start + 3 and level2.token_ids == REF[level2.start : level2.start + 2]
    assert not stager.behind(["s"]) and stager.stage_ahead(["s"]) == []  # one level ahead of what is in use
    # the target verifies the answer (after one plain step), then level 1 whole: level 2 fits, and
    # staging from it does not repeat
    committed = REF[: level1.start + 3]
    stager.commit("s", 1, committed[10:], num_speculative_tokens=2)
    target = Staged()
    target.offer(level2)
    assert target.take("s", committed).token_ids == level2.token_ids


def test_after_a_plain_step_it_stages_from_the_proposal_one_token_ahead_instead_of_answering():
    stager = Stager(OracleProposer([REF], 0.0, 1000), alternatives=1)
    stager.commit("s", 0, REF[:10], num_speculative_tokens=2)
    stager.answer(["s"])
    [level1] = stager.stage(["s"])  # expected after the answer's round: start 14, assumes REF[13]
    # the answer came late and the target decoded REF[10..12] plainly: level 1 fits once REF[13] is in
    stager.commit("s", 1, REF[10:13], num_speculative_tokens=2)
    assert stager.answer(["s"]) == []  # no answer: the target verifies level 1 after its next plain step
    staged = stager.stage(["s"])
    assert staged and all(p.start >= level1.start + 1 for p in staged)
    target = Staged()
    for p in staged:
        target.offer(p)
    done = REF[: level1.start + 3]  # the plain step (REF[13]), then level 1 verified whole + its bonus
    assert target.take("s", done).token_ids == REF[len(done) : len(done) + 2]


def test_staged_proposals_carry_confidence_conditional_on_what_they_assume():
    """A branch drafted after a guessed bonus token carries the drafter's confidence given that token
    (the proposal is only used once it is committed), cut to the tokens streamed."""
    class Sure:
        caps = Capabilities("sure", stages=True)

        def commit(self, seq_id, tokens, hidden_states=(), sampling=None): ...

        def verified(self, results): ...

        def release(self, seq_ids): ...

        def draft(self, branches):
            # first token a guess of the bonus (0.5), then three sure ones (cumulative confidence)
            return [Draft([7, 8, 9, 10, 11][: b.num_tokens], [], [0.5, 0.5, 0.5, 0.5, 0.5][: b.num_tokens])
                    for b in branches]

    stager = Stager(Sure(), alternatives=0)
    stager.commit("s", 0, [1, 2, 3], num_speculative_tokens=2)
    [answer] = stager.answer(["s"])
    assert answer.confidence == [0.5] * len(answer.token_ids)
    stager._seqs["s"].sent[0].chain = Draft(answer.token_ids, [])  # trimmed to its end: the branch guesses first
    staged = stager.stage(["s"])
    assert staged and all(p.confidence == [1.0] * len(p.token_ids) for p in staged)


def test_one_drafting_call_answers_one_sequence_and_stages_the_others(monkeypatch):
    """One sequence whose proposal came to nothing does not hold back the others' staged proposals:
    its answer and their outcomes are drafted in one call (one batched pass per depth); its own
    outcomes follow in the next call, once its answer exists."""
    refs = [REF, list(range(300, 360))]
    oracle = OracleProposer(refs, 0.0, 1000)
    calls = []
    real = oracle.draft
    monkeypatch.setattr(oracle, "draft", lambda branches: calls.append(len(branches)) or real(branches))
    stager = Stager(oracle, alternatives=1)
    stager.commit("a", 0, refs[0][:10], num_speculative_tokens=2)
    stager.commit("b", 0, refs[1][:10], num_speculative_tokens=2)
    first, answered = stager.answer_and_stage(["a", "b"])
    assert answered == ["a", "b"] and len(calls) == 1  # nothing streamed yet: both answered, one call
    stager.commit("b", 1, [], num_speculative_tokens=2)
    stager.release(["a"])
    stager.commit("a", 1, refs[0][:10], num_speculative_tokens=2)  # "a" starts over (say the target preempted it)
    calls.clear()
    props, answered = stager.answer_and_stage(["a", "b"])
    assert answered == ["a"] and len(calls) == 1
    assert {p.seq_id for p in props} == {"a", "b"}  # a's answer and b's staged outcomes together
    assert all(p.start > 11 for p in props if p.seq_id == "b")
    later = stager.stage(["a", "b"])  # b's outcomes are out already: only a's are staged now
    assert later and {p.seq_id for p in later} == {"a"}


def test_proposals_leave_before_the_drafting_calls_last_pass(monkeypatch):
    """Given an ``early`` callback, a drafter paying per depth hands the proposals over before its last
    pass (whose token only guesses what follows; it is not streamed): the same proposals as without,
    each remembering its whole chain, so the next staging guesses from it as before; the same time
    drafted in all."""
    events = []
    monkeypatch.setattr("workers.draft.oracle.time.sleep", lambda s: events.append(("sleep", round(s, 6))))
    runs, slept = {}, {}
    for early in (False, True):
        events.clear()
        oracle = OracleProposer([REF], 0.3, 1000, seed=4, token_cost_s=0.01)
        stager = Stager(oracle, alternatives=1)
        send = (lambda props: events.append(("early", [p.token_ids for p in props]))) if early else None
        stager.commit("s", 0, REF[:10], num_speculative_tokens=2)
        answers, _ = stager.answer_and_stage(["s"], early=send)
        staged = stager.stage(["s"], early=send)
        stager.commit("s", 1, [REF[10]], num_speculative_tokens=2)
        stager.verified([VerifyResult("s", 1, 2, REF[11:14])])
        stager.commit("s", 2, [], num_speculative_tokens=2)
        later, _ = stager.answer_and_stage(["s"], early=send)
        runs[early] = [[(p.start, p.token_ids, p.assumed) for p in props] for props in (answers, staged, later)]
        slept[early] = round(sum(s for kind, s in events if kind == "sleep"), 6)
    assert all(runs[True]) and runs[True] == runs[False]
    assert slept[True] == slept[False]
    # each call: its passes but the last, its proposals, the last pass
    sent = [i for i, e in enumerate(events) if e[0] == "early"]
    assert [events[i][1] for i in sent] == [[p[1] for p in props] for props in runs[True]]
    assert all(events[i - 1][0] == "sleep" and events[i + 1] == ("sleep", 0.01) for i in sent)
