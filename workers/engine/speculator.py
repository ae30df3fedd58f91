"""Per-sequence speculation state: what to ask a draft worker for, which proposals to verify, and
what each verify step teaches (counters, adaptive budgets, load-aware plans).

The engine owns one :class:`Speculator`. Between steps it asks :meth:`Speculator.requests` which
sequences should draft and how many tokens; at a step it hands over the proposals that came back,
and :meth:`Speculator.attach` checks each one (:func:`workers.speculation.checks.proposal_problem`:
a draft worker is untrusted input) and cuts it to what may be verified; after verification
:meth:`Speculator.record` updates the request's counters and its budget. Under the pipelined seam
proposals streamed ahead are checked as they come (:meth:`Speculator.offer`) and wait in a
:class:`workers.speculation.staging.Staged`; a step uses, for each sequence it asked a draft for, the
one that fits its committed tokens, and decodes the others plainly (``no_proposal``).

Budgets: adaptive γ per sequence, +2 after a fully accepted chain, −1 otherwise; at 0 the sequence
decodes plainly for ``pause_steps`` steps and then tries one draft token again. A tree's node
budget halves after a pass that accepts nothing and doubles after any hit. With ``load_aware``,
each step's budgets come from :func:`workers.engine.budget.plan` within those caps.

When drafting does not pay, that costs a step next to nothing: a plan that is not drafted (it
drafts nothing, or the realized rates veto it) holds while the same sequences decode with the same
caps (:class:`workers.engine.budget.PlanHold`). Nothing the plan reads changes meanwhile but the
cost model's fit, by a few steps' weight (a sequence's acceptance moves only when its drafts are
verified, and none are asked), so the plan would say the same; refitting the cost model and planning
on every step of a fast target was the bulk of what the speculative path added to a step that did
not speculate. While a plan that drafts nothing holds and the batch cannot change its caps (no
sequence near its end, none paused), the rounds it holds are *quiet*: :meth:`Speculator.requests`
only checks that the batch is the same (every sequence keeps its ``load`` reason).
"""

from __future__ import annotations

from dataclasses import replace
from operator import attrgetter

import msgspec

from runtime.messages import SpecUsage
from runtime.spec_stats import SpecCounters

from ..speculation.checks import proposal_problem
from ..speculation.payloads import DraftOutput
from ..speculation.staging import SPARE_MAX, Staged, StagedUse, position_problem
from ..speculation.tree import tree_depths
from .budget import REPLAN_MAX, Acceptance, Calibration, PlanHold, RealizedRates, StepCost, plan
from .sequence import Sequence
from .spec_state import DRAFT_FAILED, Drafted, Request, SpecState  # noqa: F401 (importable from here, as before)

# Pipelined seam: the news of round r goes out after a step; a draft that keeps up streams its answer
# during the next step, and the target offers it before the one after, when news of round r + 1 has
# gone too. So an answer offered with ``rounds asked - 1 - r`` at 0 or 1 kept up; at 2 or more the
# draft took longer than a target step to answer (it is late, whatever it guessed).
LATE_ROUNDS = 2


_REQUEST_ID = attrgetter("request_id")


