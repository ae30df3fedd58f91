"""Hostile draft workers against a real target worker process.

Draft output is untrusted input. Each test registers one misbehaving draft worker (written against
``proto/spec.proto`` alone, see ``tests/support/hostile_draft.py``) for the model a real
``python -m workers.target`` serves, and asserts what a correct target owes its users whatever the
draft does:

(a) greedy outputs equal plain decoding of the same prompts (taken from the same target before
    any draft registered);
(b) every request finishes within a bound well under the propose timeout, scaled by what plain
    decoding takes on this machine (see :func:`bound_for`), never a propose timeout per step;
(c) once the hostile draft is gone (streams killed, lease revoked) the target serves normally: new
    requests succeed, equal plain and stay within the bound.

Beyond these, an incompatible draft is refused at the handshake (never asked for proposals, one
log line per handshake) and a slow one is held to a tighter bound. Each test reports every phase
that failed (see :class:`Findings`), so a target that breaks while the draft is there is still
checked after it is gone. One target process serves the module (starting one costs seconds); a
failed test restarts it, so one broken target does not fail the tests after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from runtime.messages import GenerateRequest, SamplingParams, TokenDelta
from runtime.request_plane import collect
from tests.support.hostile_draft import (
    AbortAfterFirst,
    BadHandshake,
    Malformed,
    Oracle,
    Silent,
    Slow,
    hostile_draft,
)
from tests.support.procs import ManagedProcess
from tests.support.servers import env_for
from tests.support.tiny_models import tiny_hf_model
from tests.support.flags import speculative

pytestmark = pytest.mark.e2e

log = logging.getLogger("tests.hostile_drafts")

MODEL = "tiny"
VOCAB = 256
NUM_LAYERS = 2
GAMMA = 4
PROPOSE_TIMEOUT_S = 2.0  # the target's propose_timeout (--speculative-config): what a missing proposal costs a step today
MAX_TOKENS = 24
PROMPTS = [[(5 * i + 7 * j + 1) % VOCAB for j in range(6 + 3 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def bound_for(plain_s: float) -> float:
    """Seconds any request may take while a hostile draft is registered (and just after).

    ``plain_s`` is the slowest of the test prompts decoded concurrently with no draft (~0.03 s on
    a quiet 2-core machine: the tiny model's step takes about a millisecond). A target that waits
    the propose timeout on every step needs ~MAX_TOKENS × 2 s ≈ 48 s per request; one that judges
    a draft by its own step time loses a few step times per probe. The bound stays below one
    propose timeout (no request may wait for it even once) and leaves ~50× plain for probing the
    draft and for noise from other processes on the machine; the 5× plain term keeps it fair when
    the machine is so loaded that plain decoding itself slows down.
    """
    return 1.5 + 5 * plain_s


# --------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def namespace() -> str:
    # module scope: the target process is shared by the module's tests (see target_process)
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile-target")
    tiny_hf_model("llama", path, seed=11, vocab=VOCAB, layers=NUM_LAYERS, max_positions=1024)
    return path


class TargetProcess:
    """The module's ``python -m workers.target`` on the tiny model; restarted after a failed test.
    ``reference`` holds plain greedy outputs (by prompt), measured once: the weights never change."""

    def __init__(self, env: dict[str, str], model_dir):
        self.env = env
        self.args = ["--model", str(model_dir), "--served-model-name", MODEL, "--block-size", "8",
                     "--num-blocks", "256", "--max-model-len", "512", "--threads", "1",
                     "--num-speculative-tokens", str(GAMMA), *speculative(propose_timeout=PROPOSE_TIMEOUT_S),
                     "--lease-ttl", "3", "--drain-timeout", "2"]
        self.proc: ManagedProcess | None = None
        self.reference: dict[tuple[int, ...], list[int]] = {}

    def start(self) -> None:
        self.proc = ManagedProcess("workers.target", self.args, self.env, "target").start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=10)
            log.info("--- target log ---\n%s", self.proc.logs()[-4000:])
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="module")
def target_process(servers, namespace, model_dir):
    etcd, nats_ = servers
    process = TargetProcess(env_for(etcd, nats_, namespace), model_dir)
    process.start()
    yield process
    process.stop()


@dataclass
class Result:
    tokens: list[int]
    seconds: float
    last: TokenDelta


class Target:
    """The test's handle on the target process: requests over NATS, timed and checked."""

    def __init__(self, client, process: TargetProcess):
        self.client = client
        self.process = process
        self.instance = None

    async def connect(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not (found := [i for i in self.client.instances() if i.pid == self.process.proc.pid]):
            if not self.process.proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"target did not register; log:\n{self.process.proc.logs()[-4000:]}")
            await asyncio.sleep(0.1)
        self.instance = found[0]

    @property
    def logs(self) -> str:
        return self.process.proc.logs()

    async def generate(self, prompt: list[int], params: SamplingParams = GREEDY, **kw) -> Result:
        start = time.monotonic()
        deltas = await collect(await self.client.call(self.instance.instance_id, GenerateRequest(
            prompt, params, model=MODEL, **kw), TokenDelta))
        return Result([t for d in deltas for t in d.token_ids], time.monotonic() - start, deltas[-1])

    async def run(self, prompts: list[list[int]], bound: float, what: str,
                  params: SamplingParams = GREEDY) -> list[Result]:
        """Send ``prompts`` at once; each must finish within ``bound`` seconds. Gives up waiting
        shortly after the bound, so that a target that is 10× too slow fails in seconds."""
        tasks = [asyncio.ensure_future(self.generate(p, params)) for p in prompts]
        done, pending = await asyncio.wait(tasks, timeout=bound + 1.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            raise AssertionError(f"{what}: {len(pending)} of {len(prompts)} requests still running after "
                                 f"{bound + 1:.1f} s (bound {bound:.1f} s)")
        errors = [e for e in (t.exception() for t in tasks) if e is not None]
        if errors:  # what the first failed request raised (all are retrieved: no asyncio warnings)
            raise errors[0]
        results = [t.result() for t in tasks]
        slow = [round(r.seconds, 2) for r in results if r.seconds >= bound]
        if slow:
            raise AssertionError(f"{what}: requests took {slow} s (bound {bound:.1f} s)")
        log.info("%s: %s s", what, [round(r.seconds, 2) for r in results])
        return results

    async def check(self, prompts: list[list[int]], bound: float, what: str) -> list[Result]:
        """:meth:`run` with greedy requests whose tokens must equal plain decoding."""
        results = await self.run(prompts, bound, what)
        for prompt, result in zip(prompts, results):
            want = self.process.reference[tuple(prompt)]
            if result.tokens != want or result.last.finish_reason != "length":
                raise AssertionError(f"{what}: output differs from plain decoding: {result.tokens} "
                                     f"({result.last.finish_reason}), want {want}")
        return results

    async def plain(self) -> float:
        """Decode the prompts with no draft registered; returns the slowest request's seconds (of a
        second round: the first on a fresh process pays its warm-up). The first call in a module
        records the reference outputs; later ones check them."""
        seconds = 0.0
        for _ in range(2):
            results = await self.run(PROMPTS, 60.0, "plain (no draft registered)")
            seconds = max(r.seconds for r in results)
            for prompt, result in zip(PROMPTS, results):
                ref = self.process.reference.setdefault(tuple(prompt), result.tokens)
                # no draft: nothing was drafted (usage says why: every step was plain, "no_draft")
                spec = result.last.usage.spec
                assert result.tokens == ref and len(ref) == MAX_TOKENS and (spec is None or spec.num_drafts == 0)
        return seconds

    async def until(self, condition: Callable[[], bool], bound: float, what: str, timeout: float = 30.0,
                    required: bool = True) -> None:
        """Send checked requests one at a time until ``condition()`` (the draft saw what the test
        needs it to have seen; the target connects to a new draft only while it has work), for at
        most ``timeout`` seconds: then fail, or just stop when not ``required``."""
        deadline = time.monotonic() + timeout
        i = 0
        while not condition():
            if time.monotonic() > deadline:
                if required:
                    raise AssertionError(f"{what}: the target never got that far with the draft in {timeout:.0f} s")
                return
            await self.check([PROMPTS[i % len(PROMPTS)]], bound, what)
            i += 1

    def oracle(self) -> Oracle:
        return Oracle(self.process.reference)


@pytest.fixture
async def target(rt, target_process, request):
    failures = request.session.testsfailed
    handle = Target(await rt.client("target", "generate"), target_process)
    await handle.connect()
    yield handle
    if request.session.testsfailed > failures:  # the test failed: the next one gets a fresh target
        log.info("--- target log (failed test) ---\n%s", target_process.proc.logs()[-6000:])
        if not request.session.shouldstop:
            target_process.restart()


class Findings:
    """Failures by phase: a target that fails while the hostile draft is registered is still
    checked once the draft is gone, and the test reports both."""

    def __init__(self):
        self.problems: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        try:
            yield
        except Exception as exc:  # AssertionError, or what a failed request raised
            self.problems.append(f"{name}: {type(exc).__name__}: {exc}")

    def check(self) -> None:
        if self.problems:
            pytest.fail("\n".join(self.problems), pytrace=False)


async def after_the_draft_is_gone(target: Target, findings: Findings, plain_s: float) -> None:
    """(c): right after the hostile draft died (no waiting for the target to notice), requests
    are exact and take plain time, give or take the usual bound."""
    with findings.phase("after the hostile draft is gone"):
        await target.check(PROMPTS, bound_for(plain_s), "after the hostile draft is gone")
        await target.check(PROMPTS, bound_for(plain_s), "after the hostile draft is gone, again")


@dataclass
class HostileRun:
    """What a test body sees while its hostile draft is registered."""

    plain_s: float  # the slowest plain request before the draft came
    bound: float  # bound_for(plain_s)
    findings: Findings
    draft: Any = None  # the registered hostile draft (its counts, its id)


@contextlib.asynccontextmanager
async def registered(target: Target, runtime_config, behaviour, name: str):
    """The course of every test here: time plain requests, register a hostile draft acting out
    ``behaviour``, run the body as the phase "while the <name> draft is registered", log the draft's
    counts, then check requests once it is gone. The test adds its own phases after the block and
    ends with ``run.findings.check()``."""
    plain_s = await target.plain()
    run = HostileRun(plain_s, bound_for(plain_s), Findings())
    async with hostile_draft(runtime_config, behaviour, MODEL) as run.draft:
        with run.findings.phase(f"while the {name} draft is registered"):
            yield run
        log.info("%s draft: %s", name, run.draft.counts)
    await after_the_draft_is_gone(target, run.findings, plain_s)


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("layers, dtype, bad", [
    ([0, 9876543], "", "9876543"),  # an EAGLE-3 head trained for another model: layers this target lacks
    ([NUM_LAYERS - 1], "float99", "float99"),  # a real layer, in a dtype that does not exist
], ids=["missing-hidden-layers", "nonsense-hidden-dtype"])
async def test_a_draft_with_an_impossible_handshake_is_refused_and_changes_nothing(
        target, runtime_config, layers, dtype, bad):
    async with registered(target, runtime_config, BadHandshake(layers, dtype), "incompatible") as run:
        draft, bound = run.draft, run.bound
        await target.until(lambda: draft.counts.hellos > 0, bound, "until the draft said hello")
        await target.check(PROMPTS, bound, "with the incompatible draft registered")
        await target.check(PROMPTS, bound, "with the incompatible draft registered, again")
    findings = run.findings
    with findings.phase("refused at the handshake"):
        if draft.counts.asks:
            raise AssertionError(f"the incompatible draft was asked for proposals: {draft.counts}")
    with findings.phase("said so once"):
        # A line or two per handshake (the refusal; the pool's retry notice), and one when the
        # draft leaves: not one per step or per request. Lines count when they name the draft or
        # the bad value, whichever mismatch the target reports first.
        said = [line for line in target.logs.splitlines() if draft.draft_id in line or bad in line]
        if not 1 <= len(said) <= 3 * draft.counts.hellos + 2:
            raise AssertionError(f"{len(said)} target log lines name the draft or {bad!r} after "
                                 f"{draft.counts.hellos} handshake(s); the first: {said[:2]}")
    findings.check()


async def test_malformed_proposals_are_dropped_and_cost_no_timeouts(target, runtime_config):
    behaviour = Malformed(target.oracle(), VOCAB)
    async with registered(target, runtime_config, behaviour, "malformed") as run:
        draft, bound = run.draft, run.bound
        await target.until(lambda: draft.counts.asks > 0, bound, "until the draft was asked")
        # A sampled request rides along: rejection sampling must not read NaN, negative or
        # out-of-vocabulary probabilities. Its tokens are random, their number and range are not.
        sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
        greedy, rand = await asyncio.gather(
            target.check(PROMPTS, bound, "with the malformed draft"),
            target.run([PROMPTS[1]], bound, "sampled, with the malformed draft", sampled),
            return_exceptions=True)
        for outcome in (greedy, rand):
            if isinstance(outcome, BaseException):
                raise outcome
        tokens = rand[0].tokens
        if len(tokens) != MAX_TOKENS or not all(0 <= t < VOCAB for t in tokens):
            raise AssertionError(f"sampled request: {len(tokens)} tokens, want {MAX_TOKENS} in [0, {VOCAB}): "
                                 f"{tokens}")
        await target.check(PROMPTS, bound, "with the malformed draft, again")
    log.info("malformed kinds sent: %s", behaviour.counts)
    run.findings.check()


async def test_a_silent_draft_costs_seconds_not_minutes(target, runtime_config):
    async with registered(target, runtime_config, Silent(), "silent") as run:
        draft, bound = run.draft, run.bound
        await target.until(lambda: draft.counts.asks > 0, bound, "until the silent draft was asked")
        await target.check(PROMPTS, bound, "with the silent draft")
        await target.check(PROMPTS, bound, "with the silent draft, again")
    run.findings.check()


async def test_a_draft_that_aborts_after_one_answer_and_keeps_failing(target, runtime_config):
    async with registered(target, runtime_config, AbortAfterFirst(target.oracle()), "aborting") as run:
        draft, bound = run.draft, run.bound
        await target.until(lambda: draft.counts.aborts > 0, bound, "until the draft aborted a stream")
        await target.check(PROMPTS, bound, "after the draft aborted")
        # It takes new streams and fails them the same way: each retry the target makes (when
        # its backoff allows, which this test does not prescribe) must be as harmless.
        await target.until(lambda: draft.counts.aborts > 1, bound, "while the target may retry the draft",
                           timeout=5.0, required=False)
        await target.check(PROMPTS, bound, "after the draft aborted again (or was backed off)")
    run.findings.check()


SLOW_DELAY_S = 0.3  # per answer, where a step of the tiny model takes about a millisecond


async def test_a_slow_draft_is_backed_off_from_the_targets_own_step_time(target, runtime_config):
    """A correct but slow draft: every proposal is accepted, yet waiting 0.3 s for γ+1 tokens is far
    slower than decoding them plainly, so a target that judges the draft by its own step time
    stops waiting for it."""
    async with registered(target, runtime_config, Slow(target.oracle(), SLOW_DELAY_S), "slow") as run:
        draft = run.draft
        await target.until(lambda: draft.counts.answers > 0, run.bound, "until the slow draft answered")
        # Tighter than bound_for: a target that waits for each answer needs ≥ MAX_TOKENS / (γ+1)
        # answers × 0.3 s ≈ 1.5 s per request, and more where an answer comes too late to use; one
        # that backs off after a slow probe or two loses well under a second.
        bound = 1.0 + 2 * run.plain_s
        for round_ in range(3):
            await target.check(PROMPTS, bound, f"with the slow draft, round {round_}")
    run.findings.check()
