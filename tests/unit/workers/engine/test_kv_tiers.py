"""KV tiers below the device pool (host slab, checksummed disk files), on a tiny model with real files.

Multi-turn conversations on a device pool far smaller than their KV: greedy outputs equal with
tiers off, host, host + disk, and on a second engine that shares the first one's disk directory;
hidden rows of loaded blocks equal recomputed ones; the host tier stays within its capacity;
truncated, corrupted and missing files are misses and recompute; temporary files are never loaded.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime.kv_hash import block_hashes
from runtime.messages import KvEventKind, SamplingParams
from tests.support.tiny_models import tiny_hf_model
from workers.engine.engine import Engine, EngineConfig
from workers.engine.kv_disk import HEADER, check_file, TEMP_PREFIX, decode_block, encode_block
from workers.engine.kv_tiers import block_bytes, build_tiers
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tiers")
    tiny_hf_model("llama", path, vocab=256)
    return load_model(path)


def engine(model, host_blocks: int = 0, disk=None, hidden=(), num_blocks: int = 24) -> Engine:
    e = Engine(model, EngineConfig(num_blocks=num_blocks, block_size=BS), eos_token_ids=(0,), hidden_layers=hidden)
    if host_blocks:
        e.attach_tiers(build_tiers(e, host_blocks * block_bytes(e), str(disk) if disk else None, 1 << 30, "tiny"))
    return e


def conversations(e: Engine, turns: int = 4, n: int = 6, seed: int = 0) -> list[list[int]]:
    """``n`` conversations, ``turns`` turns round robin, each turn re-sending the history; outputs per turn."""
    rng = random.Random(seed)
    history = {f"c{i}": [rng.randrange(1, 256) for _ in range(18)] for i in range(n)}
    outs = []
    for turn in range(turns):
        for c in history:
            out = e.generate({f"{c}-{turn}": history[c]}, GREEDY)[f"{c}-{turn}"]
            outs.append(out)
            history[c] = history[c] + out + [rng.randrange(1, 256) for _ in range(5)]
    if e.tiers is not None and e.tiers.disk is not None:
        e.tiers.disk.flush()
    return outs


_OFF: dict = {}


def off(model, turns: int = 4, n: int = 6) -> list[list[int]]:
    """The outputs with tiers off (computed once per shape)."""
    if (turns, n) not in _OFF:
        _OFF[(turns, n)] = conversations(engine(model), turns, n)
    return _OFF[(turns, n)]


def test_greedy_outputs_equal_with_tiers_off_host_disk_and_a_second_engine_sharing_the_disk(model, tmp_path):
    want = off(model)
    host = engine(model, host_blocks=400)
    assert conversations(host) == want
    assert host.tiers.stats["host"].hits > 0  # the device pool (24 blocks) thrashes: prefixes came back from host
    disk = engine(model, host_blocks=16, disk=tmp_path)  # a host tier too small: the disk holds the rest
    assert conversations(disk) == want
    assert disk.tiers.disk.counters.written > 0
    other = engine(model, host_blocks=16, disk=tmp_path)  # another target, same directory, nothing cached
    assert conversations(other) == want
    assert other.tiers.stats["disk"].hits > 0 and not other.tiers.disk.counters.bad
    assert other.blocks.num_free_blocks == 24


def test_tier_moves_are_kv_events_of_their_own_tier(model, tmp_path):
    e = engine(model, host_blocks=8, disk=tmp_path)
    conversations(e, turns=2, n=3)
    events = e.drain_kv_events()
    by_tier = {t: [ev for ev in events if ev.tier == t] for t in ("", "host", "disk")}
    assert all(by_tier.values())
    for tier in ("host", "disk"):  # each tier numbers its own events, without gaps
        assert [ev.event_id for ev in by_tier[tier]] == list(range(1, len(by_tier[tier]) + 1))
    assert any(ev.kind == KvEventKind.REMOVED for ev in by_tier["host"])  # 8 blocks: LRU evicted some
    stored = {h for ev in by_tier["disk"] if ev.kind == KvEventKind.STORED for h in ev.block_hashes}
    assert stored == {int(p.stem, 16) for p in e.tiers.disk.dir.glob("*.kvb")}


def test_host_tier_stays_within_its_capacity(model):
    e = engine(model, host_blocks=10)
    slab = e.tiers.host.slab.data_ptr(), e.tiers.host.slab.numel()
    conversations(e, turns=3)
    assert len(e.tiers.host) == 10 and e.tiers.stats["host"].evicted > 0
    assert (e.tiers.host.slab.data_ptr(), e.tiers.host.slab.numel()) == slab  # never reallocated or grown


def test_hidden_rows_of_blocks_loaded_back_equal_recomputed_ones(model):
    layers = (1, 2)
    rng = random.Random(3)
    prompt = [rng.randrange(1, 256) for _ in range(37)]
    fillers = {f"f{i}": [rng.randrange(1, 256) for _ in range(30)] for i in range(3)}

    def rows_after_prefill(e: Engine) -> tuple[list[torch.Tensor], int]:
        e.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        e.step()  # the prefill (and, with tiers, the load)
        seq = e.seqs["p"]
        rows = e.news.rows([seq], [(0, 36)], layers, None)[0]
        cached = seq.num_cached_tokens
        while e.has_work():
            e.step()
        return rows, cached

    fresh, _ = rows_after_prefill(engine(model, hidden=layers))
    e = engine(model, host_blocks=200, hidden=layers)
    e.generate({"p0": prompt}, GREEDY)
    e.generate(fillers, GREEDY)  # evict the prompt's blocks from the 24-block device pool
    assert not e.blocks.match_prefix(block_hashes(prompt, BS)[:9])  # not on the device any more
    before = e.tiers.stats["host"].hits
    loaded, cached = rows_after_prefill(e)
    assert cached == 36 and e.tiers.stats["host"].hits == before + 9
    for a, b in zip(fresh, loaded):
        assert torch.equal(a, b)


def _first_block_file(e: Engine):
    files = sorted(e.tiers.disk.dir.glob("*.kvb"))
    assert files
    return files


@pytest.mark.parametrize("fault", ["truncated", "corrupt", "missing"])
def test_a_bad_disk_block_is_a_miss_and_recomputes(model, tmp_path, fault):
    want = off(model, turns=2, n=3)
    writer = engine(model, host_blocks=16, disk=tmp_path)
    conversations(writer, turns=2, n=3)
    files = _first_block_file(writer)
    for path in files:
        data = path.read_bytes()
        if fault == "truncated":
            path.write_bytes(data[: len(data) // 2])
        elif fault == "corrupt":
            flipped = bytearray(data)
            flipped[HEADER.size + 4 * BS + 7] ^= 0x40  # one bit of the payload
            path.write_bytes(bytes(flipped))
        else:
            path.unlink()
    reader = engine(model, host_blocks=16, disk=tmp_path)
    assert conversations(reader, turns=2, n=3) == want
    assert reader.tiers.stats["disk"].hits == 0
    if fault != "missing":
        assert reader.tiers.disk.counters.bad.get(fault, 0) > 0
        # the bad files read were removed, and the recompute wrote them again, whole
        assert sum(check_file(p, reader.tiers.copier.block_bytes) for p in files if p.exists()) > 0


def test_a_temporary_file_is_never_loaded_and_a_block_file_checks_its_block():
    payload = bytes(range(256)) * 4
    parts = encode_block(1234, 99, [1, 2, 3, 4], payload)
    data = b"".join(parts)
    assert bytes(decode_block(data, 1234, 99, [1, 2, 3, 4], len(payload))) == payload
    assert decode_block(data, 1234, 98, [1, 2, 3, 4], len(payload)) is None  # another parent
    assert decode_block(data, 1234, 99, [1, 2, 3, 5], len(payload)) is None  # other tokens (a hash collision)
    assert decode_block(data[:-1], 1234, 99, [1, 2, 3, 4], len(payload)) is None
    assert TEMP_PREFIX.startswith(".") and not TEMP_PREFIX.endswith(".kvb")


def test_leftover_temporary_files_are_ignored_and_stale_ones_removed(model, tmp_path):
    import os
    import time

    e = engine(model, host_blocks=16, disk=tmp_path)
    d = e.tiers.disk.dir
    e.tiers.close()
    fresh, stale = d / f"{TEMP_PREFIX}00-1-1", d / f"{TEMP_PREFIX}00-2-2"
    fresh.write_bytes(b"partial")
    stale.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    engine(model, host_blocks=16, disk=tmp_path)  # a restart scans the directory
    assert fresh.exists() and not stale.exists()  # a live writer's temp stays; a dead one's goes


def test_disk_tier_stays_within_its_size(model, tmp_path):
    e = Engine(model, EngineConfig(num_blocks=24, block_size=BS), eos_token_ids=(0,))
    size = block_bytes(e)
    e.attach_tiers(build_tiers(e, 16 * size, str(tmp_path), 10 * (size + HEADER.size + 4 * BS), "tiny"))
    conversations(e, turns=2)
    assert len(list(e.tiers.disk.dir.glob("*.kvb"))) <= 10
    assert e.tiers.disk.counters.evicted > 0


def test_concurrent_writers_of_one_directory_leave_only_whole_blocks(tmp_path):
    """Two disk tiers (two targets) write the same and different blocks into one directory at once."""
    from workers.engine.kv_disk import DiskTier

    payload = 4096
    tiers = [DiskTier(tmp_path, "layout", 1 << 30, payload, BS, max_queue=1024) for _ in range(2)]
    for i in range(200):
        for k, t in enumerate(tiers):
            h = i if i % 2 else 1000 * (k + 1) + i  # odd blocks: both write them; even ones: each its own
            assert t.put(h, 0, [1, 2, 3, i % 256], bytes([i % 256]) * payload)
    for t in tiers:
        t.close()
    files = list((tmp_path / "layout").iterdir())
    assert len(files) == 100 + 2 * 100 and all(f.suffix == ".kvb" for f in files)
    assert all(check_file(f, payload) for f in files)
    got = tiers[0].get(7, 0, [1, 2, 3, 7])
    assert got is not None and bytes(got) == bytes([7]) * payload


def test_a_dump_republishes_the_host_tier_as_host_events(model):
    e = engine(model, host_blocks=400)
    conversations(e, turns=2, n=3)
    events = [ev for ev in e.drain_kv_events() if ev.tier == "host"]
    dump = e.tiers.dump()
    assert {h for ev in dump for h in ev.block_hashes} == set(e.tiers.host.entries)
    assert all(ev.tier == "host" and ev.kind == KvEventKind.STORED for ev in dump)
    # numbered after the tier's own events, so a router's index takes them in order
    assert [ev.event_id for ev in dump] == list(range(events[-1].event_id + 1, events[-1].event_id + 1 + len(dump)))


def test_the_host_tier_evicts_the_least_important_priority_first_lru_within():
    from workers.engine.kv_tiers import HostTier

    host = HostTier(3, 8)
    host.reserve(1, 0, priority=-2)  # an urgent request's block (vLLM's polarity): kept longest
    host.reserve(2, 1, priority=4)
    host.reserve(3, 2, priority=4)
    host.touch(2)  # within priority 4, block 3 is now the least recently used
    assert host.next_victim() == 3
    assert host.reserve(4, 3)[1] == [3]  # priority 0
    assert host.reserve(5, 4)[1] == [2]
    assert host.reserve(6, 5)[1] == [4]  # then 0 before -2, LRU: 4 before 5
    assert host.reserve(7, 6)[1] == [5] and host.reserve(8, 7)[1] == [6] and host.reserve(9, 8)[1] == [7]
    assert 1 in host  # the urgent block outlives every priority-0 one
    plain = HostTier(2, 8)  # every priority 0: plain LRU
    plain.reserve(1, 0)
    plain.reserve(2, 1)
    plain.touch(1)
    assert plain.reserve(3, 2)[1] == [2] and set(plain.entries) == {1, 3}


def test_the_disk_tier_evicts_the_least_important_priority_first(tmp_path):
    from workers.engine.kv_disk import DiskTier

    disk = DiskTier(tmp_path, "layout", capacity_bytes=1, payload_bytes=8, block_size=2)
    disk.capacity_bytes = 3 * disk.file_bytes  # room for three files
    payload = bytes(8)
    try:
        for h, priority in ((1, -2), (2, 5), (3, 0)):
            assert disk.put(h, 0, [h, h], payload, priority)
        disk.flush()
        assert disk.put(2, 0, [2, 2], payload, 0)  # stored again by a more important request: now 0
        assert disk.put(4, 0, [4, 4], payload, 0)
        disk.flush()
        assert not disk.exists(3) and all(disk.exists(h) for h in (1, 2, 4))  # 3: priority 0, least recent
        assert disk.put(5, 0, [5, 5], payload, 7)
        assert disk.put(6, 0, [6, 6], payload, 0)
        disk.flush()
        assert not disk.exists(5) and disk.exists(1)  # 5 (priority 7) went before any 0 or -2
        assert disk.get(1, 0, [1, 1]) is not None
    finally:
        disk.close()