class Speculator:
    """Speculation state of every request of one engine; plain values in."""

    def __init__(self, vocab_size: int, num_speculative_tokens: int = 4, *, adaptive: bool = True,
                 pause_steps: int = 8, tree_topk: int = 0, tree_depth: int = 0, load_aware: bool = False):
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if tree_topk < 0 or tree_depth < 0:
            raise ValueError(f"tree_topk and tree_depth must be >= 0, got {tree_topk} and {tree_depth}")
        self.vocab_size = vocab_size
        self.num_speculative_tokens = num_speculative_tokens
        self.tree_topk = tree_topk
        self.tree_depth = tree_depth
        self.adaptive = adaptive
        self.pause_steps = pause_steps
        self.load_aware = load_aware
        self.cost = StepCost()
        self.realized = RealizedRates()  # the check on the cost model: tokens/s achieved, per batch size
        self.acceptance = Acceptance(decay=0.99)  # engine-wide, the prior of a new sequence's
        self.calibrations: dict[str, Calibration] = {}  # per draft worker: what its confidence is worth
        self.evidence_steps = 0  # steps that verified drafts on calibrated confidence above their request's record
        self.states: dict[str, SpecState] = {}
        self.counters: dict[str, SpecCounters] = {}  # per draft worker
        self.draft_id = ""  # the draft worker proposing now (set by the worker)
        self.planned_draft_tokens = 0  # draft tokens asked for in the latest round (a gauge)
        self.unplanned_steps = 0  # rounds the load-aware plan chose not to speculate although it could
        self.plans = 0  # load-aware plans made (steps held on a plan that drafts nothing make none)
        self._held = PlanHold()  # the plan not drafted that holds, for (decoding, caps)
        self._quiet = 0  # rounds of the held plan left quiet (see the module's docstring)
        self._quiet_ids: list[str] = []  # ... while the batch is these sequences
        self.dropped: dict[str, int] = {}  # proposals refused, by reason
        self.plain_steps: dict[str, int] = {}  # decode steps of speculating requests without a draft, by why
        self.released: list[str] = []  # sequences the draft worker knew and may forget
        # The seam (see workers.speculation.staging): False, the synchronous one (attach takes the answers
        # to the previous round); True, the pipelined one (proposals streamed ahead wait in ``staged``
        # and a step uses those that fit its sequences' committed tokens).
        self.pipelined = False
        self.staged = Staged(on_drop=self._drop)
        # pipelined: what was seen of the streamed proposals (late: drafted from news LATE_ROUNDS or
        # more rounds old); the step loop judges the draft's use by it (DraftWatch.observe_staged)
        self.staged_use = StagedUse()
        self.staged_by: dict[str, StagedUse] = {}  # the same, per draft worker
        self.bad_by: dict[str, int] = {}  # proposals dropped as malformed, per draft worker
        self.seen = 0  # grows whenever staged_by or bad_by do (a step that saw nothing of either reads no more)
        self.released_from: dict[str, str] = {}  # released sequence id -> the draft worker that knew it
        self.mixed = False  # some sequence was placed on a stream whose seam is not the default's

    def draft_of(self, st: SpecState) -> str:
        """The draft worker a sequence speculates with."""
        return self.draft_id if st.draft is None else st.draft

    def pipelined_of(self, st: SpecState) -> bool:
        """Whether a sequence's draft stream runs the pipelined seam."""
        return self.pipelined if st.pipelined is None else st.pipelined

    def assign(self, request_id: str, draft: str, pipelined: bool) -> bool:
        """Place a sequence on a draft worker's stream (a target with several); True when it moved:
        then the new draft hears the sequence from its start, and nothing the old one streamed for
        it is used. The old draft is told to forget it (see :meth:`take_released`)."""
        st = self.states.get(request_id)
        if st is None or (st.draft == draft and st.pipelined == pipelined):
            return False
        if st.told:
            self._release(request_id, st)
            st.told = 0
        self.staged.drop(request_id)
        st.draft, st.pipelined = draft, pipelined
        self.mixed |= pipelined != self.pipelined
        return True

    def unassign_draft(self, draft: str) -> list[str]:
        """A draft worker's stream ended: its sequences are placed afresh (the ones returned), and
        hear of their tokens from the start on the stream they move to; the gone stream is told nothing."""
        moved = []
        for rid, st in self.states.items():
            if self.draft_of(st) == draft:
                st.draft = st.pipelined = None
                st.told = 0
                self.staged.drop(rid)
                moved.append(rid)
        gone = [rid for rid, d in self.released_from.items() if d == draft]
        for rid in gone:
            del self.released_from[rid]
        if gone:
            drop = set(gone)
            self.released = [rid for rid in self.released if rid not in drop]
        return moved

    def _release(self, request_id: str, st: SpecState) -> None:
        self.released.append(request_id)
        self.released_from[request_id] = self.draft_of(st)

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, num_speculative_tokens: int | None, tree_topk: int | None,
            tree_depth: int | None, hint: str = "", lora: str = "") -> None:
        tokens = max(0, self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens)
        prior = self.acceptance.alpha
        self.states[request_id] = SpecState(tokens, tokens, tree_topk or self.tree_topk, tree_depth or self.tree_depth,
                                            acceptance=Acceptance(2 * prior, 2 * (1 - prior)), hint=hint, lora=lora)

    def forget(self, request_id: str) -> SpecState | None:
        self.staged.drop(request_id)
        st = self.states.pop(request_id, None)
        if st is not None and st.told:
            self._release(request_id, st)
        return st

    def forget_told(self, request_id: str) -> None:
        """The draft lost track of one sequence (a message to it failed): it forgets the sequence and
        hears it from the start next round."""
        st = self.states.get(request_id)
        if st is not None and st.told:
            st.told = 0
            self._release(request_id, st)

    def reset(self) -> None:
        """A new draft worker knows none of our sequences: start every one from scratch."""
        for st in self.states.values():
            st.told = 0
            st.draft = st.pipelined = None
        self.released.clear()
        self.released_from.clear()
        self.staged.clear()

    def usage(self, request_id: str) -> SpecUsage | None:
        """The request's counters, with its plain steps by why; None when it never speculated."""
        st = self.states.get(request_id)
        if st is None or not (st.usage.num_drafts or st.plain_steps):
            return None
        return msgspec.structs.replace(st.usage, plain_steps=dict(st.plain_steps), draft_id=self.draft_of(st))

    # ------------------------------------------------------------------ asking

    @property
    def quiet(self) -> bool:
        """A quiet stretch holds (see the module's docstring): the next round asks nothing if the batch is the same."""
        return self._quiet > 0

    def quiet_round(self, running: list[Sequence]) -> bool:
        """Take one round of a quiet stretch if it holds for ``running`` (the same batch); else end it."""
        if self._quiet > 0 and not (self.pipelined or self.mixed) and list(map(_REQUEST_ID, running)) == self._quiet_ids:
            self._quiet -= 1
            self.unplanned_steps += 1
            return True
        self._quiet = 0
        return False

    def requests(self, running: list[Sequence], max_model_len: int) -> list[Request]:
        """The sequences that decode next and should draft this round, with their budgets."""
        if self._quiet and self.quiet_round(running):
            return []
        caps: dict[str, int] = {}
        rooms: dict[str, int] = {}  # drafted tokens that can still be emitted
        decoding = 0
        horizon = REPLAN_MAX  # rounds in which no sequence's cap or room would change (0: one is paused)
        for seq in running:
            if seq.num_uncomputed != 1:
                continue
            decoding += 1
            st = self.states.get(seq.request_id)
            if st is None or st.num_speculative_tokens <= 0:
                continue
            st.asked = 0  # unless asked below: the pipelined seam drafts for it next step only if asked
            if st.adapted == 0:
                if st.pause > 0:
                    st.pause -= 1
                    st.why_plain = "paused"
                    horizon = 0
                    continue
                st.adapted = 1
            # A chain is no longer than what can still be emitted; a tree keeps its node budget (its
            # nodes take KV slots, hence max_model_len) and grows no deeper than that (max_depth).
            room = seq.params.max_tokens - seq.num_generated - 1
            k = min(st.adapted, max_model_len - len(seq) - 1)
            if k > 0 and room > 0:
                caps[seq.request_id], rooms[seq.request_id] = k, room
                st.why_plain = "draft_late"  # until its proposal arrives
                horizon = min(horizon, room - 1, max_model_len - len(seq) - 1 - st.adapted)
            else:
                st.why_plain = "no_room"
                horizon = 0
        # the synchronous seam plans before asking; the pipelined one when the proposals are in hand
        sync = {}
        if self.load_aware and caps:
            sync = caps if not (self.pipelined or self.mixed) else {
                sid: k for sid, k in caps.items() if not self.pipelined_of(self.states[sid])}
        if sync:
            planned = self._held.planned((decoding, sync), lambda: self._plan(sync, decoding), self.realized, decoding)
            if not any(planned.values()):
                self.unplanned_steps += 1
                if sync is caps and self._held.plan is planned and decoding == len(running) and horizon > 0:
                    self._quiet = min(self._held.left, horizon)  # (the cost model declines: quiet rounds)
                    self._held.left -= self._quiet
                    self._quiet_ids = list(map(_REQUEST_ID, running))
            for sid, k in planned.items():
                if k <= 0:
                    self.states[sid].why_plain = "load"
            caps = {sid: k for sid, k in (planned if sync is caps else {**caps, **planned}).items() if k > 0}
        self.planned_draft_tokens = sum(caps.values())
        if not caps:
            return []
        out = []
        for seq in running:
            k = caps.get(seq.request_id, 0)
            if k > 0:
                room = rooms[seq.request_id]
                st = self.states[seq.request_id]
                st.asked = k
                out.append(Request(seq, st, k, room if room < k else 0))
        return out

    def _plan(self, caps: dict[str, int], decoding: int) -> dict[str, int]:
        self.plans += 1
        return plan(caps, {sid: self.states[sid].acceptance.alpha for sid in caps}, decoding, self.cost)

    # ------------------------------------------------------------------ verifying

    def attach(self, proposals: dict[str, DraftOutput], running: list[Sequence], max_model_len: int,
               grammars) -> dict[str, Drafted]:
        """The proposals to verify this step, checked and cut to what may be emitted; their tokens are
        appended to their sequences. Synchronous seam: ``proposals`` answer the previous round; one for
        a sequence that does not decode next, for an older round, or that fails
        :func:`proposal_problem` is dropped (counted in ``dropped``). Pipelined seam: the ones that fit
        each sequence's committed tokens, from those :meth:`offer` kept (``proposals`` is unused)."""
        drafted: dict[str, Drafted] = {}
        if self.pipelined or self.mixed:
            found: list[tuple[Sequence, SpecState, DraftOutput]] = []
            for seq in running:
                st = self.states.get(seq.request_id)
                if st is None or seq.num_uncomputed != 1 or st.asked <= 0 or not self.pipelined_of(st):
                    continue
                had = self.staged.has(seq.request_id)
                prop = self.staged.take(seq.request_id, seq.token_ids)
                self._count_staged(st, looked=int(had))
                if prop is None:
                    st.why_plain = "no_proposal"
                    continue
                self._count_staged(st, found=1)
                found.append((seq, st, prop))
            if self.load_aware and found:
                found = self._plan_found(found, sum(1 for seq in running if seq.num_uncomputed == 1))
            for seq, st, prop in found:
                self._use(seq, st, prop, drafted, max_model_len, grammars)
        if not proposals:
            return drafted
        for seq in running:
            prop = proposals.get(seq.request_id)
            if prop is None:
                continue
            st = self.states.get(seq.request_id)
            if st is None or seq.num_uncomputed != 1 or prop.round != st.round - 1 or self.pipelined_of(st):
                self._drop("stale")
                if st is not None:
                    st.why_plain = "draft_stale"
                continue
            problem = proposal_problem(prop, max(st.asked, 1), self.vocab_size)
            if problem is not None:
                self._drop(problem, st)
                st.why_plain = "draft_invalid"
                continue
            self._use(seq, st, prop, drafted, max_model_len, grammars)
        return drafted

    def _plan_found(self, found: list[tuple[Sequence, SpecState, DraftOutput]], decoding: int
                    ) -> list[tuple[Sequence, SpecState, DraftOutput]]:
        """Pipelined seam, load-aware: asking cost the step nothing, so the plan is made here, with the
        proposals in hand. A proposal that carries the draft's confidence is judged by it, calibrated
        (:class:`Calibration`: what that draft's claims have been worth here), or by its sequence's
        acceptance so far where that says more; one without, by the acceptance alone. Where
        speculating has measurably done worse than plain decoding at this batch size
        (:class:`RealizedRates`), only proposals with evidence of their own may still be verified,
        each still only if the cost model says it pays. The proposals kept are cut to their planned
        length; the others wait (``load``)."""
        caps, gains = {}, {}
        alphas = {seq.request_id: st.acceptance.alpha for seq, st, _ in found}
        for seq, st, prop in found:
            sid = seq.request_id
            caps[sid] = min(max(st.adapted, 1), len(prop.token_ids))
            if prop.confidence and not prop.is_tree:  # evidence adds to the request's record, never takes from it
                calib = self.calibrations.setdefault(self.draft_of(st), Calibration())
                gains[sid] = [max(g, alphas[sid] ** j) for j, g in enumerate(calib.gains(prop.confidence), 1)]
        planned = plan(caps, alphas, decoding, self.cost, gains)
        if any(planned.values()) and not self.realized.allow(decoding):
            planned = {sid: (k if sid in gains else 0) for sid, k in planned.items()}
        if any(planned[sid] and g[0] > alphas[sid] for sid, g in gains.items()):
            self.evidence_steps += 1  # drafts verified on confidence above the request's own record
        if not any(planned.values()):
            self.unplanned_steps += 1
        self.planned_draft_tokens = sum(planned.values())
        kept = []
        for seq, st, prop in found:
            k = planned.get(seq.request_id, 0)
            if k <= 0:
                st.why_plain = "load"
                continue
            if k < len(prop.token_ids) and not prop.is_tree:
                prop = replace(prop, token_ids=prop.token_ids[:k], distributions=prop.distributions[:k],
                               confidence=prop.confidence[:k])
            kept.append((seq, st, prop))
        return kept

    def offer(self, proposals: list[DraftOutput]) -> None:
        """Pipelined seam: check proposals streamed ahead (as strictly as answers: ids, lengths,
        parents, probabilities, and their position and assumed tokens) and keep the sound ones for
        :meth:`attach`. One for a sequence that is gone is dropped as ``stale``; one that claims to
        answer a round not asked yet, or fails a check, is dropped as malformed. A sound one drafted
        from news ``LATE_ROUNDS`` or more rounds old counts as late (``staged_use``)."""
        for prop in proposals:
            st = self.states.get(prop.seq_id)
            if st is None:
                self._drop("stale")
                continue
            # a streamed proposal may carry a few more tokens than a round verifies, so that after the
            # target decoded its first ones plainly the rest is still a whole round
            problem = ("round" if prop.round >= st.round else position_problem(prop, self.vocab_size)
                       or proposal_problem(prop, max(st.num_speculative_tokens, 1) + SPARE_MAX, self.vocab_size))
            if problem is not None:
                self._drop(problem, st)
                continue
            self._count_staged(st, arrived=1, late=int(st.round - 1 - prop.round >= LATE_ROUNDS))
            self.staged.offer(prop)

    def _count_staged(self, st: SpecState, looked: int = 0, found: int = 0, arrived: int = 0, late: int = 0) -> None:
        """Add to what was seen of streamed proposals, engine-wide and for the sequence's draft worker."""
        draft = self.draft_of(st)
        self.seen += 1
        mine = self.staged_by.get(draft)
        if mine is None:
            mine = self.staged_by[draft] = StagedUse()
        for use in (self.staged_use, mine):
            use.looked += looked
            use.found += found
            use.arrived += arrived
            use.late += late

    def _use(self, seq: Sequence, st: SpecState, prop: DraftOutput, drafted: dict[str, Drafted],
             max_model_len: int, grammars) -> None:
        """Cut a sound proposal to what may be verified and attach it to ``seq``."""
        st.why_plain = "draft_empty"  # unless something of it is verified below
        if not prop.token_ids:
            return
        room = seq.params.max_tokens - seq.num_generated - 1  # drafts that can still be emitted
        k = min(len(prop.token_ids), max(st.adapted, 1), max_model_len - len(seq) - 1)
        d = Drafted(seq, list(prop.token_ids), list(prop.distributions),
                    list(prop.parents) if prop.is_tree else [])
        if d.parents:  # nodes within the budget (a prefix), and no deeper than can be emitted
            d = d.keep(k)
            depth = tree_depths(d.parents)
            d = d.subset([i for i in range(len(d.tokens)) if depth[i] <= room])
        else:
            d = d.keep(min(k, room))
        if d.tokens and seq.grammar is not None:
            # Structured output: the grammar's masks for every node, and nothing below a token it
            # forbids (that token is rejected for certain; it stays, its rejection uses its q).
            d.masks = grammars.new_masks(len(d.tokens) + 1)
            d = d.subset(seq.grammar.fill_draft(d.masks, d.tokens, d.parents))
        if d.tokens:
            seq.token_ids.extend(d.tokens)
            drafted[seq.request_id] = d
            st.why_plain = ""
            st.confidence = list(prop.confidence[: len(d.tokens)]) if not d.parents else []

    def unasked(self, running: list[Sequence], why: str) -> None:
        """No proposals are asked for this round (``why``: no draft worker, or it is backed off)."""
        self._held.left = self._quiet = 0  # a plan holds over consecutive rounds only: the next one asked is planned afresh
        for seq in running:
            st = self.states.get(seq.request_id)
            if st is not None and st.num_speculative_tokens > 0 and seq.num_uncomputed == 1:
                st.why_plain = why
                st.asked = 0  # nor does the pipelined seam use what the draft streamed ahead

    def count_plain(self, seq: Sequence) -> None:
        """``seq`` (speculating) decoded this step without a draft: count why."""
        st = self.states.get(seq.request_id)
        if st is None or st.num_speculative_tokens <= 0 or not st.why_plain:  # nobody decided about drafting: plain by design
            return
        why = st.why_plain
        if why in DRAFT_FAILED:  # the draft had its chance and gave nothing
            self._tally(st, self.draft_of(st), 0)
        st.plain_steps[why] = st.plain_steps.get(why, 0) + 1
        self.plain_steps[why] = self.plain_steps.get(why, 0) + 1
        if not self._quiet:  # (quiet rounds keep their sequences' reason, ``load``)
            st.why_plain = ""

    @staticmethod
    def _tally(st: SpecState, draft: str, accepted: int) -> None:
        """One decode step of ``st`` on ``draft``: ``accepted`` draft tokens (its fit, see placement)."""
        fit = st.fit.setdefault(draft, [0, 0])
        fit[0] += 1
        fit[1] += accepted

    def _drop(self, reason: str, st: SpecState | None = None) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if st is not None and reason not in ("stale", "overflow"):
            draft = self.draft_of(st)
            self.bad_by[draft] = self.bad_by.get(draft, 0) + 1
            self.seen += 1

    @property
    def num_bad_proposals(self) -> int:
        """Proposals dropped as malformed so far (not those that merely arrived for a sequence that no
        longer decodes next or guessed an outcome that did not come true, which is no fault of the draft)."""
        return sum(n for reason, n in self.dropped.items() if reason not in ("stale", "overflow"))

    def record(self, d: Drafted, accepted: int) -> SpecState:
        """Count one verified proposal of which ``accepted`` tokens were accepted; adapt the budget."""
        st = self.states[d.seq.request_id]
        k, depth = len(d.tokens), d.depth
        u = st.usage
        per_pos = list(u.accepted_per_pos) + [0] * (depth - len(u.accepted_per_pos))
        for i in range(accepted):
            per_pos[i] += 1
        st.usage = msgspec.structs.replace(u, num_drafts=u.num_drafts + 1, num_draft_tokens=u.num_draft_tokens + k,
                                           num_accepted_tokens=u.num_accepted_tokens + accepted,
                                           accepted_per_pos=per_pos)
        draft = self.draft_of(st)
        self.counters.setdefault(draft, SpecCounters()).observe_draft(k, accepted, depth)
        self._tally(st, draft, accepted)
        st.acceptance.observe(depth, accepted)
        self.acceptance.observe(depth, accepted)
        if st.confidence and not d.parents:
            self.calibrations.setdefault(draft, Calibration()).observe(st.confidence[:k], accepted)
        st.confidence = []
        if self.adaptive:
            if d.parents:  # a tree: nodes off the accepted path are spent by design, so only a pass that
                # accepts nothing says the draft is off (the budget halves); any hit doubles it again
                st.adapted = min(st.num_speculative_tokens, max(2 * st.adapted, st.adapted + 2)) if accepted else st.adapted // 2
            else:
                st.adapted = min(st.num_speculative_tokens, st.adapted + 2) if accepted == depth else max(0, st.adapted - 1)
            if st.adapted == 0:
                st.pause = self.pause_steps
        return st

    def observe_cycle(self, tokens: int, verified: int, decoding: int, emitted: int, seconds: float,
                      asked: bool = False) -> None:
        """Feed the cost model one decode/verify step (or a serving cycle around it). ``asked``: a
        round of proposals was asked for this step; when it came late the step verified nothing but
        still paid for speculating (the wait), so it counts as a speculating step, not a plain one."""
        if tokens:
            attempted = verified > 0 or asked
            self.cost.observe(tokens, seconds, verified, attempted)
            self.realized.observe(decoding, attempted, emitted, seconds)
