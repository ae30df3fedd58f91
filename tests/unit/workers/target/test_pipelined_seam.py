"""The pipelined seam end to end in one process: a real tiny engine and step loop, a real draft service
over loopback gRPC (staging oracle and n-gram proposers), and what the step loop does when the draft is
late or wrong: it decodes plainly, never waits, and emits what the target alone emits."""

from __future__ import annotations

import asyncio

import pytest

from runtime.messages import SamplingParams
from tests.unit.workers.draft.loopback import draft_on_loopback
from workers.draft.ngram import NgramProposer
from workers.draft.oracle import OracleProposer
from workers.draft.service import DraftService
from workers.engine.engine import Engine, EngineConfig
from workers.speculation.payloads import DraftOutput
from workers.target.draft_watch import DraftWatch
from workers.target.seam import PipelinedSeam
from workers.target.step_loop import StepLoop
from tests.support.draft_pool import FixedPool as _Pool, NewsByParts
from tests.support.serving import serve_through
from tests.support.wait import eventually

pytestmark = pytest.mark.unit

CFG = EngineConfig(num_blocks=128, block_size=4)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = {"a": list(range(10, 22)), "b": [7, 8, 9, 7, 8, 9, 7, 8, 9, 7], "c": list(range(40, 47))}


@pytest.fixture(scope="module")
def expected(model):
    return Engine(model, CFG).generate(PROMPTS, PARAMS)


async def serve_with(model, client) -> tuple[Engine, StepLoop, dict[str, list[int]]]:
    """Every prompt through a fresh engine (γ 3, fixed) and step loop drafting over ``client``."""
    engine = Engine(model, CFG, num_speculative_tokens=3, adaptive=False)
    loop = StepLoop(engine, _Pool(client))
    loop.start()
    try:
        return engine, loop, await serve_through(loop, PROMPTS, PARAMS)
    finally:
        await loop.stop()


@pytest.mark.parametrize("method", ["oracle", "ngram"])
async def test_pipelined_greedy_equals_the_target_alone_and_never_waits(model, expected, method):
    if method == "oracle":
        refs = [PROMPTS[r] + expected[r] for r in PROMPTS]
        proposer = OracleProposer(refs, 0.2, 256, seed=3)
    else:
        proposer = NgramProposer(1, 3)
    service = DraftService(proposer, "d1", 8)
    async with draft_on_loopback(service, pipelined=True, vocab_size=256) as client:
        assert client.seam.pipelined
        engine, loop, got = await serve_with(model, client)
    assert got == expected
    assert loop.drafting.wait_seconds == 0.0  # the pipelined loop awaits no proposal
    assert service.stager.staged > 0 and engine.spec.num_bad_proposals == 0
    if method == "oracle":  # (a random model's output repeats nothing an n-gram could find)
        counters = engine.counters["d1"]
        assert counters.num_drafts > 0 and counters.num_accepted_tokens > 0


class _Scripted(NewsByParts):
    """A pipelined draft stream stand-in: whatever ``script(seq_id, committed)`` streams, nothing else."""

    def __init__(self, script):
        self.draft_id, self.method, self.hidden_layers, self.hidden_dtype = "d", "scripted", [], ""
        self.broken, self.script = False, script
        self.seam = PipelinedSeam(self)
        self.inbox: list[DraftOutput] = []
        self.committed: dict[str, list[int]] = {}
        self.sent = 0
        self.requests: list[tuple[str, int, list[int]]] = []  # (seq id, round, new tokens), as sent

    def send(self, requests):
        self.sent += 1
        self.requests += [(r.seq_id, r.round, list(r.new_tokens)) for r in requests]
        for r in requests:
            seq = self.committed.setdefault(r.seq_id, [])
            seq.extend(r.new_tokens)
            self.inbox.extend(self.script(r.seq_id, r.round, list(seq)))
        return {}

    def take(self):
        out, self.inbox = self.inbox, []
        return out

    def verified(self, outcomes):
        for o in outcomes:
            self.committed[o.seq_id].extend(o.emitted_tokens)

    def release(self, ids):
        pass

    async def flush(self, timeout):
        return True


async def run_scripted(model, script, max_tokens=12):
    engine = Engine(model, CFG, num_speculative_tokens=3, adaptive=False)
    client = _Scripted(script)
    loop = StepLoop(engine, _Pool(client))
    loop.start()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        queue = loop.submit("a", PROMPTS["a"], params)
        deltas = []
        while not deltas or not deltas[-1].finish_reason:
            deltas.append(await asyncio.wait_for(queue.get(), 30))
    finally:
        await loop.stop()
    return engine, loop, deltas


