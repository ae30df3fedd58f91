"""Tensor parallelism on this machine: memory per rank and step time at TP = 1 and TP = 2.

Usage: .venv/bin/python bench/tp_bench.py [--model PATH] [--sizes 1,2] [--batches 1,8] [--steps 40] [--repeats 2]

Each size runs in a fresh child process (rank 0; its followers are its own children), so every
process's peak RSS (VmHWM) is its own. Per rank it reports the bytes of its weight shard, its peak
and final RSS, and a baseline: the RSS of the same process after importing torch and the engine,
before loading anything (what every rank pays whatever its shard). Times, per batch size B (B
sequences with 64-token prompts, each decoding): the median of ``--steps`` plain decode steps
(``Engine.step``) and of as many verify-shaped forward passes (5 new tokens per sequence, as a
γ = 4 chain verification runs). TP = 1 runs with ``--threads`` torch threads, TP = N with
``--threads``/N per rank, so both use the same cores. Sizes alternate ``--repeats`` times and the
best run of each is kept (the machine may be shared). Last, the latency of one gloo all-reduce
between two processes, of a decode step's and a verify step's rows: the collective's cost per step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.openmp import configure_waiting  # noqa: E402

configure_waiting(spin=True)  # before torch loads, as the target worker does (its followers inherit it)


def status_kb(pid: int | str, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def shard_bytes(model_dir: str, rank: int, size: int, itemsize: int = 4) -> int:
    """Bytes of rank ``rank``'s weights (built on the meta device: nothing is loaded)."""
    import torch

    from workers.engine.config import ModelConfig
    from workers.engine.model import DecoderModel
    from workers.engine.parallel import TensorParallel

    cfg = ModelConfig.from_dir(model_dir)
    tp = TensorParallel(rank, size, group=object() if size > 1 else None)
    with torch.device("meta"):
        model = DecoderModel(cfg, 16, tp=tp)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) * itemsize


def child(args) -> dict:
    import torch

    from runtime.messages import SamplingParams
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.followers import load_sharded
    from workers.engine.weights import load_model

    threads = max(1, args.threads // args.size)
    torch.set_num_threads(threads)
    baseline = status_kb("self", "VmRSS")
    started = time.perf_counter()
    followers = None
    if args.size == 1:
        model = load_model(args.model)
    else:
        model, followers = load_sharded(args.model, args.size, threads=threads)
    load_s = time.perf_counter() - started
    cfg = EngineConfig(block_size=16, num_blocks=256, max_num_seqs=max(args.batches), max_num_batched_tokens=1024)
    engine = Engine(model, cfg, followers=followers)
    rng = random.Random(0)
    out = {"size": args.size, "threads_per_rank": threads, "load_s": load_s,
           "baseline_kb": baseline, "steps": {}}
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for batch in args.batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(3, model.cfg.vocab_size) for _ in range(64)], params)
        while any(engine.seqs[r].num_generated == 0 for r in ids):  # prefill
            engine.step()
        for _ in range(3):
            engine.step()
        decode = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            decode.append(time.perf_counter() - t)
        seqs = [engine.seqs[r] for r in ids]
        chunks = [(s.token_ids[-5:], len(s) - 5, s.block_table) for s in seqs]
        verify = []
        for _ in range(args.steps):  # rewrites the last 5 positions' KV with the same values
            t = time.perf_counter()
            engine.runner.forward(chunks, [5] * batch)
            verify.append(time.perf_counter() - t)
        for rid in ids:
            engine.abort(rid)
        out["steps"][str(batch)] = {"decode_ms": 1000 * statistics.median(decode),
                                    "verify5_ms": 1000 * statistics.median(verify)}
    ranks = [{"rank": 0, "hwm_kb": status_kb("self", "VmHWM"), "rss_kb": status_kb("self", "VmRSS")}]
    if followers is not None:
        for r, proc in enumerate(followers.procs, start=1):
            ranks.append({"rank": r, "hwm_kb": status_kb(proc.pid, "VmHWM"), "rss_kb": status_kb(proc.pid, "VmRSS")})
        followers.close()
    out["ranks"] = ranks
    return out


