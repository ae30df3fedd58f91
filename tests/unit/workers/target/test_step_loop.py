"""The target's step loop under failure: every path fails only what it concerns and the loop goes on
(a real tiny engine; faults injected into the engine step, delivery, commands and the draft's wire)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from runtime.errors import EngineFailed, InvalidRequest
from runtime.messages import SamplingParams
from workers.engine.engine import Engine, EngineConfig
from workers.speculation.payloads import DraftOutput
from workers.target.draft_watch import DraftWatch
from workers.target.disagg import DisaggStats
from workers.target.next_turn import NextTurnPrefill
from workers.target.metrics import RequestStats, TargetCollector
from workers.target.step_loop import BROKEN_AFTER, AddRequest, StepLoop
from workers.target.seam import SynchronousSeam
from tests.support.draft_pool import FixedPool as _Pool, NewsByParts

pytestmark = pytest.mark.unit

CFG = EngineConfig(num_blocks=64, block_size=4)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(10, 22))


@pytest.fixture(scope="module")
def expected(model):
    return Engine(model, CFG).generate({"a": PROMPT}, PARAMS)["a"]


async def drain(queue: asyncio.Queue, timeout: float = 10.0) -> list[int] | BaseException:
    """A request's tokens, or the exception that ended it."""
    tokens = []
    while True:
        item = await asyncio.wait_for(queue.get(), timeout)
        if isinstance(item, BaseException):
            return item
        tokens.extend(item.token_ids)
        if item.finish_reason:
            return tokens


class Fault:
    """Raises ``error`` when called, the first ``times`` calls (None: until ``on`` is set False)."""

    def __init__(self, error: BaseException, times: int | None = 1):
        self.error, self.times, self.on = error, times, True

    def __call__(self, *args) -> None:
        if self.times is not None:
            self.on = self.times > 0
            self.times = max(self.times - 1, 0)
        if self.on:
            raise self.error


def with_failing_step(engine: Engine, fault: Fault) -> Engine:
    """``engine`` with its step calling ``fault`` first."""
    real_step = engine.step

    def step(proposals=None):
        fault()
        return real_step(proposals)

    engine.step = step
    return engine


@contextlib.asynccontextmanager
async def started(loop: StepLoop):
    """``loop`` started, and stopped when the block ends."""
    loop.start()
    try:
        yield loop
    finally:
        await loop.stop()


async def test_a_failing_step_fails_its_batch_and_the_loop_serves_on(model, expected):
    engine = with_failing_step(Engine(model, CFG), Fault(RuntimeError("injected: CUDA error")))
    async with started(StepLoop(engine)) as loop:
        failed = await drain(loop.submit("a", PROMPT, PARAMS))
        assert isinstance(failed, EngineFailed) and "injected" in str(failed)
        assert not engine.seqs and engine.blocks.num_free_blocks == CFG.num_blocks  # nothing left behind
        assert await drain(loop.submit("b", PROMPT, PARAMS)) == expected
        assert loop.healthy and loop.step_failures == 1


async def test_steps_that_keep_failing_mark_the_loop_unhealthy_until_one_succeeds(model, expected):
    broken = Fault(MemoryError("injected"), times=None)
    async with started(StepLoop(with_failing_step(Engine(model, CFG), broken))) as loop:
        for i in range(BROKEN_AFTER):
            assert isinstance(await drain(loop.submit(f"r{i}", PROMPT, PARAMS)), EngineFailed)
        assert not loop.healthy
        broken.on = False
        assert await drain(loop.submit("ok", PROMPT, PARAMS)) == expected
        assert loop.healthy


async def test_an_error_outside_the_step_fails_open_requests_and_the_loop_goes_on(model, expected):
    # on_kv_events: the loop's own hook, called after the step's outputs are delivered
    on_kv_events = Fault(RuntimeError("injected: publishing KV events"))
    async with started(StepLoop(Engine(model, CFG), on_kv_events=on_kv_events)) as loop:
        failed = await drain(loop.submit("a", PROMPT, PARAMS))
        assert isinstance(failed, EngineFailed) and loop.loop_errors == 1
        assert await drain(loop.submit("b", PROMPT, PARAMS)) == expected
        assert await loop.call(lambda e: not e.seqs)  # the failed request was aborted in the engine too
        assert loop.healthy


async def test_failing_commands_reach_their_callers_only(model, expected):
    async with started(StepLoop(Engine(model, CFG))) as loop:
        with pytest.raises(ZeroDivisionError):
            await loop.call(lambda e: 1 / 0)
        other = loop.submit("b", PROMPT, PARAMS)
        dup = loop.submit("b2", PROMPT, PARAMS)
        loop._queues["b2-again"] = dup_again = asyncio.Queue()
        loop._push(AddRequest("b2-again", [], PARAMS))  # an empty prompt the engine refuses (skipping submit's check)
        assert isinstance(await drain(dup_again), InvalidRequest)
        assert await drain(other) == expected and await drain(dup) == expected


