"""The KV router fed by hand (no runtime): prefix affinity, bursts spread, departures, errors, logs."""

from __future__ import annotations

import logging

import pytest

from router.base import Selection
from router.cost import KvRouterConfig
from router.kv_router import KvRouter
from runtime import InvalidRequest, NoInstances
from runtime.kv_hash import block_hashes
from runtime.messages import InstanceRecord, KvEvent, LoadEvent

pytestmark = pytest.mark.unit

PREFIX = list(range(1000, 1512))  # 32 blocks


def record(wid: str, model: str = "m") -> InstanceRecord:
    return InstanceRecord(wid, "ns", "target", "generate", f"s.{wid}", model=model)


def make_router(workers=("w0", "w1", "w2"), **options) -> tuple[KvRouter, dict]:
    records = {w: record(w) for w in workers}
    router = KvRouter(lambda model: [r for r in records.values() if model is None or r.model == model],
                      KvRouterConfig(seed=7, **options))
    router.on_instances({w: r for w, r in records.items()})
    return router, records


def prompt(suffix_id: int, n: int = 64) -> list[int]:
    return PREFIX + [suffix_id * 100_000 + i for i in range(n)]


async def test_prefix_goes_to_the_worker_that_holds_it():
    router, _ = make_router()
    router.on_kv_event(KvEvent("w1", 1, "stored", block_hashes(PREFIX, 16)))
    for i in range(5):
        s = await router.select("m", prompt(i))
        assert (s.instance_id, s.overlap_blocks) == ("w1", 32)
        router.release(s)
    assert router.in_flight == {} and router.load.in_flight() == 0


async def test_a_burst_spreads_once_the_holder_is_loaded():
    router, _ = make_router()
    router.on_kv_event(KvEvent("w1", 1, "stored", block_hashes(PREFIX, 16)))
    chosen = [(await router.select("m", prompt(i))).instance_id for i in range(30)]
    # 36-block requests; w1 holds 32: it costs 2*4 + 36k with k requests running, the others 2*36 + 36j.
    # So w1 takes two, then the others one each, and w1 stays at most two requests ahead.
    assert chosen[:2] == ["w1", "w1"] and set(chosen[2:4]) == {"w0", "w2"}
    counts = {w: chosen.count(w) for w in ("w0", "w1", "w2")}
    assert 1 <= counts["w1"] - max(counts["w0"], counts["w2"]) <= 2 and sum(counts.values()) == 30


async def test_reported_load_alone_moves_requests():
    router, _ = make_router()
    router.on_kv_event(KvEvent("w1", 1, "stored", block_hashes(PREFIX, 16)))
    router.on_load_event(LoadEvent("w1", running=20, active_blocks=500))
    s = await router.select("m", prompt(0))
    assert s.instance_id != "w1" and s.overlap_blocks == 0


async def test_a_worker_that_left_is_never_chosen_and_forgotten():
    router, records = make_router()
    router.on_kv_event(KvEvent("w1", 1, "stored", block_hashes(PREFIX, 16)))
    held = await router.select("m", prompt(0))
    assert held.instance_id == "w1"
    del records["w1"]
    router.on_instances(dict(records))
    assert router.index.num_blocks("w1") == 0 and "w1" not in router.in_flight
    router.release(held)  # a late release of a forgotten selection is harmless
    router.on_kv_event(KvEvent("w1", 2, "stored", block_hashes(PREFIX, 16)))  # straggler
    for i in range(20):
        assert (await router.select("m", prompt(i))).instance_id != "w1"
    assert router.index.num_blocks("w1") == 0


async def test_exclude_model_and_no_instances():
    router, records = make_router(("a", "b"))
    records["c"] = record("c", model="other")
    router.on_instances(dict(records))
    assert (await router.select("m", prompt(0), exclude={"a"})).instance_id == "b"
    assert (await router.select("other", prompt(0))).instance_id == "c"
    with pytest.raises(NoInstances):
        await router.select("m", prompt(0), exclude={"a", "b"})
    with pytest.raises(NoInstances):
        await router.select("nope", prompt(0))


async def test_bad_token_ids_raise_a_typed_error():
    router, _ = make_router()
    router.on_kv_event(KvEvent("w1", 1, "stored", block_hashes(PREFIX, 16)))
    with pytest.raises(InvalidRequest) as err:
        await router.select("m", [1, -5] * 16)
    assert err.value.field == "token_ids"


