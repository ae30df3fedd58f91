"""Paged cache bookkeeping: prefix hits, LRU eviction with ``removed`` events, rollback, no leaks."""

import random

import pytest

from runtime.kv_hash import block_hashes
from runtime.messages import KvEventKind
from workers.engine.block_manager import BlockManager, NoFreeBlocks

pytestmark = pytest.mark.unit


def _store(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate and register a sequence's full blocks the way the engine does; returns its blocks."""
    hashes = block_hashes(tokens, bm.block_size)
    hits = bm.match_prefix(hashes)
    bm.acquire(hits)
    blocks = hits + bm.allocate(len(hashes) - len(hits))
    bm.register(blocks, hashes, 0)
    return blocks


def test_prefix_reuse_and_stored_chain_events():
    bm = BlockManager(8, 4, "w")
    a = _store(bm, list(range(12)))
    (stored,) = bm.drain_events()
    assert stored.kind == KvEventKind.STORED and stored.parent_hash is None
    assert stored.block_hashes == block_hashes(list(range(12)), 4)
    b_tokens = list(range(8)) + [99] * 4
    b = _store(bm, b_tokens)
    assert b[:2] == a[:2] and b[2] != a[2]  # the shared prefix reuses blocks
    assert bm.ref_count[a[0]] == 2
    (second,) = bm.drain_events()
    assert second.block_hashes == block_hashes(b_tokens, 4)[2:] and second.parent_hash == stored.block_hashes[1]


def test_freed_blocks_stay_cached_until_lru_eviction_publishes_removed():
    bm = BlockManager(4, 4, "w")
    old = _store(bm, list(range(8)))
    bm.free(old)
    bm.drain_events()
    assert bm.num_free_blocks == 4 and bm.match_prefix(block_hashes(list(range(8)), 4)) == old
    fresh = bm.allocate(3)  # two never-used blocks first, then the leaf of the old chain
    assert old[1] in fresh and old[0] not in fresh
    (removed,) = bm.drain_events()
    assert removed.kind == KvEventKind.REMOVED and removed.block_hashes == [block_hashes(list(range(8)), 4)[1]]
    assert bm.match_prefix(block_hashes(list(range(8)), 4)) == [old[0]]
    with pytest.raises(NoFreeBlocks):
        bm.allocate(2)


def test_truncate_frees_tail_and_copies_shared_partial_block():
    bm = BlockManager(8, 4, "w")
    blocks = _store(bm, list(range(12)))
    other = _store(bm, list(range(12)))  # shares all three blocks
    bm.drain_events()
    copies = bm.truncate(blocks, 6)  # keeps block 0 and half of block 1
    assert len(blocks) == 2 and blocks[0] == other[0] and blocks[1] != other[1]
    assert copies == [(other[1], blocks[1])]
    assert bm.ref_count[other[2]] == 1 and bm.ref_count[other[1]] == 1
    # a private cached block cut in half stops being a cache entry
    bm.free(other)
    solo = _store(bm, list(range(12)))
    bm.drain_events()
    assert bm.truncate(solo, 10) == []
    (removed,) = bm.drain_events()
    assert removed.kind == KvEventKind.REMOVED and removed.block_hashes == [block_hashes(list(range(12)), 4)[2]]


def test_dump_lists_parents_before_children():
    bm = BlockManager(8, 4, "w")
    _store(bm, list(range(12)))
    dump = bm.dump()
    assert [e.block_hashes[0] for e in dump] == block_hashes(list(range(12)), 4)
    assert [e.parent_hash for e in dump] == [None] + block_hashes(list(range(12)), 4)[:2]


def test_random_workload_never_leaks_or_double_counts():
    rng = random.Random(0)
    bm = BlockManager(32, 4, "w")
    live = []
    for _ in range(500):
        if live and (rng.random() < 0.5 or not bm.can_allocate(4)):
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 16))]
        hashes = block_hashes(tokens, 4)
        hits = bm.match_prefix(hashes)
        need = -(-len(tokens) // 4) - len(hits)
        if not bm.can_allocate(need + sum(bm.ref_count[b] == 0 for b in hits)):
            continue
        bm.acquire(hits)
        blocks = hits + bm.allocate(need)
        bm.register(blocks[: len(hashes)], hashes, 0)
        live.append(blocks)
        assert sum(1 for c in bm.ref_count if c == 0) == bm.num_free_blocks
    for blocks in live:
        bm.free(blocks)
    assert bm.num_free_blocks == 32 and all(c == 0 for c in bm.ref_count)
    assert all(bm.block_hash[b] == h for h, b in bm.hash_to_block.items())


def test_priority_free_queues_evict_the_least_important_blocks_first():
    bm = BlockManager(6, 4, "w")
    urgent = _store(bm, list(range(8)))  # 2 blocks, freed with priority -3 (vLLM's polarity: kept longest)
    plain = _store(bm, list(range(100, 108)))  # 2 blocks, priority 0
    low = _store(bm, list(range(200, 208)))  # 2 blocks, priority 7
    bm.free(urgent, -3)
    bm.free(low, 7)  # freed after the others' blocks were taken: LRU alone would evict urgent's first
    bm.free(plain, 0)
    bm.drain_events()
    assert bm.num_free_blocks == 6 and bm.can_allocate(6)
    assert sorted(bm.allocate(2)) == sorted(low)
    assert sorted(bm.allocate(2)) == sorted(plain)
    assert bm.match_prefix(block_hashes(list(range(8)), 4)) == urgent  # still cached
    hit = bm.match_prefix(block_hashes(list(range(8)), 4))
    bm.acquire(hit)  # a hit taken back out of its priority's free queue
    assert bm.num_free_blocks == 0
    bm.free(hit, -3)
    assert bm.num_free_blocks == 2 and sorted(bm.allocate(2)) == sorted(urgent)


def test_priority_zero_everywhere_is_plain_lru():
    a, b = BlockManager(4, 4, "w"), BlockManager(4, 4, "w")
    for bm, priority in ((a, None), (b, 0)):
        first = _store(bm, list(range(8)))
        second = _store(bm, list(range(50, 58)))
        for blocks in (second, first):
            bm.free(blocks, *(() if priority is None else (priority,)))
    assert a.allocate(4) == b.allocate(4)