class _Client(NewsByParts):
    """A draft stream stand-in that answers every round with the target's own next token."""

    def __init__(self, expected):
        self.draft_id, self.method, self.hidden_layers, self.hidden_dtype = "d", "oracle", [1], "float32"
        self.broken, self.expected, self.released, self.verdicts = False, expected, [], []
        self.told: dict[str, int] = {}
        self.seam = SynchronousSeam(self)

    def send(self, requests):
        loop = asyncio.get_running_loop()
        out = {}
        for r in requests:
            told = self.told[r.seq_id] = self.told.get(r.seq_id, 0) + len(r.new_tokens)
            fut = out[r.seq_id] = loop.create_future()
            fut.set_result(DraftOutput(r.seq_id, r.round, self.expected[told - len(PROMPT) : told - len(PROMPT) + 1]))
        return out

    async def collect(self, futures, timeout):
        return {k: f.result() for k, f in futures.items() if f.result() is not None}

    def verified(self, outcomes):
        self.verdicts.extend(outcomes)

    def release(self, ids):
        self.released.extend(ids)


async def test_a_verdict_that_cannot_be_converted_restarts_the_drafts_view(model, expected, monkeypatch):
    def broken_convert(verdict, dtype=""):
        raise ValueError("injected: cannot serialise")

    monkeypatch.setattr("workers.target.drafting.verify_to_pb", broken_convert)
    engine = Engine(model, CFG, hidden_layers=(1,), num_speculative_tokens=1, adaptive=False)
    client = _Client(expected)
    loop = StepLoop(engine, _Pool(client))
    loop.start()
    try:
        assert await drain(loop.submit("a", PROMPT, PARAMS)) == expected
        assert engine.counters["d"].num_accepted_tokens >= 1  # proposals were verified (and accepted)
        assert "a" in client.released and not client.verdicts  # no verdict went out; the draft forgets it
        assert loop.healthy
    finally:
        await loop.stop()


async def test_a_request_that_cannot_be_converted_decodes_plainly(model, expected):
    engine = Engine(model, CFG, hidden_layers=(1,), num_speculative_tokens=1, adaptive=False)
    client = _Client(expected)
    client.hidden_dtype = "float99"  # the handshake refuses this; here it reaches the loop anyway
    loop = StepLoop(engine, _Pool(client))
    loop.start()
    try:
        assert await drain(loop.submit("a", PROMPT, PARAMS)) == expected
        assert not engine.counters.get("d") or engine.counters["d"].num_drafts == 0
        assert loop.healthy
    finally:
        await loop.stop()


class _NoDraftPool(_Pool):
    def __init__(self):
        super().__init__(None)


class _BackedOff(DraftWatch):
    def allowed(self) -> bool:
        return False


async def run_one(loop: StepLoop, rid: str) -> list:
    queue = loop.submit(rid, PROMPT, PARAMS)
    deltas = []
    while not deltas or not deltas[-1].finish_reason:
        deltas.append(await asyncio.wait_for(queue.get(), 10))
    return deltas


@pytest.mark.parametrize("pool, watch, why", [(_NoDraftPool, DraftWatch, "no_draft"),
                                              (lambda: _Pool(_Client([])), _BackedOff, "draft_backoff")])
async def test_plain_steps_say_no_draft_and_draft_backoff(model, expected, pool, watch, why):
    loop = StepLoop(Engine(model, CFG, num_speculative_tokens=2), pool(), watch=watch())
    loop.start()
    try:
        deltas = await run_one(loop, "a")
        assert [t for d in deltas for t in d.token_ids] == expected
        assert deltas[-1].usage.spec.plain_steps == {why: PARAMS.max_tokens - 1}
        worker = type("W", (), {"loop": loop, "engine": loop.engine, "stats": RequestStats(),
                                "disagg": DisaggStats(), "next_turn": NextTurnPrefill(loop)})()
        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for m in TargetCollector(worker, "m").collect() for x in m.samples}
        assert samples[("tandem_target_spec_plain_steps_total", (("model", "m"), ("reason", why)))] == 7
    finally:
        await loop.stop()


class _LateClient(_Client):
    """A draft stream whose proposals never arrive by the deadline."""

    async def collect(self, futures, timeout):
        await asyncio.sleep(timeout)
        return {}


async def test_a_late_round_counts_as_a_speculating_step_not_a_plain_one(model, expected):
    """The wait for proposals that came late is what speculating cost that step: the realized rates
    and the cost model charge it to speculation, so a slow draft never makes plain decoding look slower."""
    engine = Engine(model, CFG, hidden_layers=(1,), num_speculative_tokens=2, adaptive=False)
    loop = StepLoop(engine, _Pool(_LateClient(expected)), watch=DraftWatch(0.05, min_wait=0.05, first_wait=0.05))
    loop.start()
    try:
        deltas = await run_one(loop, "a")
        assert [t for d in deltas for t in d.token_ids] == expected
        plain = deltas[-1].usage.spec.plain_steps
        assert plain.get("draft_late", 0) >= 2 and "draft_stale" not in plain
        realized = engine.spec.realized
        late = plain["draft_late"]
        # every late step but possibly the last (observed at the start of the next cycle) is a speculating step
        assert realized._count.get((realized.bucket(1), True), 0) >= late - 1
        assert realized._count.get((realized.bucket(1), False), 0) <= PARAMS.max_tokens - 1 - late
        a, _, _, d = engine.spec.cost.coefficients()
        assert d > a  # the 50 ms waits landed on "speculating at all", not on every step
    finally:
        await loop.stop()