async def test_workers_with_other_block_sizes_use_their_own_hashes():
    router, _ = make_router(("w16", "w32"))
    router.on_kv_event(KvEvent("w16", 1, "stored", block_hashes(PREFIX[:64], 16), block_size=16))
    router.on_kv_event(KvEvent("w32", 1, "stored", block_hashes(PREFIX, 32), block_size=32))
    s = await router.select("m", prompt(0))
    assert (s.instance_id, s.overlap_blocks) == ("w32", 16)
    assert router.load.decode_blocks("w32") == (512 + 64) // 32  # its own block size


async def test_decisions_are_logged_with_overlap_and_cost_per_candidate(caplog):
    router, _ = make_router()
    router.on_kv_event(KvEvent("w1", 1, "stored", block_hashes(PREFIX, 16)))
    with caplog.at_level(logging.DEBUG, logger="router.kv_router"):
        await router.select("m", prompt(0), request_id="req-9")
    [line] = [r.getMessage() for r in caplog.records if "req-9" in r.getMessage()]
    assert "chose w1" in line
    # 36 blocks; w1 holds 32: cost 2*4; the others 2*36
    assert "w1: overlap=32 cost=8" in line and "w0: overlap=0 cost=72" in line and "w2: overlap=0 cost=72" in line


async def test_unreleased_selections_expire_and_ghost_workers_are_dropped():
    router, _ = make_router(inflight_ttl=10.0, unregistered_grace=5.0)
    s = await router.select("m", prompt(0))
    router.on_kv_event(KvEvent("ghost", 1, "stored", block_hashes(PREFIX, 16)))
    router.maintain(now=router.load._inflight[s.ticket].since + 11.0)
    assert router.in_flight == {} and router.load.in_flight() == 0
    assert "ghost" not in router.index.workers()
    router.release(s)
    assert router.in_flight == {}


async def test_tickets_are_unique_and_release_only_counts_once():
    router, _ = make_router()
    a = await router.select("m", prompt(0))
    b = await router.select("m", prompt(0))
    assert a.ticket != b.ticket and isinstance(a, Selection)
    router.release(a)
    router.release(a)
    assert sum(router.in_flight.values()) == 1


def test_lazy_hashes_equal_the_runtime_hashes():
    from router.kv_router import lazy_block_hashes

    for n in (0, 15, 16, 17, 100, 513):
        tokens = list(range(7, 7 + n))
        assert list(lazy_block_hashes(tokens, 16)) == block_hashes(tokens, 16)


async def test_costs_follow_the_formula(caplog):
    import random
    import re

    from router.cost import request_blocks

    rng = random.Random(4)
    router, _ = make_router(("w0", "w1", "w2", "w3"), queue_weight=5.0)
    for i, w in enumerate(("w0", "w1", "w2", "w3")):
        router.on_kv_event(KvEvent(w, 1, "stored", block_hashes(PREFIX[: 16 * rng.randrange(33)], 16)))
        router.on_load_event(LoadEvent(w, running=1, queued=rng.randrange(4), active_blocks=rng.randrange(100)))
    load = {w: (router.load.decode_blocks(w), router.load.queued(w)) for w in ("w0", "w1", "w2", "w3")}
    with caplog.at_level(logging.DEBUG, logger="router.kv_router"):
        await router.select("m", prompt(0), request_id="cmp")
    line = next(r.getMessage() for r in caplog.records if "cmp" in r.getMessage())
    n = request_blocks(len(prompt(0)), 16)
    found = re.findall(r"(w\d): overlap=(\d+) cost=([\d.]+)", line)
    assert len(found) == 4
    for w, overlap, cost in found:
        decode, queued = load[w]
        assert float(cost) == pytest.approx(2.0 * (n - int(overlap)) + decode + 5.0 * queued)


async def test_a_long_cached_prompt_is_hashed_off_the_event_loop():
    """500,000 tokens that a worker holds: 31k block hashes. The ones past the first 1,024 blocks are
    computed in a thread, so the loop keeps running; the overlaps are those of hashing inline,
    including a prefix held only part of the way (the walk stops inside the head, or past it)."""
    import asyncio
    import random
    import time

    from router.kv_router import INLINE_HASH_BLOCKS

    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(500_000)]
    hashes = block_hashes(tokens, 16)
    router, _ = make_router()
    router.on_kv_event(KvEvent("w0", 1, "stored", hashes))
    router.on_kv_event(KvEvent("w1", 1, "stored", hashes[: INLINE_HASH_BLOCKS + 300]))
    router.on_kv_event(KvEvent("w2", 1, "stored", hashes[:100]))
    # A callback queued as select starts runs while select is pending (it yields to the loop: the
    # hashing runs in a thread), not after it returns (hashing inline would hold the loop throughout).
    loop = asyncio.get_running_loop()
    ran: list[float] = []
    started = time.perf_counter()
    loop.call_soon(lambda: ran.append(time.perf_counter()))
    selection = await router.select("m", tokens)
    ended = time.perf_counter()
    assert (selection.instance_id, selection.overlap_blocks) == ("w0", len(hashes))
    assert len(ran) == 1 and started < ran[0] < ended, (ran, started, ended)
    found = await router._overlaps(tokens, 16, ["w0", "w1", "w2"])
    assert found == {"w0": len(hashes), "w1": INLINE_HASH_BLOCKS + 300, "w2": 100}
    # a head no worker holds all of: no thread, the same answer as hashing everything
    assert await router._overlaps(tokens, 16, ["w1", "w2"]) == {"w1": INLINE_HASH_BLOCKS + 300, "w2": 100}
    router.on_kv_event(KvEvent("w0", 2, "cleared", []))
    assert await router._overlaps(tokens, 16, ["w0", "w2"]) == {"w0": 0, "w2": 100}


