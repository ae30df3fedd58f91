"""The mock worker process: KV events, cached tokens, spec-decode stats, load and dumps over real NATS."""

from __future__ import annotations

import pytest

from runtime import InvalidRequest
from runtime.events import TOPIC_KV, TOPIC_KV_DUMP, TOPIC_LOAD, TOPIC_SPEC_STATS
from runtime.kv_hash import block_hashes
from runtime.messages import GenerateRequest, KvDumpRequest, KvEvent, LoadEvent, SamplingParams, SpecStatsEvent, TokenDelta
from runtime.request_plane import collect
from tests.support.wait import eventually

pytestmark = pytest.mark.e2e


async def test_mock_worker_publishes_what_a_real_worker_would(rt, spawn):
    kv, stats, loads = [], [], []
    await rt.subscribe(TOPIC_KV, KvEvent, kv.append)
    await rt.subscribe(TOPIC_SPEC_STATS, SpecStatsEvent, stats.append)
    await rt.subscribe(TOPIC_LOAD, LoadEvent, loads.append)
    spawn("workers.mock", "--block-size", "4", "--token-latency-ms", "0", "--acceptance-rate", "1.0",
          "--num-speculative-tokens", "3", "--stats-interval", "0.1")
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=60)

    prompt = list(range(200, 218))  # 4 full blocks of 4, plus 2 tokens
    first = await collect(await client.call(inst.instance_id, GenerateRequest(prompt, SamplingParams(temperature=0, max_tokens=8)), TokenDelta))
    second = await collect(await client.call(inst.instance_id, GenerateRequest(prompt[:12] + [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8)), TokenDelta))
    tokens = [t for d in first for t in d.token_ids]
    assert tokens == prompt[:8]  # greedy output echoes the prompt
    assert first[-1].finish_reason == "length" and first[-1].usage.completion_tokens == 8
    assert first[-1].usage.cached_tokens == 0 and second[-1].usage.cached_tokens == 12
    # γ=3 with every draft accepted: each round emits 4 tokens, so 8 tokens take 2 rounds.
    assert first[-1].usage.spec.num_drafts == 2 and first[-1].usage.spec.num_accepted_tokens == 6
    assert first[-1].usage.spec.accepted_per_pos == [2, 2, 2]  # as a target reports it
    assert [len(d.token_ids) for d in first] == [4, 4]

    def published() -> bool:  # both requests' blocks, both rounds' stats, and a load report
        stored = [e for e in kv if e.worker_id == inst.instance_id and e.kind == "stored"]
        latest = [s.num_drafts for s in stats if s.target_id == inst.instance_id][-1:]
        return len(stored) >= 2 and latest == [4] and any(load.worker_id == inst.instance_id for load in loads)

    await eventually(published, timeout=5, what="the worker's KV events, spec stats and load")
    mine = [e for e in kv if e.worker_id == inst.instance_id]
    assert mine[0].kind == "cleared"
    stored = [e for e in mine if e.kind == "stored"]
    assert stored[0].block_hashes == block_hashes(prompt, 4) and stored[0].parent_hash is None
    assert stored[1].block_hashes == block_hashes(prompt[:12] + [5, 6, 7, 8], 4)[3:]
    assert stored[1].parent_hash == block_hashes(prompt, 4)[2]
    assert [e.event_id for e in mine] == list(range(1, len(mine) + 1))

    latest = [s for s in stats if s.target_id == inst.instance_id][-1]
    assert (latest.num_drafts, latest.num_draft_tokens, latest.num_accepted_tokens) == (4, 12, 12)
    assert latest.accepted_per_pos == [4, 4, 4]
    assert any(load.worker_id == inst.instance_id and load.total_blocks == 4096 for load in loads)

    kv.clear()
    await rt.publish(TOPIC_KV_DUMP, KvDumpRequest("test"))
    want = set(block_hashes(prompt, 4)) | set(block_hashes(prompt[:12] + [5, 6, 7, 8], 4))
    await eventually(lambda: {h for e in kv if e.worker_id == inst.instance_id for h in e.block_hashes} >= want,
                     timeout=5, what="the dump's KV events")
    dumped = {h for e in kv if e.worker_id == inst.instance_id for h in e.block_hashes}
    assert dumped == want

    with pytest.raises(InvalidRequest) as err:
        await collect(await client.call(inst.instance_id, GenerateRequest(prompt, SamplingParams(max_tokens=-1)), TokenDelta))
    assert err.value.field == "max_tokens"
