"""KV tiers with real target worker processes, real files, real etcd and NATS (a tiny model).

Two targets share one disk directory: a conversation's first turn on one, its second turn on the
other, which loads the prefix from disk instead of recomputing it (usage says cached, the metrics
say disk hits), with the greedy tokens of a target without tiers. The tier moves arrive as KV
events. Then the faults: a truncated and a corrupted block file are misses (recomputed, same
tokens, counted); a worker SIGKILLed while it writes blocks leaves no file that fails its check; a
worker whose disk fills (its file-size limit) turns the disk tier off with one log line and a
metric, and keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.binaries import free_port
from runtime.events import TOPIC_KV
from runtime.kv_hash import block_hashes
from runtime.messages import GenerateRequest, KvEvent, SamplingParams, TokenDelta
from runtime.request_plane import collect
from tests.support.procs import ManagedProcess, importable_env
from tests.support.tiny_models import tiny_hf_model
from tests.support.wait import eventually
from tests.support.flags import kv_offload
from workers.engine.engine import Engine, EngineConfig
from workers.engine.kv_disk import TEMP_PREFIX, check_file
from workers.engine.weights import load_model

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiers-target")
    tiny_hf_model("llama", path, seed=5, vocab=256, layers=2, max_positions=1024)
    return path


def expected(target_dir, prompt: list[int], block_size: int = 8) -> list[int]:
    engine = Engine(load_model(target_dir), EngineConfig(block_size=block_size, num_blocks=512))
    return engine.generate({"x": prompt}, GREEDY)["x"]


def worker_args(target_dir, disk: Path, port: int, block_size: int = 8) -> list[str]:
    return ["--model", str(target_dir), "--served-model-name", "tiny", "--block-size", str(block_size),
            "--num-blocks", "40" if block_size == 8 else "16", "--max-model-len", "256" if block_size == 8 else "1024", "--threads", "1", "--num-speculative-tokens", "0",
            *kv_offload(host_gb=0.002, disk_dir=str(disk)), "--lease-ttl", "3",
            "--health-port", str(port)]


async def metric(port: int, name: str, **labels) -> float:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def generate(client, instance_id: str, prompt: list[int]) -> tuple[list[int], int]:
    out = await collect(await client.call(instance_id, GenerateRequest(prompt, GREEDY), TokenDelta))
    return [t for d in out for t in d.token_ids], out[-1].usage.cached_tokens


async def wait_for_files(directory: Path, at_least: int, timeout: float = 30.0) -> set[Path]:
    def written() -> set[Path]:
        files = set(directory.rglob("*.kvb"))
        return files if len(files) >= at_least else set()

    return await eventually(written, timeout=timeout, interval=0.1, what=lambda: (
        f"{at_least} block files written (found {len(list(directory.rglob('*.kvb')))})"))


async def two_targets_on_one_disk(rt, spawn, target_dir, disk: Path):
    """Two target workers sharing the disk tier ``disk``, started one after the other: (the first's
    process, both health ports, a client, the first's record, the second's)."""
    ports = free_port(), free_port()
    first = spawn("workers.target", *worker_args(target_dir, disk, ports[0]), name="target-a")
    client = await rt.client("target", "generate")
    [a] = await client.wait_for_instances(1, timeout=120)
    spawn("workers.target", *worker_args(target_dir, disk, ports[1]), name="target-b")
    b = next(i for i in await client.wait_for_instances(2, timeout=120) if i.instance_id != a.instance_id)
    return first, ports, client, a, b


async def test_a_second_turn_on_the_other_target_loads_its_prefix_from_the_shared_disk(rt, spawn, target_dir,
                                                                                        tmp_path):
    events: list[KvEvent] = []
    await rt.subscribe(TOPIC_KV, KvEvent, events.append)
    disk = tmp_path / "shared"
    _, ports, client, a, b = await two_targets_on_one_disk(rt, spawn, target_dir, disk)

    rng = random.Random(1)
    turn1 = [rng.randrange(1, 256) for _ in range(60)]
    out1, _ = await generate(client, a.instance_id, turn1)
    assert out1 == expected(target_dir, turn1)
    await wait_for_files(disk, (60 + 11) // 8)  # the computed blocks: the prompt and all but the last token
    turn2 = turn1 + out1 + [rng.randrange(1, 256) for _ in range(9)]
    out2, cached = await generate(client, b.instance_id, turn2)
    assert out2 == expected(target_dir, turn2)
    assert cached >= 64  # its first 8 blocks (turn 1's prompt and reply) came from disk, not recomputed
    assert await metric(ports[1], "tandem_target_kv_tier_hits_total", tier="disk") >= 8
    assert await metric(ports[1], "tandem_target_kv_tier_load_seconds_count", tier="disk") >= 1
    want = {(a.instance_id, "disk"), (a.instance_id, "host"), (b.instance_id, "host")}
    await eventually(lambda: want <= {(e.worker_id, e.tier) for e in events}, timeout=15, interval=0.1,
                     what=lambda: f"the tier moves as KV events (seen: {({(e.worker_id, e.tier) for e in events})})")

    # a corrupted block file of another conversation (one bit of its payload): a miss, recomputed, counted
    other = [rng.randrange(1, 256) for _ in range(60)]
    out, _ = await generate(client, a.instance_id, other)
    name = f"{block_hashes(other, 8)[0]:016x}.kvb"  # files are named by the chained hash the router uses
    [first, *_] = await eventually(lambda: list(disk.rglob(name)), timeout=30, interval=0.1,
                                   what="the conversation's first block written")
    data = bytearray(first.read_bytes())
    data[-5] ^= 0x01
    first.write_bytes(bytes(data))
    hits = await metric(ports[1], "tandem_target_kv_tier_hits_total", tier="disk")
    again = other + out + [7, 8, 9]
    out_b, cached = await generate(client, b.instance_id, again)
    assert out_b == expected(target_dir, again)
    assert cached == 0 and await metric(ports[1], "tandem_target_kv_tier_hits_total", tier="disk") == hits
    assert await metric(ports[1], "tandem_target_kv_tier_bad_blocks_total", reason="corrupt") == 1


async def test_a_session_whose_worker_died_finds_its_prefix_on_the_survivors_disk(rt, spawn, target_dir, tmp_path):
    """Issue 58's sessions: the worker a session was on is SIGKILLed after a turn; the next turn, on
    the other target, loads the turn's prefix from the shared disk tier instead of recomputing it."""
    disk = tmp_path / "shared"
    home, ports, client, a, b = await two_targets_on_one_disk(rt, spawn, target_dir, disk)

    rng = random.Random(2)
    turn1 = [rng.randrange(1, 256) for _ in range(60)]
    out1, _ = await generate(client, a.instance_id, turn1)
    await wait_for_files(disk, (60 + 11) // 8)
    home.kill()
    await eventually(lambda: a.instance_id not in {i.instance_id for i in client.instances()}, timeout=30,
                     interval=0.1, what="the dead worker's record gone")
    turn2 = turn1 + out1 + [rng.randrange(1, 256) for _ in range(9)]
    out2, cached = await generate(client, b.instance_id, turn2)
    assert out2 == expected(target_dir, turn2)
    assert cached >= 64  # turn 1's prompt and reply: from the dead worker's disk blocks
    assert await metric(ports[1], "tandem_target_kv_tier_hits_total", tier="disk") >= 8


class LimitedProcess(ManagedProcess):
    """A managed process whose files may not grow past ``fsize`` bytes (RLIMIT_FSIZE: writes past it
    fail with EFBIG, as on a full disk; Python ignores SIGXFSZ)."""

    def __init__(self, *args, fsize: int, **kw):
        super().__init__(*args, **kw)
        self.fsize = fsize

    def start(self) -> LimitedProcess:
        log = open(self.log_path, "ab")
        fsize = self.fsize

        def limit():
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], stdout=log,
                                     stderr=subprocess.STDOUT, env=importable_env(self.env),
                                     cwd=Path(__file__).resolve().parents[2], start_new_session=True,
                                     preexec_fn=limit)
        return self


