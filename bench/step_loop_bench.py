"""How long a target step spends outside the engine step: proposal wait, thread hops, delivery.

Usage: .venv/bin/python bench/step_loop_bench.py [--repeats 5] [--tokens 64] [--seam sync|pipelined|none]

A target engine loop (the one the target worker runs) on a tiny random Llama (so that the engine
step is short and the loop's own cost shows), speculating with a real n-gram draft service on
gRPC in a child process. For batch 1 and 8 (greedy, ``--tokens`` tokens each, repetitive prompts
so that the n-gram draft proposes), it measures wall time from submitting the requests to the
last token, and the time spent inside ``Engine.step``; the difference divided by the number
of steps is the loop's overhead per step. The best of ``--repeats`` runs is reported. ``--seam``: the
draft seam the loop asks for (``sync``, the default, or ``pipelined``), or ``none``: no draft at all,
the plain loop to compare against.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def serve_draft() -> None:
    """Child mode: an n-gram DraftService on a free loopback port; prints the port."""
    from bench.loopback_draft import serve_on_loopback
    from workers.draft.ngram import NgramProposer

    await serve_on_loopback(NgramProposer(1, 3), "bench-draft")


def tiny_engine():
    import torch

    from bench.common import random_decoder
    from workers.engine.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    return Engine(random_decoder(256, 512), EngineConfig(num_blocks=512, block_size=16), eos_token_ids=(),
                  num_speculative_tokens=4)


async def measure(port: int | None, batches: list[int], tokens: int, repeats: int, seam: str = "sync") -> dict:
    from runtime.messages import InstanceRecord, SamplingParams
    from workers.target.draft_pool import DraftPool
    from workers.target.step_loop import StepLoop

    engine = tiny_engine()
    inside = [0.0]
    step = engine.step

    def timed_step(*args, **kwargs):
        started = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - started

    engine.step = timed_step
    pool = None
    if seam != "none":
        record = InstanceRecord("bench-draft", "bench", "draft", "speculate", "", role="draft",
                                grpc_address=f"127.0.0.1:{port}")
        pool = DraftPool("bench-target", "", engine.vocab_size, lambda: [record], pipelined=seam == "pipelined")
    loop = StepLoop(engine, pool, "bench-target", propose_timeout=2.0)
    loop.start()
    deadline = time.monotonic() + 30
    while pool is not None and await pool.poll() is None:
        assert time.monotonic() < deadline, "no draft stream"
        await asyncio.sleep(0.05)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    results = {}
    run = 0
    for batch in batches:
        best = None
        for _ in range(repeats + 1):  # the first run warms up
            run += 1
            queues = [loop.submit(f"r{run}-{i}", [1, 2, 3, 4, 5] * 4 + [i], params) for i in range(batch)]
            inside[0], steps0 = 0.0, loop.steps
            started = time.perf_counter()
            for q in queues:
                while (await q.get()).finish_reason is None:
                    pass
            wall = time.perf_counter() - started
            steps = loop.steps - steps0
            row = {"batch": batch, "steps": steps, "wall_ms_per_step": 1e3 * wall / steps,
                   "engine_ms_per_step": 1e3 * inside[0] / steps,
                   "outside_ms_per_step": 1e3 * (wall - inside[0]) / steps}
            if _ > 0 and (best is None or row["outside_ms_per_step"] < best["outside_ms_per_step"]):
                best = row
        results[batch] = best
        print(best, flush=True)
    await loop.stop()
    if pool is not None:
        await pool.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seam", choices=["sync", "pipelined", "none"], default="sync")
    ap.add_argument("--serve-draft", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_draft:
        asyncio.run(serve_draft())
        return
    child = subprocess.Popen([sys.executable, __file__, "--serve-draft"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        results = asyncio.run(measure(port, [1, 8], args.tokens, args.repeats, args.seam))
    finally:
        child.kill()
    print("| batch | steps | wall ms/step | engine step ms | outside the engine step ms |")
    print("|---|---|---|---|---|")
    for row in results.values():
        print(f"| {row['batch']} | {row['steps']} | {row['wall_ms_per_step']:.2f} | {row['engine_ms_per_step']:.2f} "
              f"| {row['outside_ms_per_step']:.2f} |")


if __name__ == "__main__":
    main()