async def test_a_proposal_with_a_wrong_assumed_prefix_is_never_used(model, expected):
    want = expected["a"][:12]

    def wrong_prefix(seq_id, round_, committed):
        # right tokens, at the right position, but assuming a different last token: never to be used
        n = len(committed)
        ref = PROMPTS["a"] + want
        bad = (committed[-1] + 1) % 256
        return [DraftOutput(seq_id, round_, ref[n : n + 3], start=n, assumed=committed[-3:-1] + [bad]),
                DraftOutput(seq_id, round_, ref[n + 1 : n + 4], start=n + 1, assumed=[(ref[n] + 1) % 256])]

    engine, loop, deltas = await run_scripted(model, wrong_prefix)
    assert [t for d in deltas for t in d.token_ids] == want
    assert engine.counters.get("d") is None or engine.counters["d"].num_drafts == 0
    assert deltas[-1].usage.spec.plain_steps == {"no_proposal": 10, "no_room": 1}
    assert engine.spec.dropped.get("stale", 0) > 0 and engine.spec.num_bad_proposals == 0


async def test_missing_staged_proposals_mean_plain_steps_not_waits(model, expected):
    want = expected["a"][:12]
    engine, loop, deltas = await run_scripted(model, lambda *_: [])
    assert [t for d in deltas for t in d.token_ids] == want
    assert loop.drafting.wait_seconds == 0.0
    assert deltas[-1].usage.spec.plain_steps == {"no_proposal": 10, "no_room": 1}


async def test_a_partly_committed_proposal_is_trimmed_and_used(model, expected):
    want = expected["a"][:12]

    def one_behind(seq_id, round_, committed):
        # drafted from one token before the end: the target has committed its first token already
        n = len(committed) - 1
        ref = PROMPTS["a"] + want
        return [DraftOutput(seq_id, round_, ref[n : n + 3], start=n, assumed=committed[n - 2 : n])]

    engine, loop, deltas = await run_scripted(model, one_behind)
    assert [t for d in deltas for t in d.token_ids] == want
    counters = engine.counters["d"]
    assert counters.num_drafts > 0 and counters.num_accepted_tokens == counters.num_draft_tokens


async def test_the_draft_hears_a_prompt_before_its_prefill_and_the_first_decode_step_verifies(model, expected):
    """A new request's prompt goes to the draft from the engine's thread before its prefill step, so a
    proposal guessing the prefill's token can be there for the first decode step (otherwise that step
    is plain: the first request would carry the prefill's token, sent after the step). The prefill's
    token then follows as round 1's news."""
    want = expected["a"][:12]
    first: list[tuple[int, list[int]]] = []

    def from_the_prompt(seq_id, round_, committed):
        if round_ != 0:
            return []
        first.append((len(committed), list(committed)))
        n = len(committed)  # the prompt: its proposal begins with the guess of the prefill's token
        return [DraftOutput(seq_id, round_, want[:4], start=n, assumed=committed[-2:])]

    engine, loop, deltas = await run_scripted(model, from_the_prompt)
    assert [t for d in deltas for t in d.token_ids] == want
    assert first == [(len(PROMPTS["a"]), PROMPTS["a"])]
    client = loop.pool.client
    assert client.requests[:2] == [("a", 0, PROMPTS["a"]), ("a", 1, want[:1])]
    counters = engine.counters["d"]
    # the first decode step verified the proposal's three tokens after the guessed one, all accepted
    assert counters.num_drafts == 1 and counters.num_accepted_tokens == 3
    assert deltas[1].token_ids == want[1:5]
    assert deltas[-1].usage.spec.plain_steps == {"no_proposal": 6, "no_room": 1}  # the rest: none streamed


@pytest.mark.parametrize("bad", ["token_id", "assumed", "position", "round", "too_long"])
async def test_malformed_streamed_proposals_are_dropped_and_counted(model, expected, bad):
    want = expected["a"][:12]

    def hostile(seq_id, round_, committed):
        n = len(committed)
        ref = PROMPTS["a"] + want
        good = DraftOutput(seq_id, round_, ref[n : n + 3], start=n, assumed=committed[-2:])
        return [{"token_id": DraftOutput(seq_id, round_, [999] + ref[n + 1 : n + 3], start=n, assumed=committed[-2:]),
                 "assumed": DraftOutput(seq_id, round_, ref[n : n + 3], start=n, assumed=[-5]),
                 "position": DraftOutput(seq_id, round_, ref[n : n + 3], start=0),
                 "round": DraftOutput(seq_id, round_ + 5, ref[n : n + 3], start=n, assumed=committed[-2:]),
                 "too_long": DraftOutput(seq_id, round_, ref[n : n + 8], start=n, assumed=committed[-2:]),
                 }[bad], good]

    engine, loop, deltas = await run_scripted(model, hostile)
    assert [t for d in deltas for t in d.token_ids] == want
    assert engine.spec.dropped.get(bad, 0) > 0


