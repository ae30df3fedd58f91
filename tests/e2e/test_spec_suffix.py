"""Suffix decoding with real processes: a target worker and a ``--method suffix`` draft worker over
real etcd, NATS and gRPC. Greedy output equals the target alone, one request at a time and 8
concurrent; repeating the prompts lets the draft's global tree of earlier outputs raise acceptance."""

from __future__ import annotations

import asyncio

import pytest

from runtime.messages import GenerateRequest, SamplingParams, TokenDelta
from runtime.request_plane import collect
from tests.e2e.test_spec_decode import PROMPTS, start_target, target_dir, tokens  # noqa: F401 (fixture)
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = pytest.mark.e2e

BATCH = PROMPTS + [p[::-1] for p in PROMPTS[:2]]  # 8 prompts


def totals(results) -> tuple[int, int]:
    specs = [r[-1].usage.spec for r in results if r[-1].usage.spec is not None]
    return sum(s.num_draft_tokens for s in specs), sum(s.num_accepted_tokens for s in specs)


async def test_greedy_suffix_speculation_matches_the_target_alone(rt, spawn, target_dir):  # noqa: F811
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = Engine(load_model(target_dir), EngineConfig(block_size=8, num_blocks=512, max_num_seqs=16))
    want = engine.generate({str(i): p for i, p in enumerate(BATCH)}, greedy)
    _, client, inst = await start_target(rt, spawn, target_dir)
    spawn("workers.draft", "--method", "suffix", "--lease-ttl", "3", name="draft")
    drafts = await rt.client("draft", "speculate")
    await drafts.wait_for_instances(1, timeout=90)
    models = await rt.models()
    await models.wait_for(lambda c: any(m.role == "draft" and m.spec_method == "suffix" for m in c.values()), 10)

    async def one(i: int, p: list[int]):
        return await collect(await client.call(inst.instance_id, GenerateRequest(p, greedy), TokenDelta))

    # Batch 1: one request at a time.
    first = [await one(i, p) for i, p in enumerate(BATCH)]
    assert [tokens(r) for r in first] == [want[str(i)] for i in range(len(BATCH))]
    # 8 concurrent, the same prompts: the global tree now holds every output.
    second = await asyncio.gather(*(one(i, p) for i, p in enumerate(BATCH)))
    assert [tokens(r) for r in second] == [want[str(i)] for i in range(len(BATCH))]
    (d1, a1), (d2, a2) = totals(first), totals(second)
    assert d2 > 0 and a2 / d2 > 0.9 and a2 > a1, (d1, a1, d2, a2)
    assert max(len(d.token_ids) for r in second for d in r) > 1  # several tokens per verify step
