"""Spec-decode aggregates from real mock workers over NATS: exact totals, and restarts never go backwards."""

from __future__ import annotations

import asyncio

import pytest

from router.metrics import spec_stats_json
from router.spec_stats import SpecDecodeStats, follow_spec_stats
from runtime.messages import GenerateRequest, SamplingParams, SpecUsage, TokenDelta
from runtime.request_plane import collect
from runtime.spec_stats import SpecCounters
from tests.support.wait import eventually

pytestmark = pytest.mark.integration

GAMMA = 4


def start(spawn, acceptance: str, draft: str):
    return spawn("workers.mock", "--lease-ttl", "3", "--stats-interval", "0.1", "--token-latency-ms", "0",
                 "--num-speculative-tokens", str(GAMMA), "--acceptance-rate", acceptance, "--draft-id", draft,
                 name=f"mock-{draft}")


async def run_requests(client, instance_id: str, n: int, max_tokens: int) -> SpecUsage:
    """Send ``n`` requests; the sum of their per-request spec usage (exact, from the worker)."""
    total = SpecUsage()
    for i in range(n):
        request = GenerateRequest(list(range(300 + i, 340 + i)), SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens))
        spec = (await collect(await client.call(instance_id, request, TokenDelta)))[-1].usage.spec
        total = SpecUsage(total.num_drafts + spec.num_drafts, total.num_draft_tokens + spec.num_draft_tokens,
                          total.num_accepted_tokens + spec.num_accepted_tokens)
    return total


def as_usage(c: SpecCounters) -> SpecUsage:
    return SpecUsage(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)


async def test_aggregates_are_exact_and_survive_a_restart(rt, spawn):
    stats = SpecDecodeStats(window=60.0)
    await follow_spec_stats(rt, stats)
    client = await rt.client("target", "generate")
    procs = {"all": start(spawn, "1.0", "draft-all"), "none": start(spawn, "0.0", "draft-none")}
    records = await client.wait_for_instances(2, timeout=60)
    ids = {name: next(r.instance_id for r in records if r.pid == p.pid) for name, p in procs.items()}

    used_all = await run_requests(client, ids["all"], 6, max_tokens=23)
    used_none = await run_requests(client, ids["none"], 4, max_tokens=9)
    await eventually(lambda: as_usage(stats.target_lifetime(ids["all"])) == used_all
                     and as_usage(stats.target_lifetime(ids["none"])) == used_none, what="stats caught up")

    # acceptance 1.0: every draft accepts all γ tokens and each round emits γ + 1 tokens
    everything = stats.target_lifetime(ids["all"])
    assert everything.num_drafts == 6 * 5  # ceil(23 / 5) rounds per request
    assert everything.num_accepted_tokens == everything.num_draft_tokens == GAMMA * everything.num_drafts
    assert everything.accepted_per_pos == [everything.num_drafts] * GAMMA
    assert everything.acceptance_rate == 1.0 and everything.mean_accepted_length == GAMMA + 1
    # acceptance 0.0: one token per round, nothing accepted
    nothing = stats.target_lifetime(ids["none"])
    assert nothing.num_drafts == 4 * 9 and nothing.num_accepted_tokens == 0
    assert nothing.accepted_per_pos == [0] * GAMMA
    assert nothing.acceptance_rate == 0.0 and nothing.mean_accepted_length == 1.0
    assert set(stats.pairs) == {(ids["all"], "draft-all"), (ids["none"], "draft-none")}
    # the targets started after the aggregate: the window holds everything too
    assert as_usage(stats.total_window()) == as_usage(stats.total_lifetime())

    before = stats.total_lifetime()
    await asyncio.to_thread(procs["all"].stop)
    restarted = start(spawn, "1.0", "draft-all")
    records = await client.snapshot.wait_for(lambda items: any(r.pid == restarted.pid for r in items.values()), 60)
    new_id = next(r.instance_id for r in records.values() if r.pid == restarted.pid)
    assert new_id != ids["all"]
    after_restart = stats.total_lifetime()
    assert after_restart.covers(before)  # the departed target's counts stay
    used_new = await run_requests(client, new_id, 2, max_tokens=10)
    await eventually(lambda: as_usage(stats.target_lifetime(new_id)) == used_new, what="restarted target counted")
    total = stats.total_lifetime()
    assert total.num_drafts == before.num_drafts + used_new.num_drafts
    assert total.num_accepted_tokens == before.num_accepted_tokens + used_new.num_accepted_tokens
    report = spec_stats_json(stats)
    assert {t["target"] for t in report["targets"]} == {ids["all"], ids["none"], new_id}
    assert report["total"]["lifetime"]["num_drafts"] == total.num_drafts
