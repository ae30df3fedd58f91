"""vLLM's ``--scheduling-policy priority`` on a tiny seeded model: admission in priority order,
preemption of the lowest-priority running request by a higher-priority arrival (its output equal to
an unpreempted run, greedy), and fcfs left exactly as it was."""

import random

import pytest

from runtime.messages import SamplingParams
from tests.support.tiny_models import tiny_model_fixture
from workers.engine.engine import Engine, EngineConfig

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


model = tiny_model_fixture(vocab=256, load=True)


def _prompt(seed: int, n: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


def _engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**{"num_blocks": 64, "block_size": 4, **kw}), eos_token_ids=(0,))


def _alone(model, rid: str, prompt: list[int]) -> list[int]:
    return _engine(model).generate({rid: prompt}, GREEDY)[rid]


def _run(engine: Engine, got: dict, finished: list, steps: int | None = None) -> None:
    n = 0
    while engine.has_work() and (steps is None or n < steps):
        for rid, delta in engine.step():
            got.setdefault(rid, []).extend(delta.token_ids)
            if delta.finish_reason is not None:
                finished.append(rid)
        n += 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("full", ["max_num_seqs", "blocks"])
def test_a_high_priority_arrival_preempts_the_lowest_running_request_which_resumes_unchanged(model, full,
                                                                                           async_scheduling):
    low, low2, high = _prompt(1), _prompt(2), _prompt(3)
    limits = dict(max_num_seqs=2) if full == "max_num_seqs" else dict(num_blocks=14, max_model_len=40)
    engine = _engine(model, scheduling_policy="priority", async_scheduling=async_scheduling, **limits)
    got, finished = {}, []
    engine.add_request("low", low, GREEDY, priority=5)
    engine.add_request("low2", low2, GREEDY, priority=3)
    _run(engine, got, finished, steps=4)
    assert len(got["low"]) >= 2 and not finished  # both decoding, the engine full
    engine.add_request("high", high, GREEDY, priority=0)
    _run(engine, got, finished)
    assert engine.scheduler.num_priority_preemptions >= 1
    assert finished.index("high") < finished.index("low")  # the lowest (priority 5) made room and waited
    assert got == {"low": _alone(model, "low", low), "low2": _alone(model, "low2", low2),
                   "high": _alone(model, "high", high)}
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_waiting_requests_start_in_priority_then_arrival_order(model):
    engine = _engine(model, scheduling_policy="priority", max_num_seqs=1)
    order = []
    for rid, priority in (("a", 2), ("b", -1), ("c", 2), ("d", 0)):
        engine.add_request(rid, _prompt(ord(rid)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                           priority=priority)
    while engine.has_work():
        order += [rid for rid, delta in engine.step() if delta.finish_reason is not None]
    assert order == ["b", "d", "a", "c"]
    assert engine.scheduler.num_priority_preemptions == 0


def test_fcfs_ignores_priority_and_never_preempts_for_it(model):
    engine = _engine(model, max_num_seqs=1)  # the default policy
    got, finished = {}, []
    engine.add_request("low", _prompt(1), GREEDY, priority=5)
    _run(engine, got, finished, steps=3)
    engine.add_request("high", _prompt(3), GREEDY, priority=-100)
    _run(engine, got, finished)
    assert finished == ["low", "high"] and engine.scheduler.num_preemptions == 0


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