def collective_us(rank: int, port: int, hidden: int, rows: tuple[int, ...], calls: int = 300) -> dict:
    """Median µs of one gloo all-reduce of [rows, hidden] float32 between two processes on this host
    (rank 0 serves the store and starts rank 1): what each of a forward's 2·L + 2 collectives costs."""
    import datetime

    import torch
    import torch.distributed as dist

    from workers.engine.parallel import TensorParallel

    torch.set_num_threads(1)
    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        peer = subprocess.Popen([sys.executable, __file__, "--collective-rank", "1", "--collective-port",
                                 str(store.port), "--collective-hidden", str(hidden)], cwd=ROOT)
        port = store.port
    tp = TensorParallel.connect(rank, 2, "127.0.0.1", port, "gloo", 60.0, store=store)
    out = {}
    for n in rows:
        x = torch.randn(n, hidden)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            tp.all_reduce(x)
            times.append(time.perf_counter() - t)
        out[str(n)] = 1e6 * statistics.median(times)
    if rank == 0:
        peer.wait(60)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the demo SmolLM2-135M)")
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (divided among the ranks)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child-size", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--collective-rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--collective-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--collective-hidden", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collective_rank == 1:
        collective_us(1, args.collective_port, args.collective_hidden, (1, 8, 40))
        return
    if args.model is None:
        from workers.demo_model import demo_model_dir

        args.model = str(demo_model_dir())
    batches = [int(x) for x in args.batches.split(",")]
    if args.child_size:
        args.size, args.batches = args.child_size, batches
        print(json.dumps(child(args)))
        return
    best: dict[int, dict] = {}
    for _ in range(args.repeats):
        for size in (int(x) for x in args.sizes.split(",")):
            cmd = [sys.executable, __file__, "--model", args.model, "--batches", args.batches, "--steps",
                   str(args.steps), "--threads", str(args.threads), "--child-size", str(size)]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                                            env=dict(os.environ, TANDEM_LOG_LEVEL="WARNING")).stdout.splitlines()[-1])
            prev = best.get(size)
            if prev is None:
                best[size] = res
            else:  # the fastest of each measurement; memory is the same every run
                for b, times in res["steps"].items():
                    for k, v in times.items():
                        prev["steps"][b][k] = min(prev["steps"][b][k], v)
    from workers.engine.config import ModelConfig

    cfg = ModelConfig.from_dir(args.model)
    allreduce = collective_us(0, 0, cfg.hidden_size, (1, 8, 40))
    mb = 1 / 1024
    print(f"model {args.model}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    print("\n| TP | rank | threads | weight shard MB | peak RSS MB | RSS after MB | baseline RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for size, res in sorted(best.items()):
        for r in res["ranks"]:
            shard = f"{shard_bytes(args.model, r['rank'], size) / 2**20:.0f}"
            print(f"| {size} | {r['rank']} | {res['threads_per_rank']} | {shard} | {r['hwm_kb'] * mb:.0f} | "
                  f"{r['rss_kb'] * mb:.0f} | {res['baseline_kb'] * mb:.0f} |")
    print("\n| TP | batch | decode step ms | verify (5 tokens/seq) ms |")
    print("|---|---|---|---|")
    for size, res in sorted(best.items()):
        for b, t in res["steps"].items():
            print(f"| {size} | {b} | {t['decode_ms']:.1f} | {t['verify5_ms']:.1f} |")
    print(f"\ngloo all-reduce of [rows, {cfg.hidden_size}] float32 between 2 processes, median µs: "
          + ", ".join(f"{n} rows {us:.0f}" for n, us in allreduce.items())
          + f"; a forward runs {2 * cfg.num_layers + 1} all-reduces and 1 all-gather")
    print("\n" + json.dumps({"runs": best, "allreduce_us": allreduce}))


if __name__ == "__main__":
    main()
