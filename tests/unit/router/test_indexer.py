"""The KV index on handcrafted event sequences: chains, removal, clearing, order, duplicates, departures."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.indexer import KvIndex
from runtime.kv_hash import block_hashes
from runtime.messages import KvEvent

pytestmark = pytest.mark.unit

A = block_hashes(list(range(64)), 16)  # 4 blocks
B = block_hashes(list(range(32)) + [999] * 32, 16)  # shares A's first 2 blocks


def stored(worker, eid, hashes, parent=None, bs=16):
    return KvEvent(worker, eid, "stored", list(hashes), parent, bs)


def removed(worker, eid, hashes):
    return KvEvent(worker, eid, "removed", list(hashes))


def cleared(worker, eid):
    return KvEvent(worker, eid, "cleared")


def test_overlap_counts_leading_blocks_per_worker():
    index = KvIndex()
    index.apply(stored("w1", 1, A))
    index.apply(stored("w2", 1, A[:2]))
    index.apply(stored("w2", 2, B[2:], parent=B[1]))
    assert index.overlaps(A, ["w1", "w2", "w3"]) == {"w1": 4, "w2": 2, "w3": 0}
    assert index.overlaps(B, ["w1", "w2"]) == {"w1": 2, "w2": 4}
    assert index.overlaps(A[:3], ["w1"]) == {"w1": 3}
    assert index.overlaps([], ["w1"]) == {"w1": 0}
    assert len(index) == 6 and index.num_blocks("w1") == 4 and index.num_blocks("w2") == 4


def test_a_hole_in_the_chain_ends_the_leading_run():
    index = KvIndex()
    index.apply(stored("w", 1, A))
    index.apply(removed("w", 2, [A[1]]))
    assert index.overlaps(A, ["w"]) == {"w": 1}  # blocks 2 and 3 are held but do not lead


def test_removed_and_cleared():
    index = KvIndex()
    index.apply(stored("w1", 1, A))
    index.apply(stored("w2", 1, A))
    index.apply(removed("w1", 2, A[2:]))
    assert index.overlaps(A, ["w1", "w2"]) == {"w1": 2, "w2": 4}
    index.apply(cleared("w2", 2))
    assert index.overlaps(A, ["w1", "w2"]) == {"w1": 2, "w2": 0}
    index.apply(removed("w1", 3, A[:2] + [12345]))  # an unknown hash is ignored
    assert len(index) == 0


def test_duplicate_events_are_applied_once():
    index = KvIndex()
    index.apply(stored("w", 1, A))
    index.apply(removed("w", 2, A[3:]))
    index.apply(stored("w", 1, A))  # duplicate of an applied event: must not resurrect A[3]
    index.apply(removed("w", 2, A[3:]))
    assert index.overlaps(A, ["w"]) == {"w": 3}
    assert index.counters.duplicates == 2 and index.counters.applied == 2


def test_out_of_order_events_wait_for_the_gap():
    index = KvIndex()
    index.apply(cleared("w", 1))
    index.apply(removed("w", 3, A[2:]), now=0.0)  # arrives before the store it undoes
    assert index.overlaps(A, ["w"]) == {"w": 0}
    index.apply(stored("w", 3 - 1, A), now=0.1)
    assert index.overlaps(A, ["w"]) == {"w": 2}  # stored applied first, then removed
    assert index.counters.reordered == 1 and not index.resync_needed


def test_a_gap_that_never_fills_is_skipped_after_the_timeout():
    index = KvIndex(gap_timeout=1.0)
    index.apply(stored("w", 1, A[:1]))
    index.apply(stored("w", 3, A[1:], parent=A[0]), now=10.0)  # event 2 is lost
    assert index.flush_gaps(now=10.5) == 0
    assert index.overlaps(A, ["w"]) == {"w": 1}
    assert index.flush_gaps(now=11.0) == 1
    assert index.overlaps(A, ["w"]) == {"w": 4}
    assert index.resync_needed and index.counters.gaps_skipped == 1
    index.apply(stored("w", 2, B))  # the lost event turns up too late: dropped as old
    assert index.overlaps(B, ["w"]) == {"w": 2}


def test_a_full_reorder_buffer_skips_the_gap():
    index = KvIndex(max_pending=3)
    index.apply(cleared("w", 1))
    for eid in (3, 4, 5):
        index.apply(stored("w", eid, [A[eid - 2]]))
    assert index.overlaps(A, ["w"]) == {"w": 0}  # A[0] (event 2) missing, so nothing leads
    assert index.num_blocks("w") == 3 and index.resync_needed


def test_a_worker_that_left_is_dropped_and_its_stragglers_ignored():
    index = KvIndex()
    index.apply(stored("w1", 1, A))
    index.apply(stored("w2", 1, A[:1]))
    index.remove_worker("w1")
    index.apply(stored("w1", 2, B))
    assert index.overlaps(A, ["w1", "w2"]) == {"w1": 0, "w2": 1}
    assert "w1" not in index.workers() and index.counters.departed_dropped == 1
    assert len(index) == 1  # only w2's block is left


def test_a_restarted_worker_starts_empty_and_bits_are_reused_cleanly():
    index = KvIndex()
    index.apply(stored("old", 1, A))
    index.remove_worker("old")
    index.apply(cleared("new", 1))  # the restart: a new instance id, taking old's freed bit
    assert index.overlaps(A, ["new", "old"]) == {"new": 0, "old": 0}
    index.apply(stored("new", 2, A[:1]))
    assert index.overlaps(A, ["new"]) == {"new": 1}


def test_late_router_starts_at_the_first_event_it_sees():
    index = KvIndex()
    index.apply(stored("w", 41, A[:2]))  # a dump answer: ids continue the worker's sequence
    index.apply(stored("w", 42, A[2:], parent=A[1]))
    assert index.overlaps(A, ["w"]) == {"w": 4} and index.counters.reordered == 0


def test_block_sizes_and_unknown_kinds():
    index = KvIndex()
    index.apply(stored("w1", 1, A, bs=16))
    index.apply(stored("w2", 1, block_hashes(list(range(64)), 32), bs=32))
    assert sorted(index.block_sizes()) == [16, 32] and index.block_size("w2") == 32
    index.remove_worker("w2")
    assert index.block_sizes() == [16]
    index.apply(KvEvent("w1", 2, "resized", [1]))
    assert index.counters.applied == 2 + 1 and index.overlaps(A, ["w1"]) == {"w1": 4}


def test_unregistered_workers_are_reported_after_the_grace():
    index = KvIndex()
    index.apply(stored("ghost", 1, A), now=0.0)
    index.apply(stored("live", 1, A), now=0.0)
    assert index.unregistered({"live"}, older_than=30, now=10) == []
    assert index.unregistered({"live"}, older_than=30, now=31) == ["ghost"]


def test_bad_settings_raise():
    with pytest.raises(ValueError):
        KvIndex(max_pending=0)
    with pytest.raises(ValueError):
        KvIndex(gap_timeout=0)


# --------------------------------------------------------------------------- against a brute-force model


def _model_overlap(blocks: set[int], hashes: list[int]) -> int:
    n = 0
    for h in hashes:
        if h not in blocks:
            break
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shuffle=st.booleans())
def test_random_event_sequences_match_a_brute_force_model(seed, shuffle):
    """Random stored/removed/cleared events of 3 workers, delivered in order or shuffled within a
    window (with duplicates), end in the same state as applying them in order to plain sets."""
    rng = random.Random(seed)
    prompts = [block_hashes([rng.randrange(4)] * 16 + [rng.randrange(3) for _ in range(16 * 5)], 16) for _ in range(6)]
    workers = ["w0", "w1", "w2"]
    model = {w: set() for w in workers}
    sequences = {w: [cleared(w, 1)] for w in workers}
    for _ in range(40):
        w = rng.choice(workers)
        eid = len(sequences[w]) + 1
        kind = rng.random()
        if kind < 0.6:
            p = rng.choice(prompts)
            cut = rng.randrange(len(p))
            event = stored(w, eid, p[cut:], p[cut - 1] if cut else None)
            model[w].update(p[cut:])
        elif kind < 0.95:
            held = sorted(model[w])
            gone = rng.sample(held, min(len(held), rng.randrange(1, 4))) if held else [7]
            event = removed(w, eid, gone)
            model[w].difference_update(gone)
        else:
            event = cleared(w, eid)
            model[w].clear()
        sequences[w].append(event)
    index = KvIndex(max_pending=64)
    for w in workers:
        index.apply(sequences[w][0])  # the worker's first event is seen first
    delivery = [e for w in workers for e in sequences[w][1:]]
    if shuffle:
        delivery += rng.sample(delivery, len(delivery) // 4)  # duplicates
        rng.shuffle(delivery)
    for event in delivery:
        index.apply(event, now=0.0)
    for p in prompts:
        assert index.overlaps(p, workers) == {w: _model_overlap(model[w], p) for w in workers}
    assert not index.resync_needed


def test_the_walk_stops_consuming_hashes_at_the_first_block_nobody_holds():
    index = KvIndex()
    index.apply(stored("w", 1, A[:2]))
    consumed = []

    def lazy():
        for h in A:
            consumed.append(h)
            yield h

    assert index.overlaps(lazy(), ["w", "x"]) == {"w": 2, "x": 0}
    assert consumed == A[:3]
    consumed.clear()
    assert index.overlaps(lazy(), ["x"]) == {"x": 0} and consumed == []  # no indexed candidate: nothing hashed


def test_a_dump_after_lost_events_also_retracts_blocks_the_worker_no_longer_holds():
    index = KvIndex(gap_timeout=1.0)
    index.apply(stored("w", 1, A), now=0.0)
    index.apply(stored("ok", 1, A), now=0.0)
    # event 2 (removed A[2:]) is lost; event 3 arrives and the gap is given up on
    index.apply(stored("w", 3, B[2:], parent=B[1]), now=0.0)
    index.flush_gaps(now=1.0)
    assert index.resync_needed and index.overlaps(A, ["w"]) == {"w": 4}  # stale: w no longer holds A[2:]
    assert index.begin_resync(window=3.0, now=1.0) == 1  # only the worker that lost events
    for eid, h in enumerate([A[0], A[1], B[2], B[3]], start=4):  # the dump: what w really holds
        index.apply(stored("w", eid, [h]), now=1.5)
    assert index.sweep(now=2.0) == 0  # the window is still open
    assert index.sweep(now=4.0) == 2
    assert index.overlaps(A, ["w", "ok"]) == {"w": 2, "ok": 4}
    assert index.overlaps(B, ["w"]) == {"w": 4}


def test_a_worker_that_does_not_answer_the_dump_keeps_its_blocks():
    index = KvIndex(gap_timeout=1.0)
    index.apply(stored("w", 1, A), now=0.0)
    index.apply(stored("w", 3, B), now=0.0)
    index.flush_gaps(now=1.0)
    index.begin_resync(window=3.0, now=1.0)
    assert index.sweep(now=10.0) == 0 and index.overlaps(A, ["w"]) == {"w": 4}
