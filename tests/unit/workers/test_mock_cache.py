"""The mock worker's toy prefix cache emits the events a real paged cache would."""

from __future__ import annotations

import pytest

from runtime.kv_hash import block_hashes
from workers.mock import ToyPrefixCache

pytestmark = pytest.mark.unit


def test_store_match_and_evict_leaf_first():
    cache = ToyPrefixCache("w", num_blocks=3, block_size=2)
    a = block_hashes([1, 2, 3, 4, 5, 6], 2)
    assert cache.acquire(a) == 0
    [stored] = cache.events
    assert (stored.kind, stored.block_hashes, stored.parent_hash) == ("stored", a, None)
    cache.release(a)
    cache.events.clear()

    b = block_hashes([1, 2, 3, 4, 9, 9], 2)  # shares two blocks with a
    assert cache.acquire(b) == 2
    [removed, stored] = cache.events
    # Full: one block must go, and it is a's leaf, never a shared parent.
    assert removed.kind == "removed" and removed.block_hashes == [a[2]]
    assert stored.block_hashes == [b[2]] and stored.parent_hash == b[1]
    assert stored.event_id == removed.event_id + 1
    assert cache.match(b) == 3 and cache.match(a) == 2


def test_pinned_blocks_are_not_evicted_and_dump_lists_parents_first():
    cache = ToyPrefixCache("w", num_blocks=2, block_size=1)
    a = block_hashes([1, 2], 1)
    cache.acquire(a)
    cache.acquire(block_hashes([7], 1))  # no room: a is pinned, so nothing is evicted
    assert cache.match(a) == 2
    cache.events.clear()
    dump = cache.dump()
    assert [e.block_hashes[0] for e in dump][:2] == a
    assert dump[1].parent_hash == a[0]
