"""Load tracking: own in-flight blocks, reported load, the larger of the two, expiry."""

from __future__ import annotations

import pytest

from router.load import LoadTracker
from runtime.messages import LoadEvent

pytestmark = pytest.mark.unit


def test_own_requests_add_their_blocks_and_release_removes_them():
    load = LoadTracker()
    load.add(1, "w", 36)
    load.add(2, "w", 36)  # a shared prefix is read by every request: it counts for each
    assert load.decode_blocks("w") == 72 and load.own_requests("w") == 2
    assert load.remove(1)
    assert load.decode_blocks("w") == 36
    assert load.remove(2) and not load.remove(2)  # a second release is a no-op
    assert load.decode_blocks("w") == 0 and load.pressure == {} and load.in_flight() == 0


def test_reported_load_and_own_load_take_the_larger():
    load = LoadTracker(queue_weight=10.0)
    load.observe(LoadEvent("w", running=3, queued=2, active_blocks=40))
    assert load.decode_blocks("w") == 40 and load.queued("w") == 2
    assert load.pressure["w"] == 40 + 20
    load.add(1, "w", 100)
    assert load.decode_blocks("w") == 100 and load.pressure["w"] == 120


def test_expire_and_drop_worker():
    load = LoadTracker()
    load.add(1, "a", 1, now=0.0)
    load.add(2, "b", 1, now=5.0)
    load.add(3, "b", 1, now=5.0)
    assert load.expire(10.0, now=12.0) == [(1, "a")]
    assert load.decode_blocks("a") == 0 and load.decode_blocks("b") == 2
    load.observe(LoadEvent("b", active_blocks=9))
    load.drop_worker("b")
    assert load.decode_blocks("b") == 0 and load.in_flight() == 0 and not load.remove(2)
    assert load.workers() == []
