"""The draft side of the pipelined seam: what to draft ahead for each sequence, and the proposals that
come of it. No gRPC, no asyncio: the service calls it from its worker thread.

The target steps without waiting; after each step it sends what it committed (a verdict, and a
round request carrying the tokens since). For each sequence the stager keeps the committed tokens
it has heard of and the proposals it has streamed. On news of a sequence it works out, by the rule
the target uses (:func:`workers.speculation.staging.overlap`), which streamed proposal the target
will verify next (the one that fits its committed tokens with the most tokens left), and then:

- **answer**: when none fits (nor one that fits after the plain step the target takes meanwhile, if
  its token is the one that proposal assumes last: then it stages from that one instead), it
  drafts one from the committed tokens and streams it at once (the
  target uses it if it comes in time, else decodes plainly and may still use it trimmed). Every
  proposal carries a few spare tokens past γ (the target verifies γ): one per plain target step it
  may arrive after (an answer: 1 + the lag; a staged one: the lag, 0 when the stager keeps up, the
  lag being the target steps between its last two draftings for the sequence, less one), so that
  what is left after those steps committed its first tokens is still a whole round;
- **stage** (SGLang's decoupled speculation): for the proposal the target verifies next,
  x_1..x_k, every outcome is a = 0..k accepted tokens followed by a bonus token the target draws.
  It guesses the bonus (a = k: the draft's own next token x_{k+1} and its top ``alternatives``
  others; a < k: the draft's top ``alternatives`` tokens at that depth other than x_{a+1}, which the
  target rejected) and drafts
  γ tokens after each guess, every branch in one batched call
  (:meth:`.drafter.Drafter.draft`: one draft pass per depth for all of them). Each staged
  proposal names the prefix it assumes (``start``, ``assumed``), so the target can tell which one
  came true. ``alternatives = 0`` is the rolling tail: only the a = k branch, the draft continuing
  its own chain as if everything were accepted.

Staging happens once per proposal: news that does not change the one in use (a plain step that
it already covers, trimmed) drafts nothing new. With no news waiting, a stager running late stages
one level further for the likeliest outcome (:meth:`Stager.stage_ahead`: everything accepted and the
bonus as the draft guessed it), so that it still serves that case in time. A staged proposal is only a guess; the
target validates and verifies it like any other, so nothing here affects what the target emits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..speculation.payloads import DraftOutput, SamplingSpec, VerifyResult
from ..speculation.staging import ASSUMED_MAX, SPARE_MAX, given, one_ahead, overlap
from .drafter import Branch, Draft, Drafter

ASSUMED_CONTEXT = 4  # committed tokens every proposal names before its unconfirmed ones
SENT_MAX = 64  # proposals remembered per sequence


# Where a drafting call's proposals go the moment they exist, before the call returns (see Stager._draft);
# called in the drafting thread
Early = Callable[[list[DraftOutput]], None]


@dataclass
class _Sent:
    prop: DraftOutput  # as streamed (positioned)
    chain: Draft  # as drafted: one token more than streamed (the guess of the bonus after it)
    expect: int = 0  # its first tokens the target is expected to commit plainly before it arrives
    staged: bool = False  # the outcomes of verifying it were staged


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # committed, as heard
    sent: list[_Sent] = field(default_factory=list)  # oldest first
    likely: tuple[_Sent, tuple[int, ...]] | None = None  # the latest likeliest staged one, and what it assumes
    round: int = 0  # the latest round heard of
    drafted_round: int = 0  # the latest round heard of when it was last drafted for
    lag: int = 1  # target steps between its last two draftings: how far the target gets meanwhile
    num_speculative_tokens: int = 0  # γ the target asked for last

    def spare(self, answer: bool) -> int:
        """Plain target steps a proposal is expected to arrive after (each commits one of its tokens, so
        it carries as many past γ): an answer comes a step late (the target decoded plainly while it was
        drafted) plus the lag; a staged proposal, the lag only (0 when the stager keeps up)."""
        return min(max(self.lag, 1) - (0 if answer else 1), SPARE_MAX)


class Stager:
    """Per-sequence staging for one proposer; plain values in."""

    def __init__(self, drafter: Drafter, alternatives: int = 1):
        if alternatives < 0:
            raise ValueError(f"alternatives must be >= 0, got {alternatives}")
        self.drafter = drafter
        self.alternatives = alternatives
        self._seqs: dict[str, _Seq] = {}
        self.answered = 0  # proposals drafted from the committed tokens (nothing streamed fitted)
        self.staged = 0  # staged proposals streamed
        self.stagings = 0  # proposals whose outcomes were staged

    def __len__(self) -> int:
        return len(self._seqs)

    # ------------------------------------------------------------------ news from the target

    def commit(self, seq_id: str, round_: int, tokens: list[int], num_speculative_tokens: int, hidden_states: list = (),
               sampling: SamplingSpec = SamplingSpec()) -> None:
        """A round request: the tokens committed since the last news (with their hidden rows, for a
        drafter that reads them), and the budget to draft."""
        seq = self._seqs.setdefault(seq_id, _Seq())
        seq.tokens.extend(tokens)
        seq.round, seq.num_speculative_tokens = max(seq.round, round_), num_speculative_tokens
        self.drafter.commit(seq_id, list(tokens), hidden_states, sampling)

    def verified(self, results: list[VerifyResult]) -> None:
        self.drafter.verified(results)
        for result in results:
            seq = self._seqs.get(result.seq_id)
            if seq is not None:
                seq.tokens.extend(result.emitted_tokens)

    def release(self, seq_ids: list[str]) -> None:
        self.drafter.release(seq_ids)
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    # ------------------------------------------------------------------ drafting

    def _in_use(self, seq: _Seq) -> tuple[_Sent, int] | None:
        """The streamed proposal the target verifies next (by its own rule), and how much of it is committed."""
        best, best_left = None, 0
        n = len(seq.tokens)
        for sent in seq.sent:
            if sent.prop.start > n:
                continue
            over = overlap(sent.prop, seq.tokens)
            if over is not None and len(sent.prop.token_ids) - over >= best_left:
                best, best_left = (sent, over), len(sent.prop.token_ids) - over
        return best

    def _next_up(self, seq: _Seq) -> _Sent | None:
        """When none fits: a streamed proposal that fits once the target commits one token more, the one
        it guessed (the target decodes plainly now: its staged proposal came late; if its token is the
        guess, it verifies this one next). The likeliest such one: the latest drafted."""
        return next((s for s in reversed(seq.sent) if one_ahead(s.prop, seq.tokens)), None)

    def answer(self, seq_ids: list[str], early: Early | None = None) -> list[DraftOutput]:
        """Proposals from the committed tokens for the sequences none of whose streamed proposals fits
        now or, likely, after the plain step the target takes meanwhile (``early``: see :meth:`_draft`)."""
        out = self._draft(self._answers(seq_ids), early=early)
        self.answered += len(out)
        return out

    def _answers(self, seq_ids: list[str]) -> list:
        todo = []
        for seq_id in seq_ids:
            seq = self._seqs.get(seq_id)
            if seq is None or seq.num_speculative_tokens <= 0:
                continue
            seq.sent = [s for s in seq.sent if s.prop.start > len(seq.tokens) or overlap(s.prop, seq.tokens) is not None]
            self._note_round(seq)
            if self._in_use(seq) is None and self._next_up(seq) is None:
                spare = seq.spare(True)
                todo.append((seq_id, Branch(seq_id, (), seq.num_speculative_tokens + spare + 1, self.alternatives), False, spare, False))
        return todo

    def answer_and_stage(self, seq_ids: list[str], early: Early | None = None) -> tuple[list[DraftOutput], list[str]]:
        """:meth:`answer` for the sequences that need one and :meth:`stage` for the others, in one
        drafting call (a model-based drafter: one batched pass per depth for all their branches), so
        that one sequence's late proposal does not hold back the others' staged ones. Returns the
        proposals and the sequences answered (whose outcomes can be staged once their answer exists:
        :meth:`stage` them next)."""
        answers = self._answers(seq_ids)
        asked = list(dict.fromkeys(item[0] for item in answers))
        out = self._draft(answers + self._stagings([s for s in seq_ids if s not in set(asked)]), early=early)
        answered = sum(1 for p in out if p.seq_id in set(asked))
        self.answered += answered
        self.staged += len(out) - answered
        return out, asked

    @staticmethod
    def _note_round(seq: _Seq) -> None:
        if seq.drafted_round:
            seq.lag = seq.round - seq.drafted_round
        seq.drafted_round = seq.round

    def stage(self, seq_ids: list[str], early: Early | None = None) -> list[DraftOutput]:
        """Staged proposals for the outcomes of the proposal each sequence verifies next (once per proposal)."""
        out = self._draft(self._stagings(seq_ids), early=early)
        self.staged += len(out)
        return out

    def _stagings(self, seq_ids: list[str]) -> list:
        todo = []
        for seq_id in seq_ids:
            seq = self._seqs.get(seq_id)
            if seq is None or seq.num_speculative_tokens <= 0:
                continue
            found = self._in_use(seq)
            if found is not None:
                sent, over = found
                if not sent.staged:
                    todo += self._outcomes(seq_id, seq, sent, over, (), seq.spare(False))
                continue
            nxt = self._next_up(seq)  # after the plain step the target takes now
            if nxt is not None and not nxt.staged:
                todo += self._outcomes(seq_id, seq, nxt, 0, (nxt.prop.assumed[-1],), seq.spare(False))
        return todo

    def behind(self, seq_ids: list[str]) -> bool:
        """Whether :meth:`stage_ahead` has anything to draft for these sequences (plain values only: the
        service asks before it hands the call to the drafting thread)."""
        return any((seq := self._seqs.get(s)) is not None and seq.likely is not None and not seq.likely[0].staged
                   and seq.lag > 1 for s in seq_ids)

    def stage_ahead(self, seq_ids: list[str], early: Early | None = None) -> list[DraftOutput]:
        """One level further, before any news: for each sequence the stager is late for (its lag over
        one step), the outcomes of its likeliest staged proposal (the one after a fully accepted round,
        the bonus guessed by the draft itself), so that they are out in time when that is what happens."""
        todo = []
        for seq_id in seq_ids:
            seq = self._seqs.get(seq_id)
            likely = seq.likely if seq is not None else None
            if likely is None or likely[0].staged or seq.lag <= 1:  # keeping up: the news comes in time
                continue
            sent, extra = likely
            seq.likely = None
            todo += self._outcomes(seq_id, seq, sent, 0, extra, sent.expect)
        out = self._draft(todo, remember=False, early=early)  # one level ahead of what is in use, not more
        self.staged += len(out)
        return out

    def _outcomes(self, seq_id: str, seq: _Seq, sent: _Sent, over: int, base: tuple[int, ...], spare: int) -> list:
        """The branches for the outcomes of verifying ``sent`` (``over`` of its tokens committed; ``base``:
        the tokens it assumes past the committed ones)."""
        sent.staged = True
        self.stagings += 1
        drafted, alternatives = sent.chain.tokens, sent.chain.alternatives
        # the target verifies it after committing ``pre`` plainly (it was expected to arrive that late),
        # γ tokens at most: ``x``
        skip = over + max(0, sent.expect - over)
        pre = base + tuple(drafted[over:skip])
        x = drafted[skip : skip + seq.num_speculative_tokens]
        k = len(x)
        size = seq.num_speculative_tokens + spare + 1  # drafted per branch: γ, spare ones, a guess of what follows
        todo = []
        for j in range(over, skip):  # a token expected to be committed plainly first, the target's another:
            alts = alternatives[j] if j < len(alternatives) else []  # the draft's alternatives to it
            for b in [t for t in alts if t != drafted[j]][: self.alternatives]:
                todo.append((seq_id, Branch(seq_id, base + tuple(drafted[over:j]) + (b,), size, self.alternatives),
                             False, spare, False))
        for a in range(k + 1):
            if a < k:
                alts = alternatives[skip + a] if skip + a < len(alternatives) else []
                for b in [t for t in alts if t != x[a]][: self.alternatives]:
                    todo.append((seq_id, Branch(seq_id, pre + tuple(x[:a]) + (b,), size, self.alternatives),
                                 False, spare, False))
            elif skip + k < len(drafted):  # its draft of the token after them, and the alternatives to that:
                # the guesses of a = k's bonus (the first is the likeliest outcome of all)
                alts = alternatives[skip + k] if skip + k < len(alternatives) else []
                nxt = drafted[skip + k]
                for i, b in enumerate([nxt] + [t for t in alts if t != nxt][: self.alternatives]):
                    todo.append((seq_id, Branch(seq_id, pre + tuple(x) + (b,), size, self.alternatives),
                                 False, spare, i == 0))
            else:  # no such draft (a proposal trimmed to its end): the branch drafts its own guess first
                todo.append((seq_id, Branch(seq_id, pre + tuple(x), size + 1, self.alternatives), True, spare, True))
        return todo

    def _draft(self, todo: list[tuple[str, Branch, bool, int, bool]], remember: bool = True,
               early: Early | None = None) -> list[DraftOutput]:
        """Draft the branches in one call; ``guess_first``: the chain's first token is the guess of the
        bonus token (part of the assumed prefix), the proposal what follows it; ``likely``: the
        likeliest outcome's branch, which :meth:`stage_ahead` goes on from (when ``remember``).
        With ``early``, a drafter that says its chains are ready before its last pass (the last
        drafted token of each only guesses what follows, and is not streamed) has the proposals
        handed to ``early`` then, from the drafting thread; the call's full chains complete them when
        it returns."""
        if not todo:
            return []
        made: list[tuple[int, _Sent]] = []
        if early is None:
            chains = self.drafter.draft([item[1] for item in todo])
        else:
            def ready(partial: list[Draft]) -> None:
                if not made:
                    made.extend(self._proposals(todo, partial, remember))
                    early([sent.prop for _, sent in made])

            chains = self.drafter.draft([item[1] for item in todo], ready)
        if not made:
            made = self._proposals(todo, chains, remember)
        else:  # streamed already: each keeps its whole chain, whose last token the next staging guesses from
            for i, sent in made:
                sent.chain = self._streamed(todo[i][1], todo[i][2], chains[i])[1]
        return [sent.prop for _, sent in made]

    @staticmethod
    def _streamed(branch: Branch, guess_first: bool, chain: Draft) -> tuple[list[int], Draft, list[int]]:
        """What a branch's chain streams: the tokens it assumes, its chain past them, and the tokens
        proposed (all but the last drafted, which only guesses what follows)."""
        extra = list(branch.extra)
        if guess_first and chain.tokens:
            extra.append(chain.tokens[0])
            chain = Draft(chain.tokens[1:], chain.alternatives[1:], given(chain.confidence, 1))
        return extra, chain, chain.tokens[: branch.num_tokens - 1 - guess_first]

    def _proposals(self, todo: list[tuple[str, Branch, bool, int, bool]], chains: list[Draft],
                   remember: bool) -> list[tuple[int, _Sent]]:
        """The proposals of a drafting call's chains, remembered per sequence; with their places in ``todo``."""
        out = []
        for i, ((seq_id, branch, guess_first, expect, likely), chain) in enumerate(zip(todo, chains)):
            if guess_first and not chain.tokens:
                continue
            seq = self._seqs[seq_id]
            extra, chain, tokens = self._streamed(branch, guess_first, chain)
            if not tokens or len(extra) + ASSUMED_CONTEXT > ASSUMED_MAX:
                continue
            context = seq.tokens + extra
            start = len(context)
            assumed = context[max(0, start - len(extra) - ASSUMED_CONTEXT) :]
            confidence = chain.confidence[: len(tokens)] if len(chain.confidence) >= len(tokens) else []
            prop = DraftOutput(seq_id, seq.round, tokens, start=start, assumed=assumed, confidence=confidence)
            sent = _Sent(prop, chain, expect)
            seq.sent.append(sent)
            if likely and remember:
                seq.likely = (sent, tuple(extra))
            if len(seq.sent) > SENT_MAX:
                del seq.sent[0]
            out.append((i, sent))
        return out
