"""A draft worker restarted under the same worker id (``TANDEM_INSTANCE_ID``), with real processes: a
tiny target worker under continuous greedy load, and oracle draft workers that all register as one
worker id, each start with its own (greater) incarnation.

1. The draft hangs (SIGSTOP: a host cut off keeps its sockets open) and a new incarnation registers
   under its id. The target fences the old stream at once and speculates with the new incarnation;
   the old one, woken (SIGCONT) and then killed (SIGKILL), gets nothing more from the target, and
   nothing it sends is applied.
2. The new incarnation is killed (SIGKILL) and restarted under the same id: the target speculates
   with the third incarnation as soon as it registers (a new incarnation is not held to the dead
   one's retry backoff).

Throughout, every request's output equals the target alone (greedy) and none fails."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.messages import GenerateRequest, SamplingParams, TokenDelta
from runtime.request_plane import collect
from tests.e2e.test_spec_decode import PROMPTS, expected, target_dir, tokens, until_speculating  # noqa: F401
from tests.support.flags import speculative
from tests.support.wait import eventually

pytestmark = pytest.mark.e2e

log = logging.getLogger("tests.draft_restart")

DRAFT_ID = "draft-restarted"
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


async def metrics(address: str, prefix: str) -> dict[str, float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://{address}/metrics", timeout=5)).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(prefix) and not s.labels.get("reason")}


class Load:
    """Batches of every prompt at once, one after another, each output checked against the target alone."""

    def __init__(self, client, inst, want: dict[str, list[int]]):
        self.client, self.inst, self.want = client, inst, want
        self.batches = 0
        self.drafted = 0  # speculative steps verified, over every request
        self.problems: list[str] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _one(self, i: int) -> None:
        try:
            deltas = await asyncio.wait_for(collect(await self.client.call(
                self.inst.instance_id, GenerateRequest(PROMPTS[i], GREEDY), TokenDelta)), 60)
        except Exception as exc:
            self.problems.append(f"batch {self.batches} prompt {i}: failed: {exc!r}")
            return
        if tokens(deltas) != self.want[str(i)]:
            self.problems.append(f"batch {self.batches} prompt {i}: output differs from the target alone")
        spec = deltas[-1].usage.spec
        self.drafted += spec.num_drafts if spec is not None else 0

    async def _run(self) -> None:
        while not self._stop.is_set():
            await asyncio.gather(*(self._one(i) for i in range(len(PROMPTS))))
            self.batches += 1

    async def batches_more(self, n: int, timeout: float = 60) -> None:
        """Wait until ``n`` more batches completed."""
        goal = self.batches + n
        await eventually(lambda: self.batches >= goal, timeout=timeout, what=f"{n} more batches of load")

    async def stop(self) -> None:
        self._stop.set()
        await self._task


async def test_a_draft_restarted_under_its_worker_id_is_fenced(rt, spawn, child_env, target_dir, tmp_path):  # noqa: F811
    want = expected(target_dir, GREEDY)
    refs = tmp_path / "refs.json"
    refs.write_text(json.dumps([p + want[str(i)] for i, p in enumerate(PROMPTS)]))
    spawn("workers.target", "--model", str(target_dir), "--served-model-name", "tiny", "--block-size", "8",
          "--num-blocks", "512", "--max-model-len", "1024", "--threads", "1", "--num-speculative-tokens", "3",
          *speculative(adaptive=False, load_aware=False, propose_min_wait=0.5), "--lease-ttl", "3",
          "--health-port", "0", name="target")
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=90)
    drafts = await rt.client("draft", "speculate")
    oracle = json.dumps({"oracle_file": str(refs), "oracle_error_rate": 0.25, "oracle_vocab_size": 256})

    def start_draft(n: int, lease_ttl: int):
        return spawn("workers.draft", "--method", "oracle", "--speculative-config", oracle, "--lease-ttl",
                     str(lease_ttl), "--health-port", "0", env={**child_env, "TANDEM_INSTANCE_ID": DRAFT_ID},
                     name=f"draft-{n}")

    async def registered(proc):
        """The draft id's record, once it is ``proc``'s."""
        def mine():
            return next((r for r in drafts.instances() if r.instance_id == DRAFT_ID and r.pid == proc.pid), None)
        return await eventually(mine, timeout=90, interval=0.1, what=f"{proc.name} registered as {DRAFT_ID}")

    async def streams_to(record) -> float:
        return (await metrics(record.http_address, "tandem_draft_target_streams"))["tandem_draft_target_streams"]

    # a lease that outlives the hang: the new incarnation registers before the old one's would expire
    first = start_draft(1, lease_ttl=60)
    one = await registered(first)
    await until_speculating(client, inst)
    load = Load(client, inst, want)
    load.start()
    try:
        await load.batches_more(2)

        # 1. the draft hangs; a new incarnation registers under its id
        first.signal(signal.SIGSTOP)
        second = start_draft(2, lease_ttl=3)
        two = await registered(second)
        assert two.incarnation > one.incarnation > 0
        known = time.monotonic()
        await eventually(lambda: streams_to(two), timeout=20, interval=0.2,
                         what="the target streaming to the new incarnation while the old one hangs")
        log.info("target streams to the new incarnation %.2f s after it registered", time.monotonic() - known)
        fenced = await metrics(inst.http_address, "tandem_target_draft_")
        assert fenced["tandem_target_draft_streams_fenced_total"] == 1, fenced
        # the old one wakes: its stream is gone, nothing reaches it any more, and it is killed
        first.signal(signal.SIGCONT)
        await eventually(lambda: first.logs().count("stream from target") >= 1, timeout=10,
                         what="the old incarnation seeing its stream closed")
        before = await metrics(one.http_address, "tandem_draft_")
        await load.batches_more(2)
        after = await metrics(one.http_address, "tandem_draft_")
        assert after["tandem_draft_target_streams"] == 0
        assert after["tandem_draft_verdicts_total"] == before["tandem_draft_verdicts_total"]  # nothing addressed to it
        first.kill()
        drafted = load.drafted
        await load.batches_more(2)
        assert load.drafted > drafted, "the target does not speculate with the new incarnation"

        # 2. the new incarnation is killed and restarted under the same id
        second.kill()
        await asyncio.sleep(0.5)  # the target sees the stream break (and would put the id on a retry backoff)
        third = start_draft(3, lease_ttl=3)
        three = await registered(third)
        assert three.incarnation > two.incarnation
        known = time.monotonic()
        await eventually(lambda: streams_to(three), timeout=20, interval=0.1,
                         what="the target streaming to the third incarnation")
        took = time.monotonic() - known
        log.info("target streams to the third incarnation %.2f s after it registered", took)
        assert took < 1.5, f"{took:.2f} s: the new incarnation waited for the dead one's retry backoff"
        drafted = load.drafted
        await load.batches_more(2)
        assert load.drafted > drafted, "the target does not speculate with the third incarnation"
    finally:
        await load.stop()
    assert not load.problems, load.problems[:5]
    final = await metrics(inst.http_address, "tandem_target_draft_")
    log.info("fenced: %d streams, %d proposals", final["tandem_target_draft_streams_fenced_total"],
             final["tandem_target_draft_proposals_fenced_total"])
    assert final["tandem_target_draft_streams_fenced_total"] == 1
