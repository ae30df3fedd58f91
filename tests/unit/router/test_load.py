"""Load tracking: own in-flight blocks (shared prefixes counted once), reported load, expiry."""

from __future__ import annotations

import pytest

from router.load import LoadTracker
from runtime.messages import LoadEvent

pytestmark = pytest.mark.unit


def test_shared_prefix_blocks_count_once():
    load = LoadTracker()
    load.add(1, "w", [10, 11, 12], partial=1)
    load.add(2, "w", [10, 11, 13], partial=0)  # shares two blocks with ticket 1
    assert load.decode_blocks("w") == 4 + 1 and load.own_requests("w") == 2
    assert load.remove(1)
    assert load.decode_blocks("w") == 3
    assert load.remove(2) and not load.remove(2)  # a second release is a no-op
    assert load.decode_blocks("w") == 0 and load.pressure == {} and load.in_flight() == 0


def test_reported_load_and_own_load_take_the_larger():
    load = LoadTracker(queue_weight=10.0)
    load.observe(LoadEvent("w", running=3, queued=2, active_blocks=40))
    assert load.decode_blocks("w") == 40 and load.queued("w") == 2
    assert load.pressure["w"] == 40 + 20
    load.add(1, "w", list(range(100)), partial=0)
    assert load.decode_blocks("w") == 100 and load.pressure["w"] == 120


def test_expire_and_drop_worker():
    load = LoadTracker()
    load.add(1, "a", [1], 0, now=0.0)
    load.add(2, "b", [2], 0, now=5.0)
    load.add(3, "b", [3], 0, now=5.0)
    assert load.expire(10.0, now=12.0) == [(1, "a")]
    assert load.decode_blocks("a") == 0 and load.decode_blocks("b") == 2
    load.observe(LoadEvent("b", active_blocks=9))
    load.drop_worker("b")
    assert load.decode_blocks("b") == 0 and load.in_flight() == 0 and not load.remove(2)
    assert load.workers() == []
