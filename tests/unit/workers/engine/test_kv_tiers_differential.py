"""The KV tiers never return another block's KV: tier and no-tier greedy outputs compared.

Random prompt sets sharing prefixes at random depths, random host-tier sizes (down to one block, far
below the blocks one prefill step stores), chunked and whole prefills, a device pool small enough
that prefixes leave it, restarts on the same disk directory, two engines (targets) sharing one
directory, and faults injected into the directory between waves (truncated, flipped, deleted files,
and files copied under another block's name). Each scenario's outputs must equal an engine without
tiers on the same prompts. The scenarios also check the disk tier was read, so the comparison is not
passing on misses alone.

The bug this guards against (issue 53): one step storing more full blocks than the host tier has rows
reserved rows that the same loop evicted again, so a later block's bytes were written to disk under an
earlier block's hash, with a valid checksum.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime.kv_hash import block_hashes
from runtime.messages import SamplingParams
from tests.support.kv_faults import damage_block_file
from tests.support.tiny_models import tiny_hf_model
from workers.engine.engine import Engine, EngineConfig
from workers.engine.kv_disk import check_file, decode_block, encode_block
from workers.engine.kv_tiers import block_bytes, build_tiers
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

BS = 4
VOCAB = 256
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
SCENARIOS = 18  # x 20 prompts, each twice: 720 compared outputs
PROMPTS = 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tiers-diff")
    tiny_hf_model("llama", path, vocab=VOCAB)
    return load_model(path)


def _engine(model, chunk: int, host_blocks: int = 0, disk=None) -> Engine:
    e = Engine(model, EngineConfig(num_blocks=40, block_size=BS, max_num_batched_tokens=chunk),
               eos_token_ids=(0,))
    if host_blocks:
        e.attach_tiers(build_tiers(e, host_blocks * block_bytes(e), str(disk) if disk else None, 1 << 30, "tiny"))
    return e


def _waves(rng: random.Random) -> list[dict[str, list[int]]]:
    """``PROMPTS`` prompts in waves of 1-4 sent together; each is a random depth of one of three long
    roots (so prefixes are shared at every depth) plus a random tail (or none)."""
    roots = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(40, 64))] for _ in range(3)]
    waves, n = [], 0
    while n < PROMPTS:
        wave = {}
        for _ in range(min(rng.randrange(1, 5), PROMPTS - n)):
            root = rng.choice(roots)
            depth = rng.randrange(0, len(root) + 1)
            tail = [rng.randrange(1, VOCAB) for _ in range(rng.choice((0, 0, 3, 9)))]
            prompt = root[:depth] + tail
            wave[f"p{n}"] = prompt if len(prompt) >= 2 else root[:8]
            n += 1
        waves.append(wave)
    return waves


def _run(engine_for, waves, rng: random.Random, faults: bool, directory) -> list[list[int]]:
    outs = []
    for i, wave in enumerate(waves):
        e = engine_for(i)
        got = e.generate(wave, GREEDY)
        outs.extend(got[r] for r in wave)
        if e.tiers is not None and e.tiers.disk is not None:
            e.tiers.disk.flush()
        if faults and directory is not None and rng.random() < 0.5:
            damage_block_file(rng, directory)
    return outs


@pytest.mark.parametrize("seed", range(SCENARIOS))
def test_greedy_outputs_with_tiers_equal_outputs_without(model, tmp_path, seed):
    rng = random.Random(seed)
    chunk = rng.choice((8, 12, 512))  # chunked prefills, or whole ones
    host_blocks = rng.choice((1, 2, 3, 5, 8, 13))  # below one prefill step's blocks (up to 16)
    shape = ("one", "restart", "shared")[seed % 3]  # one engine; restarted midway; two engines, one directory
    faults = seed % 2 == 1
    waves = _waves(rng)
    base = _engine(model, chunk)
    want = [base.generate(wave, GREEDY)[r] for wave in waves for r in wave]

    made: list[Engine] = []

    def new() -> Engine:
        made.append(_engine(model, chunk, host_blocks, tmp_path))
        return made[-1]

    first = new()
    second = new() if shape == "shared" else None

    def engine_for(i: int) -> Engine:
        nonlocal first
        if shape == "restart" and i == len(waves) // 2:
            first.tiers.close()
            first = new()
        return second if second is not None and i % 2 else first

    got = _run(engine_for, waves, rng, faults, tmp_path)
    # the same prompts again on a fresh engine over the directory the first pass filled: most
    # prefixes now come from disk only
    reread = new()
    again = _run(lambda i: reread, waves, rng, faults, tmp_path)
    for e in made:
        e.tiers.close()
    assert got == want, f"scenario {seed}: chunk {chunk}, host {host_blocks} blocks, {shape}, faults {faults}"
    assert again == want, f"scenario {seed} (second pass from disk)"
    assert reread.tiers.stats["disk"].hits > 0  # the comparison covered blocks read back from disk
    assert all(check_file(p) for p in tmp_path.glob("*/*.kvb") if not faults)


def test_a_step_storing_more_blocks_than_the_host_tier_holds_writes_each_its_own_kv(model, tmp_path):
    """The direct check: one prefill stores 15 blocks into a 2-row host tier; every file written
    holds exactly the bytes of the device block computed for its hash."""
    e = _engine(model, 512, host_blocks=2, disk=tmp_path)
    rng = random.Random(7)
    prompt = [rng.randrange(1, VOCAB) for _ in range(61)]
    e.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    e.step()  # the prefill: 15 full blocks registered and stored in one step
    seq = e.seqs.get("p")
    table = list(seq.block_table) if seq is not None else None
    hashes = block_hashes(prompt, BS)
    expected = {}
    copier = e.tiers.copier
    for h in hashes:
        b = e.blocks.hash_to_block[h]
        expected[h] = torch.cat([view[b] for view in copier.views]).clone()
    assert table is None or len(table) >= len(hashes)
    e.tiers.disk.flush()
    parent = 0
    for i, h in enumerate(hashes):
        payload = e.tiers.disk.get(h, parent, prompt[i * BS : (i + 1) * BS])
        assert payload is not None, f"block {i} was not written"
        assert torch.equal(torch.frombuffer(payload, dtype=torch.uint8), expected[h]), f"block {i} holds other KV"
        parent = h
    while e.has_work():
        e.step()
    e.tiers.close()


def test_a_block_file_under_another_name_or_with_an_edited_key_is_refused(tmp_path):
    payload = bytes(range(256)) * 4
    data = bytearray(b"".join(encode_block(1234, 99, [1, 2, 3, 4], payload)))
    assert decode_block(bytes(data), 1234, 99, [1, 2, 3, 4], len(payload)) is not None
    # the header rewritten to name another block: the checksum covers the key, so it fails
    for offset in (8, 16):  # hash, parent (after magic, version, block size)
        edited = bytearray(data)
        edited[offset] ^= 0x01
        h, p = int.from_bytes(edited[8:16], "little"), int.from_bytes(edited[16:24], "little")
        assert decode_block(bytes(edited), h, p, [1, 2, 3, 4], len(payload)) is None
    good = tmp_path / f"{1234:016x}.kvb"
    good.write_bytes(bytes(data))
    assert check_file(good, len(payload))
    renamed = tmp_path / f"{4321:016x}.kvb"  # a valid file copied under another block's name
    renamed.write_bytes(bytes(data))
    assert not check_file(renamed, len(payload))


def test_cached_blocks_touched_between_reservations_never_share_a_row(model, tmp_path):
    """A step that stores new blocks between cached ones it touches: the touches can make the step's
    own reserved rows the least recently used. Every stored block still gets a row of its own, and
    every host row and disk file holds its own block's bytes."""
    e = _engine(model, 512, host_blocks=3, disk=tmp_path)
    tiers, copier = e.tiers, e.tiers.copier
    blocks = e.blocks.allocate(6)
    for b in blocks:  # each block's bytes: its own value everywhere
        for view in copier.views:
            view[b].fill_(b % 251 + 1)
    hashes = [1001 + i for i in range(6)]
    tokens = {h: [i + 1] * BS for i, h in enumerate(hashes)}

    def store(idx: list[int]) -> None:
        for i in idx:  # one block a call: each its own parent 0, so the files are easy to look up
            e.blocks.register([blocks[i]], [hashes[i]], 0)
            tiers.computed([blocks[i]], [hashes[i]], 0, tokens[hashes[i]])
        tiers._store_computed()

    store([0, 1, 2])  # the host tier is full: 1001, 1002, 1003
    # one step: a new block, two cached ones touched, two more new ones (the first one's row is
    # then the least recently used)
    for i in (3, 1, 2, 4, 5):
        if i in (3, 4, 5):
            e.blocks.register([blocks[i]], [hashes[i]], 0)
        tiers.computed([blocks[i]], [hashes[i]], 0, tokens[hashes[i]])
    tiers._store_computed()
    tiers.disk.flush()
    for h, (row, _) in tiers.host.entries.items():
        b = blocks[hashes.index(h)]
        assert torch.equal(tiers.host.slab[row], torch.cat([v[b] for v in copier.views])), f"host row of {h}"
    for i, h in enumerate(hashes):
        payload = tiers.disk.get(h, 0, tokens[h])
        assert payload is not None
        want = torch.cat([v[blocks[i]] for v in copier.views])
        assert torch.equal(torch.frombuffer(payload, dtype=torch.uint8), want), f"disk file of {h}"
    tiers.close()
