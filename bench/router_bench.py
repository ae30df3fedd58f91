"""Router benchmark: decision speed over a large index, and cache hits / TTFT on a multi-turn workload.

Usage: .venv/bin/python bench/router_bench.py [--decisions 20000] [--conversations 64] [--turns 6]
       [--skip-decisions] [--skip-workload]

1. Decisions: a KV router fed 16 workers x 50k indexed blocks (stored events of 512-token chains, a
   fifth of them held by 2-4 workers) routes prompts that share a random-length prefix with an indexed
   chain and end in new tokens. Each decision is ``select`` + ``release``, including hashing the
   prompt (the router hashes blocks only until no worker holds one); reported for prompts of 256,
   512 and 1024 tokens, in wall-clock time and in this thread's CPU time (on a shared machine the
   wall-clock tail is mostly other processes), with the time to hash the whole prompt beside it.
2. Workload: real etcd, NATS and 4 ``python -m workers.mock`` processes that sleep per uncached prompt
   token (``--prefill-ms-per-token``). Conversations share one of a few system prompts; each turn sends
   the whole history (system prompt, earlier user turns and answers) plus a new user message, and
   ``--concurrency`` conversations run at once. The same workload runs under ``kv``, ``round_robin``
   and ``random``, each on fresh workers (empty caches). Hit rate = cached prompt tokens / prompt
   tokens as the workers report them; the best possible hit rate is that of one cache of unlimited
   size that saw every earlier prompt (full blocks only, as the workers cache).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from router import create_router  # noqa: E402
from router.cost import KvRouterConfig  # noqa: E402
from router.kv_router import KvRouter  # noqa: E402
from runtime import Runtime, RuntimeConfig  # noqa: E402
from runtime.kv_hash import block_hashes  # noqa: E402
from runtime.messages import GenerateRequest, InstanceRecord, KvEvent, SamplingParams, TokenDelta  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, start_servers  # noqa: E402

BLOCK = 16
VOCAB = 32_000


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ---------------------------------------------------------------------------------------- decisions


def build_index(workers: int, blocks_per_worker: int, chain_tokens: int, rng: random.Random) -> tuple[KvRouter, list]:
    records = [InstanceRecord(f"worker-{i:02d}", "bench", "target", "generate", f"s{i}", model="m") for i in range(workers)]
    router = KvRouter(lambda model: records, KvRouterConfig(seed=0, request_dump=False))
    event_ids = [0] * workers
    held = [0] * workers
    chains = []
    while min(held) < blocks_per_worker:
        tokens = [rng.randrange(VOCAB) for _ in range(chain_tokens)]
        hashes = block_hashes(tokens, BLOCK)
        owners = rng.sample(range(workers), rng.randint(2, 4)) if rng.random() < 0.2 else [rng.randrange(workers)]
        for w in owners:
            if held[w] < blocks_per_worker:
                event_ids[w] += 1
                router.on_kv_event(KvEvent(records[w].instance_id, event_ids[w], "stored", hashes, None, BLOCK))
                held[w] += len(hashes)
        chains.append(tokens)
    return router, chains


async def measure_decisions(router: KvRouter, chains: list, length: int, n: int, rng: random.Random) -> dict:
    prompts = []
    for _ in range(n):
        chain = rng.choice(chains)
        cut = rng.randrange(min(length, len(chain)) // 4, min(length, len(chain)) + 1)
        prompts.append(chain[:cut] + [rng.randrange(VOCAB) for _ in range(length - cut)])
    for p in prompts[:500]:  # warm up
        router.release(await router.select("m", p))
    t = time.perf_counter()
    for p in prompts:
        block_hashes(p, BLOCK)
    hash_us = (time.perf_counter() - t) / n * 1e6
    latencies, cpu = [], []
    overlap = 0
    start, start_cpu = time.perf_counter(), time.thread_time()
    for p in prompts:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        selection = await router.select("m", p)
        router.release(selection)
        latencies.append(time.perf_counter_ns() - t0)
        cpu.append(time.thread_time_ns() - c0)
        overlap += selection.overlap_blocks
    elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    return {"length": length, "per_s": n / elapsed, "p50_us": pct(latencies, 0.5) / 1e3, "p99_us": pct(latencies, 0.99) / 1e3,
            "cpu_per_s": n / elapsed_cpu, "cpu_p99_us": pct(cpu, 0.99) / 1e3, "hash_us": hash_us, "mean_overlap": overlap / n}


async def decisions(args) -> list[dict]:
    rng = random.Random(1)
    t = time.perf_counter()
    router, chains = build_index(args.workers, args.blocks, 512, rng)
    print(f"index: {len(router.index)} distinct blocks, {sum(router.index.num_blocks(w) for w in router.index.workers())} "
          f"(worker, block) entries over {len(router.index.workers())} workers, built in {time.perf_counter() - t:.1f}s")
    return [await measure_decisions(router, chains, length, args.decisions, rng) for length in (256, 512, 1024)]


# ---------------------------------------------------------------------------------------- workload


def make_workload(args, rng: random.Random) -> list[dict]:
    systems = [[rng.randrange(VOCAB) for _ in range(args.system_tokens)] for _ in range(args.system_prompts)]
    return [{"system": rng.choice(systems),
             "users": [[rng.randrange(VOCAB) for _ in range(rng.randint(48, 160))] for _ in range(args.turns)]}
            for _ in range(args.conversations)]


def best_hit_rate(prompts: list[list[int]]) -> float:
    """Hit rate of one unlimited cache that saw every earlier prompt, in issue order."""
    seen: set[int] = set()
    cached = total = 0
    for p in prompts:
        hashes = block_hashes(p, BLOCK)
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        cached += n * BLOCK
        total += len(p)
        seen.update(hashes)
    return cached / total


async def run_mode(mode: str, args, etcd, nats_server, workload: list[dict]) -> dict:
    namespace = f"rb{uuid.uuid4().hex[:8]}"
    env = env_for(etcd, nats_server, namespace)
    procs = [ManagedProcess("workers.mock", ["--token-latency-ms", str(args.token_ms), "--prefill-latency-ms",
                                             str(args.prefill_ms_per_token), "--num-speculative-tokens", "0",
                                             "--num-blocks", str(args.worker_blocks), "--stats-interval", "0.2"],
                            env, f"mock-{mode}-{i}").start() for i in range(args.bench_workers)]
    cfg = RuntimeConfig(etcd_url=etcd.url, nats_url=nats_server.url, namespace=namespace, handle_signals=False)
    try:
        async with Runtime.connect(cfg) as rt:
            client = await rt.client("target", "generate")
            await client.wait_for_instances(args.bench_workers, timeout=60)
            options = {"overlap_weight": args.overlap_weight} if mode == "kv" else {}
            router = await create_router(rt, mode, seed=7, **options)
            issued: list[list[int]] = []
            per_worker: dict[str, int] = {}
            ttfts: list[float] = []
            cached = prompt_tokens = 0

            async def conversation(conv: dict) -> None:
                nonlocal cached, prompt_tokens
                history = list(conv["system"])
                for user in conv["users"]:
                    history += user
                    prompt = list(history)
                    issued.append(prompt)
                    t0 = time.perf_counter()
                    selection = await router.select("mock", prompt)
                    per_worker[selection.instance_id] = per_worker.get(selection.instance_id, 0) + 1
                    answer: list[int] = []
                    try:
                        request = GenerateRequest(prompt, SamplingParams(temperature=0, max_tokens=args.answer_tokens))
                        async with await client.call(selection.instance_id, request, TokenDelta) as stream:
                            async for delta in stream:
                                if not answer:
                                    ttfts.append(time.perf_counter() - t0)
                                answer += delta.token_ids
                                if delta.usage is not None:
                                    cached += delta.usage.cached_tokens
                                    prompt_tokens += delta.usage.prompt_tokens
                    finally:
                        router.release(selection)
                    history += answer

            queue = list(workload)

            async def runner() -> None:
                while queue:
                    await conversation(queue.pop(0))

            start = time.perf_counter()
            await asyncio.gather(*(runner() for _ in range(args.concurrency)))
            elapsed = time.perf_counter() - start
            await router.stop()
            return {"mode": mode, "hit_rate": cached / prompt_tokens, "mean_ttft_ms": statistics.mean(ttfts) * 1e3,
                    "p99_ttft_ms": pct(ttfts, 0.99) * 1e3, "requests": len(ttfts), "elapsed_s": elapsed,
                    "best_hit_rate": best_hit_rate(issued), "max_share": max(per_worker.values()) / len(ttfts)}
    finally:
        for p in procs:
            p.stop(timeout=10)


async def workload_runs(args) -> list[dict]:
    rng = random.Random(2)
    workload = make_workload(args, rng)
    etcd, nats_server = start_servers()
    try:
        return [await run_mode(mode, args, etcd, nats_server, workload) for mode in ("kv", "round_robin", "random")]
    finally:
        etcd.cleanup()
        nats_server.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=20_000, help="decisions per prompt length")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=50_000, help="indexed blocks per worker")
    parser.add_argument("--bench-workers", type=int, default=4, help="mock worker processes in the workload")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--token-ms", type=float, default=2.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.1, help="mock prefill cost per uncached token")
    parser.add_argument("--worker-blocks", type=int, default=4096)
    parser.add_argument("--overlap-weight", type=float, default=KvRouterConfig.overlap_weight)
    parser.add_argument("--skip-decisions", action="store_true")
    parser.add_argument("--skip-workload", action="store_true")
    args = parser.parse_args()

    import uvloop

    if not args.skip_decisions:
        rows = uvloop.run(decisions(args))
        print(f"\ndecisions ({args.workers} workers x {args.blocks} blocks, {args.decisions} per length, select + release):")
        print("| prompt tokens | decisions/s (wall) | p50 (wall) | p99 (wall) | decisions/s (CPU) | p99 (CPU) "
              "| hashing the whole prompt | mean overlap |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['length']} | {r['per_s']:,.0f} | {r['p50_us']:.0f} µs | {r['p99_us']:.0f} µs | {r['cpu_per_s']:,.0f} "
                  f"| {r['cpu_p99_us']:.0f} µs | {r['hash_us']:.0f} µs | {r['mean_overlap']:.1f} blocks |")
    if not args.skip_workload:
        rows = uvloop.run(workload_runs(args))
        best = rows[0]["best_hit_rate"]
        print(f"\nworkload ({args.conversations} conversations x {args.turns} turns, {args.concurrency} at once, "
              f"{args.bench_workers} mock workers, {args.prefill_ms_per_token} ms per uncached token):")
        print("| mode | hit rate | of best | mean TTFT | p99 TTFT | busiest worker's share | requests | wall |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['mode']} | {r['hit_rate']:.3f} | {r['hit_rate'] / best:.1%} | {r['mean_ttft_ms']:.1f} ms "
                  f"| {r['p99_ttft_ms']:.1f} ms | {r['max_share']:.0%} | {r['requests']} | {r['elapsed_s']:.1f} s |")
        print(f"| best possible (one unlimited cache) | {best:.3f} | 100% | | | | | |")


if __name__ == "__main__":
    main()