async def test_a_lower_tier_hit_scores_between_a_device_hit_and_a_miss():
    """w0 holds the prefix on its device, w1 in its host tier (KvEvent.tier), w2 nowhere: w0 wins,
    then w1 (once w0 is gone), and a request never goes to w2 while w1 holds the prefix below."""
    router, records = make_router()
    hashes = block_hashes(PREFIX, 16)
    router.on_kv_event(KvEvent("w0", 1, "stored", hashes))
    router.on_kv_event(KvEvent("w1", 1, "stored", hashes, tier="host"))
    s = await router.select("m", prompt(1))
    assert (s.instance_id, s.overlap_blocks) == ("w0", 32)
    router.release(s)
    del records["w0"]
    router.on_instances(dict(records))
    for i in range(4):
        s = await router.select("m", prompt(2 + i))
        assert s.instance_id == "w1" and s.overlap_blocks == 0  # the device overlap; the tier hit is scored apart
        router.release(s)
    # the tier's own removal event takes the hit away: w1 and w2 tie again
    router.on_kv_event(KvEvent("w1", 2, "removed", hashes, tier="host"))
    chosen = set()
    for i in range(20):
        s = await router.select("m", prompt(10 + i))
        chosen.add(s.instance_id)
        router.release(s)
    assert chosen == {"w1", "w2"}


async def test_lower_tier_hits_count_after_the_device_overlap():
    """Device blocks 0..15 and host blocks 16..31 on w1 beat 24 device blocks on w0 (16 + 0.75*16 = 28 > 24)."""
    router, _ = make_router(("w0", "w1"))
    hashes = block_hashes(PREFIX, 16)
    router.on_kv_event(KvEvent("w0", 1, "stored", hashes[:24]))
    router.on_kv_event(KvEvent("w1", 1, "stored", hashes[:16]))
    router.on_kv_event(KvEvent("w1", 1, "stored", hashes[16:], hashes[15], tier="host"))
    s = await router.select("m", prompt(1))
    assert s.instance_id == "w1"
    router.release(s)
    router2, _ = make_router(("w0", "w1"), tier_hit_weight=0.25)  # 16 + 0.25*16 = 20 < 24
    router2.on_kv_event(KvEvent("w0", 1, "stored", hashes[:24]))
    router2.on_kv_event(KvEvent("w1", 1, "stored", hashes[:16]))
    router2.on_kv_event(KvEvent("w1", 1, "stored", hashes[16:], hashes[15], tier="host"))
    assert (await router2.select("m", prompt(1))).instance_id == "w0"
async def test_lora_requests_hash_from_their_adapter_and_never_match_the_base():
    """A worker's blocks under adapter "a1" (chained from its root, as the engine's sequences chain
    them) are hits for a1's requests only; the base's blocks are no hits for a1, nor a1's for a2."""
    from runtime.kv_hash import chain_root
    from workers.engine.sequence import Sequence
    from runtime.messages import SamplingParams

    seq = Sequence("r", list(PREFIX), len(PREFIX), 0, SamplingParams(), lora="a1", hash_root=chain_root("a1"))
    router, _ = make_router()
    router.on_kv_event(KvEvent("w1", 1, "stored", seq.full_block_hashes(16, len(PREFIX))))
    router.on_kv_event(KvEvent("w2", 1, "stored", block_hashes(PREFIX, 16)))
    for lora, holder in (("a1", "w1"), ("", "w2")):
        s = await router.select("m", prompt(1), lora=lora)
        assert (s.instance_id, s.overlap_blocks) == (holder, 32)
        router.release(s)
    s = await router.select("m", prompt(1), lora="a2")
    assert s.overlap_blocks == 0
    router.release(s)
    assert block_hashes(PREFIX, 16, chain_root("a1")) == seq.block_hashes  # the router's hashes are the engine's