async def test_flush_returns_once_what_was_queued_is_written_to_the_stream():
    """The step loop flushes the draft stream before each pipelined step (so that the round requests the
    draft stages from leave before the step's thread takes the interpreter): flush waits for the
    writes, and a broken stream does not hold a step. (On gRPC: a fast lane writes each message as
    it is put, and the queue stays empty.)"""
    refs = [PROMPTS["a"] + list(range(30))]
    service = DraftService(OracleProposer(refs, 0.0, 256), "d1", 8)
    async with draft_on_loopback(service, pipelined=True, vocab_size=256, lanes=False) as client:
        assert client.lane is None
        from workers.speculation.convert import draft_input_to_pb
        from workers.speculation.payloads import DraftInput

        for rnd in range(20):
            client.send([draft_input_to_pb(DraftInput("a", rnd, PROMPTS["a"] if rnd == 0 else [], 3), "")])
        assert client._outgoing.qsize() > 0  # nothing written yet: the loop has not run the writer
        assert await client.flush(5.0)
        assert client._outgoing.empty()
        await asyncio.wait_for(client._outgoing.join(), 0.1)  # and every message taken was marked done
        client._break("test", quiet=True)
        assert not await client.flush(5.0)


class _Counting(DraftService):
    """A draft service that counts the kinds of message its targets send (``takes_step_news``
    False: a draft from before StepNews, which the target must send three messages a step)."""

    def __init__(self, *args, step_news: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.takes_step_news = step_news
        self.kinds: dict[str, int] = {}

    async def _on_message(self, stream, msg, on_lane: bool = False):
        kind = msg.WhichOneof("body")
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        await super()._on_message(stream, msg, on_lane)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sync"])
@pytest.mark.parametrize("step_news", [True, False], ids=["step_news", "older_draft"])
async def test_a_steps_news_travels_as_one_message_to_a_draft_that_takes_it(model, expected, pipelined, step_news):
    """One StepNews a step (verdicts, releases, requests; one write on the stream) where the draft
    announces it, three messages to one that does not; the same exact output either way."""
    proposer = NgramProposer(1, 3)
    service = _Counting(proposer, "d1", 8, step_news=step_news)
    async with draft_on_loopback(service, pipelined=pipelined, vocab_size=256) as client:
        assert client.seam.pipelined == pipelined and client.step_news == step_news
        _, loop, got = await serve_with(model, client)
        # the draft reads the last step's releases after the outputs came
        await eventually(lambda: len(proposer) == 0, timeout=5, interval=0.01,
                         what=lambda: f"every sequence released in the draft ({len(proposer)} held)")
    assert got == expected
    kinds = service.kinds
    if step_news:
        assert kinds.get("step", 0) >= len(PROMPTS) and not {"propose", "verify", "release"} & set(kinds), kinds
    else:
        assert "step" not in kinds and kinds.get("propose", 0) >= len(PROMPTS) and kinds.get("release"), kinds
    assert (loop.drafting.flush_seconds > 0) == pipelined  # pipelined: the news handed over before each next step


def test_prompts_go_to_the_draft_only_for_requests_that_will_verify_a_chain(model):
    """Which new requests' prompts the draft hears before their prefill: those that speculate with a
    chain and will have room to emit one after the prefill's token; each at most once, and none whose
    prefill has begun."""
    engine = Engine(model, CFG, num_speculative_tokens=3, adaptive=False)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("chain", PROMPTS["a"], PARAMS)
    engine.add_request("short", PROMPTS["b"], short)  # one token to verify after the prefill's
    engine.add_request("shorter", PROMPTS["b"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request("off", PROMPTS["c"], PARAMS, num_speculative_tokens=0)
    engine.add_request("tree", PROMPTS["c"], PARAMS, tree_topk=2, tree_depth=2)
    engine.add_request("handoff", PROMPTS["c"], PARAMS, prefill_only=True)
    inputs = engine.prompt_inputs(engine.take_added())
    assert [(i.seq_id, i.round, i.new_tokens, i.num_speculative_tokens) for i in inputs] == [
        ("chain", 0, PROMPTS["a"], 3), ("short", 0, PROMPTS["b"], 1)]
    assert engine.take_added() == []
    engine.add_request("late", PROMPTS["c"], PARAMS)
    engine.step()  # its prefill begins: too late to hear it first
    assert engine.take_added() == []
    # the requests told their prompts go on from the prefill's token, in round 1
    after = {i.seq_id: (i.round, i.new_tokens) for i in engine.draft_inputs(())}
    assert after["chain"][0] == 1 and len(after["chain"][1]) == 1
    assert after["late"][0] == 0 and after["late"][1][:-1] == PROMPTS["c"]


def _one_behind_and_wrong(seq_id, round_, committed) -> DraftOutput:
    """A proposal starting one token behind the committed ones and wrong about that token: it fits no step."""
    n = len(committed) - 1
    bad = (committed[n] + 1) % 256
    return DraftOutput(seq_id, round_, [bad, bad, bad], start=n, assumed=committed[n - 2 : n])


async def _serve_judged(model, engine: Engine, client) -> StepLoop:
    """Prompt "a" for 40 greedy tokens through ``engine`` drafting over ``client``, judged by use every 8
    sequence steps (a backoff outlasts the test: no probe); the output must equal the target alone's."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = Engine(model, CFG).generate({"a": PROMPTS["a"]}, params)["a"]
    loop = StepLoop(engine, _Pool(client))
    loop.drafting.watch = DraftWatch(2.0, staged_window=8, backoff_base=30.0)
    loop.start()
    try:
        got = await serve_through(loop, {"a": PROMPTS["a"]}, params)
    finally:
        await loop.stop()
    assert got["a"] == want
    return loop


async def test_a_draft_whose_streamed_proposals_come_too_late_is_backed_off(model):
    """A draft that always streams after the target has moved on (a draft slower than the target's
    steps: each answer drafted from news two rounds old) costs no wait, but asking it costs every
    step: once a window of sequence steps with proposals found none that fits, the target stops
    asking (``draft_backoff``) and sends the draft no more round requests until the backoff ends."""
    engine = Engine(model, CFG, num_speculative_tokens=3, adaptive=False)
    drafted: list[DraftOutput] = []

    def late(seq_id, round_, committed):  # two sends late
        drafted.append(_one_behind_and_wrong(seq_id, round_, committed))
        return [drafted[-3]] if len(drafted) >= 3 else []

    client = _Scripted(late)
    loop = await _serve_judged(model, engine, client)
    assert loop.drafting.watch.backoffs_total == 1 and engine.spec.staged_use.found == 0
    assert engine.spec.staged_use.late == engine.spec.staged_use.arrived > 0
    plain = engine.spec.plain_steps
    assert plain.get("draft_backoff", 0) > 20 and plain.get("no_proposal", 0) <= 12
    assert len(client.requests) <= 13  # the prompt, then one request a step until the window was judged


@pytest.mark.parametrize("reads_hidden", [False, True])
async def test_a_draft_that_keeps_up_but_guesses_wrong_is_backed_off_only_if_it_reads_hidden_states(
        model, reads_hidden):
    """The same wrong proposals streamed at once: nothing fits, yet the draft keeps up. One that reads
    no hidden states (a suffix draft before its tree holds anything like the text) costs the news
    alone, so it is asked every step: a backoff would miss the repeats a suffix draft exists for.
    One that reads them costs their rows every step, and a head that keeps up yet never fits is
    broken: it is backed off."""
    engine = Engine(model, CFG, num_speculative_tokens=3, adaptive=False, hidden_layers=(1,) if reads_hidden else ())
    client = _Scripted(lambda seq_id, round_, committed: [_one_behind_and_wrong(seq_id, round_, committed)])
    if reads_hidden:
        client.hidden_layers, client.hidden_dtype = [1], "float32"
    loop = await _serve_judged(model, engine, client)
    assert engine.spec.staged_use.found == 0 and engine.spec.staged_use.late == 0
    if reads_hidden:
        assert loop.drafting.watch.backoffs_total == 1 and engine.spec.plain_steps.get("draft_backoff", 0) > 20
    else:
        assert loop.drafting.watch.backoffs_total == 0 and engine.spec.staged_use.arrived > 30
        assert engine.spec.plain_steps.get("draft_backoff", 0) == 0


async def test_prompts_that_cannot_be_sent_early_reach_the_draft_after_the_prefill(model, expected):
    """If handing the prompts to the event loop fails, the cycle goes on: those requests are told to
    the draft from scratch after their prefill, as before prompts went early."""
    want = expected["a"][:12]
    engine = Engine(model, CFG, num_speculative_tokens=3, adaptive=False)
    client = _Scripted(lambda *_: [])
    loop = StepLoop(engine, _Pool(client))

    def closed(requests):
        raise RuntimeError("Event loop is closed")

    client.seam.send_prompts = closed
    loop.start()
    try:
        got = await serve_through(loop, {"a": PROMPTS["a"]}, SamplingParams(temperature=0, max_tokens=12,
                                                                         ignore_eos=True))
    finally:
        await loop.stop()
    assert got["a"] == want
    assert client.requests[0] == ("a", 1, PROMPTS["a"] + want[:1])
