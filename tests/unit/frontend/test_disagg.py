"""Where a prompt prefills (conditional disaggregation), and what the decode worker is sent after a
remote prefill: the first token as output, the handoff, the budget left."""

from __future__ import annotations

import pytest

from frontend.disagg import RemotePrefill
from frontend.dispatch import Dispatcher
from router.base import RoundRobinRouter
from router.kv_router import KvRouter
from runtime import InstanceGone
from runtime.messages import InstanceRecord, KvHandoff, LoadEvent, PrefillDelta, SamplingParams, TokenDelta
from tests.support.fixed_instances import FixedSnapshot

pytestmark = pytest.mark.unit

HANDOFF = KvHandoff("p1", "h1", [4, 5, 6], 40)


def record(instance_id: str, component: str = "target", role: str = "decode") -> InstanceRecord:
    return InstanceRecord(instance_id, "ns", component, "generate", f"ns.{component}.generate.{instance_id}",
                          role=role, model="m")


class Stream:
    def __init__(self, instance_id: str, deltas: list[TokenDelta], fail: Exception | None = None):
        self.instance_id = instance_id
        self.finished = False
        self.request_id = ""
        self._deltas = list(deltas)
        self._fail = fail

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenDelta:
        if self._deltas:
            return self._deltas.pop(0)
        if self._fail is not None:
            self.finished = True
            raise self._fail
        self.finished = True
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.finished = True


class Client:
    """An endpoint client over fixed instances whose streams answer with ``answer(instance_id)``."""

    def __init__(self, records: list[InstanceRecord], answer):
        self.records = records
        self.answer = answer
        self.requests = []
        self.snapshot = FixedSnapshot(records)

    def instances(self, model: str | None = None) -> list[InstanceRecord]:
        return list(self.records)

    def unreachable_ids(self) -> list[str]:
        return []

    def mark_unreachable(self, instance_id: str, why: str = "") -> None:
        pass

    async def call(self, instance_id, request, response_type, request_id="", pending=None):
        self.requests.append((instance_id, request))
        return self.answer(instance_id)


def setup(prefill_answer, decode_role: str = "decode", prefills: int = 1, min_tokens: int = 32):
    prefill_records = [record(f"p{i + 1}", "prefill", "prefill") for i in range(prefills)]
    prefill_client = Client(prefill_records, prefill_answer)
    decode_client = Client([record("d1", role=decode_role)],
                           lambda i: Stream(i, [TokenDelta([8, 9]), TokenDelta([10], finish_reason="length")]))
    prefill_router = KvRouter(lambda model: prefill_records)
    remote = RemotePrefill(prefill_router, prefill_client, decode_client, lambda model: 16, min_tokens, max_queue=2)
    dispatcher = Dispatcher(RoundRobinRouter(lambda model: decode_client.records), decode_client, prefill=remote)
    return dispatcher, remote, prefill_client, decode_client, prefill_router


async def run(dispatcher, prompt_len: int = 40, max_tokens: int = 10) -> list[int]:
    gen = await dispatcher.open("m", list(range(prompt_len)), SamplingParams(temperature=0, max_tokens=max_tokens),
                                "req")
    return [t async for d in gen for t in d.token_ids]


async def test_a_long_prompt_prefills_remotely_and_the_decode_worker_gets_the_handoff():
    dispatcher, remote, prefills, decodes, _ = setup(lambda i: Stream(i, [PrefillDelta(TokenDelta([7]), HANDOFF)]))
    assert await run(dispatcher) == [7, 8, 9, 10]
    [(pid, preq)] = prefills.requests
    [(did, dreq)] = decodes.requests
    assert pid == "p1" and preq.output_ids == [] and preq.kv_transfer is None and preq.sampling.max_tokens == 10
    assert did == "d1" and dreq.kv_transfer == HANDOFF and dreq.output_ids == [7]
    assert dreq.sampling.max_tokens == 9 and dreq.token_ids == list(range(40))
    assert dict(remote.prefills) == {("remote", "ok"): 1}


async def test_a_first_token_that_finishes_needs_no_decode_worker():
    dispatcher, _, _, decodes, _ = setup(lambda i: Stream(i, [PrefillDelta(TokenDelta([2], finish_reason="stop"))]))
    assert await run(dispatcher) == [2]
    assert decodes.requests == []


@pytest.mark.parametrize("case, why", [("short", "short"), ("aggregated", "not_decode"), ("busy", "busy"),
                                       ("failing", "prefill_failed")])
async def test_otherwise_the_decode_worker_prefills(case, why):
    answer = (lambda i: Stream(i, [], InstanceGone(i, "killed"))) if case == "failing" else (
        lambda i: Stream(i, [PrefillDelta(TokenDelta([7]), HANDOFF)]))
    dispatcher, remote, prefills, decodes, router = setup(answer, decode_role="target" if case == "aggregated" else "decode")
    if case == "busy":
        router.on_load_event(LoadEvent("p1", running=1, queued=2))
    assert await run(dispatcher, prompt_len=20 if case == "short" else 40) == [8, 9, 10]
    [(_, dreq)] = decodes.requests
    assert dreq.kv_transfer is None and dreq.output_ids == [] and dreq.sampling.max_tokens == 10
    assert dict(remote.prefills) == {("local", why): 1}
    assert len(prefills.requests) == (1 if case == "failing" else 0)


async def test_without_prefill_workers_nothing_changes_and_nothing_is_counted():
    dispatcher, remote, _, decodes, _ = setup(None, prefills=0)
    assert await run(dispatcher) == [8, 9, 10]
    assert decodes.requests[0][1].kv_transfer is None and not remote.prefills
