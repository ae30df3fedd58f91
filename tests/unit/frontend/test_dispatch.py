"""Migration: the re-sent request keeps every sampling field and gets only the budget that is left."""

from __future__ import annotations

import pytest

from frontend.dispatch import Dispatcher
from router.base import RoundRobinRouter
from runtime import InstanceGone
from runtime.messages import GenerateRequest, InstanceRecord, RoutingHints, SamplingParams, TokenDelta
from tests.support.fixed_instances import FixedSnapshot

pytestmark = pytest.mark.unit


class FakeStream:
    """Yields ``deltas``, then fails with ``InstanceGone`` unless the last one finished."""

    def __init__(self, instance_id: str, deltas: list[TokenDelta]):
        self.instance_id = instance_id
        self.finished = False
        self._deltas = list(deltas)

    async def __anext__(self) -> TokenDelta:
        if self._deltas:
            return self._deltas.pop(0)
        if self.finished:
            raise StopAsyncIteration
        self.finished = True
        raise InstanceGone(self.instance_id, "killed")

    async def aclose(self) -> None:
        self.finished = True


class FakeClient:
    """The first worker called sends two tokens and dies; the next one finishes."""

    def __init__(self):
        self.requests: list[tuple[str, GenerateRequest]] = []
        self.snapshot = FixedSnapshot([record("a"), record("b")])

    def unreachable_ids(self) -> list[str]:
        return []

    async def call(self, instance_id, request, response_type, request_id="", pending=None):
        self.requests.append((instance_id, request))
        if len(self.requests) == 1:
            return FakeStream(instance_id, [TokenDelta([7, 8])])
        stream = FakeStream(instance_id, [TokenDelta([9], finish_reason="length")])
        stream.finished = True
        return stream


def record(instance_id: str) -> InstanceRecord:
    return InstanceRecord(instance_id, "ns", "target", "generate", f"ns.target.generate.{instance_id}", model="m")


async def test_migration_keeps_every_sampling_field_and_shrinks_the_budget():
    router = RoundRobinRouter(lambda model: [record("a"), record("b")])
    client = FakeClient()
    sampling = SamplingParams(temperature=0.5, top_p=0.9, top_k=5, seed=7, max_tokens=10, min_tokens=3,
                              stop_token_ids=[2], ignore_eos=True, logprobs=2)
    gen = await Dispatcher(router, client).open("m", [1, 2, 3], sampling, "req")
    tokens = [t async for delta in gen for t in delta.token_ids]
    assert tokens == [7, 8, 9]
    (first_id, first), (second_id, second) = client.requests
    assert first.sampling == sampling and first.output_ids == []
    assert second_id != first_id and second.output_ids == [7, 8] and second.token_ids == [1, 2, 3]
    assert second.sampling == SamplingParams(temperature=0.5, top_p=0.9, top_k=5, seed=7, max_tokens=8, min_tokens=1,
                                             stop_token_ids=[2], ignore_eos=True, logprobs=2)


async def test_priority_and_hints_reach_the_router_and_every_worker_tried():
    seen = []

    class Recording(RoundRobinRouter):
        async def select(self, model, token_ids, exclude=frozenset(), request_id="", lora="", hints=None):
            seen.append(hints)
            return await super().select(model, token_ids, exclude, request_id, lora, hints)

    client = FakeClient()
    hints = RoutingHints(priority=-3, strict_priority=2, osl=40, session_id="agent")
    gen = await Dispatcher(Recording(lambda model: [record("a"), record("b")]), client).open(
        "m", [1, 2, 3], SamplingParams(max_tokens=10), "req", hints=hints)
    assert [t async for delta in gen for t in delta.token_ids] == [7, 8, 9]
    assert seen == [hints, hints]  # the first choice and the migration's
    assert [r.priority for _, r in client.requests] == [-3, -3]


async def test_a_conversations_next_turn_is_sent_back_to_the_draft_that_served_it():
    from runtime.messages import SpecUsage, Usage

    class Served:
        """Every request finishes at once, speculated with draft ``d7``."""

        def __init__(self):
            self.snapshot = FixedSnapshot([record("a")])
            self.requests: list[GenerateRequest] = []

        def unreachable_ids(self) -> list[str]:
            return []

        async def call(self, instance_id, request, response_type, request_id="", pending=None):
            self.requests.append(request)
            usage = Usage(prompt_tokens=len(request.token_ids), completion_tokens=2,
                          spec=SpecUsage(num_drafts=1, draft_id="d7"))
            stream = FakeStream(instance_id, [TokenDelta([5, 6], finish_reason="length", usage=usage)])
            stream.finished = True
            return stream

    client = Served()
    dispatcher = Dispatcher(RoundRobinRouter(lambda model: [record("a")]), client)
    sampling = SamplingParams(max_tokens=2)
    turn = list(range(100, 170))  # a whole block (64) and more
    session = RoutingHints(session_id="s1")
    for tokens, hints in ((turn, session), (turn + [5, 6, 9], None), (list(range(300, 380)), None),
                          ([1, 2], session)):
        gen = await dispatcher.open("m", tokens, sampling, "r", hints=hints)
        [_ async for _ in gen]
    # the first turn knew nothing; its next turn (by tokens) and a later request of its session go
    # back to d7; another conversation does not
    assert [r.draft_id for r in client.requests] == ["", "d7", "", "d7"]