async def test_a_full_disk_turns_the_tier_off_once_and_the_worker_keeps_serving(rt, child_env, target_dir, tmp_path):
    port = free_port()
    # blocks of 128 tokens: a block file (~96 KiB) is past the 64 KiB limit, the worker's log is not
    proc = LimitedProcess("workers.target", worker_args(target_dir, tmp_path / "full", port, block_size=128),
                          child_env, "target-full", fsize=64 << 10).start()
    try:
        client = await rt.client("target", "generate")
        [inst] = await client.wait_for_instances(1, timeout=120)
        rng = random.Random(2)
        for _ in range(2):
            prompt = [rng.randrange(1, 256) for _ in range(300)]
            out, _ = await generate(client, inst.instance_id, prompt)
            assert out == expected(target_dir, prompt, 128)
        async def tier_off() -> bool:
            return await metric(port, "tandem_target_kv_tier_disabled", tier="disk") == 1

        await eventually(tier_off, timeout=20, interval=0.2, what=lambda: f"the disk tier off:\n{proc.logs()[-3000:]}")
        assert proc.logs().count("turning the disk tier off") == 1
        assert not list((tmp_path / "full").rglob("*.kvb")) and not list((tmp_path / "full").rglob(f"{TEMP_PREFIX}*"))
    finally:
        proc.stop(timeout=10)


async def test_a_worker_killed_while_writing_leaves_no_block_that_fails_its_check(rt, spawn, target_dir, tmp_path):
    disk = tmp_path / "killed"
    port = free_port()
    proc = spawn("workers.target", *worker_args(target_dir, disk, port), name="target-killed")
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=120)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 256) for _ in range(200)] for _ in range(6)]
    caught = asyncio.Event()

    def watch() -> None:  # SIGKILL the worker the moment a block is being written
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.alive():
            for path in disk.rglob(f"{TEMP_PREFIX}*"):
                proc.kill()
                caught.set()
                return
        proc.kill()

    watcher = asyncio.get_running_loop().run_in_executor(None, watch)
    requests = [asyncio.ensure_future(generate(client, inst.instance_id, p)) for p in prompts]
    await watcher
    await asyncio.gather(*requests, return_exceptions=True)
    assert not proc.alive()
    assert caught.is_set(), "no block write was seen in progress (writes must go through a temporary file)"
    files = list(disk.rglob("*.kvb"))
    assert all(check_file(path) for path in files)  # every file under a block's name is whole
    logging.getLogger("tests").info("killed during a block write; %d block files left", len(files))
    # a fresh worker on the same directory serves the same prompts with the right tokens
    spawn("workers.target", *worker_args(target_dir, disk, free_port()), name="target-after")
    fresh = await eventually(lambda: [i for i in client.instances() if i.instance_id != inst.instance_id],
                             timeout=120, interval=0.5, what="the second worker registered")
    for p in prompts[:3]:
        out, _ = await generate(client, fresh[0].instance_id, p)
        assert out == expected(target_dir, p)
