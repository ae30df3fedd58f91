"""High- against low-priority TTFT under contention, with the router queue and engine priority each on and off.

Usage: .venv/bin/python bench/priority_bench.py [--requests 96] [--rate 40] [--high-share 0.25]

Real etcd and nats-server on loopback, two mock workers that run at most ``--max-num-seqs`` requests
each (``--token-latency-ms`` a token, ``--max-tokens`` tokens a request: with the defaults the two
serve about 25 requests a second) and one ``python -m frontend --router-mode kv``. ``--requests``
streaming completions arrive at ``--rate`` a second (open loop, above what the workers admit, so a
queue builds); a seeded ``--high-share`` of them carry ``nvext.agent_hints.priority`` 10 (Dynamo's
polarity: sooner), the rest nothing. Four runs: neither layer (the baseline, today's behaviour),
the engine alone (``--scheduling-policy priority`` on the workers), the router queue alone
(``--router-queue-threshold 1.0``, policy fcfs: priority moves a request's arrival 10 s earlier),
both. Reported per run: TTFT p50/p90 of each class, their ratio, and the low class's worst TTFT (no
request starves: every one must finish with 200).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import wait_for_instances  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, free_port, running_servers  # noqa: E402

RUNS = (("baseline", False, False), ("engine", False, True), ("router queue", True, False), ("both", True, True))


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one(http: httpx.AsyncClient, i: int, high: bool, max_tokens: int) -> tuple[bool, float, int]:
    body = {"model": "mock", "prompt": f"request {i} " * 8, "max_tokens": max_tokens, "stream": True,
            "temperature": 0}
    if high:
        body["nvext"] = {"agent_hints": {"priority": 10}}
    start = time.perf_counter()
    ttft = None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                ttft = time.perf_counter() - start
        status = resp.status_code
    return high, ttft if ttft is not None else float("nan"), status


async def run(name: str, queue: bool, engine: bool, args, etcd, nats_server) -> dict:
    env = env_for(etcd, nats_server, f"prio-{name.replace(' ', '-')}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    policy = ["--scheduling-policy", "priority"] if engine else []
    workers = [ManagedProcess("workers.mock", ["--token-latency-ms", str(args.token_latency_ms), "--num-speculative-tokens",
                                               "0", "--max-num-seqs", str(args.max_num_seqs), "--stats-interval", "0.2",
                                               *policy], env, f"mock{i}").start()
               for i in range(args.workers)]
    flags = ["--router-queue-threshold", "1.0"] if queue else []
    frontend = ManagedProcess("frontend", ["--http-port", str(port), "--router-mode", "kv", *flags], env,
                              "frontend").start()
    try:
        frontend.wait_for_log("frontend ready", timeout=60)
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            await wait_for_instances(http, "mock", args.workers, timeout=60, interval=0.1)
            await http.post("/v1/completions", json={"model": "mock", "prompt": "warm", "max_tokens": 1})
            await asyncio.sleep(1.0)  # load events with the workers' capacity reach the router
            rng = random.Random(args.seed)
            classes = [rng.random() < args.high_share for _ in range(args.requests)]
            tasks = []
            for i, high in enumerate(classes):
                tasks.append(asyncio.create_task(one(http, i, high, args.max_tokens)))
                await asyncio.sleep(1 / args.rate)
            results = await asyncio.gather(*tasks)
        high = [t for h, t, _ in results if h]
        low = [t for h, t, _ in results if not h]
        statuses = sorted({s for _, _, s in results})
        return {"name": name, "statuses": statuses, "n_high": len(high), "n_low": len(low),
                "high_p50": percentile(high, 0.5), "high_p90": percentile(high, 0.9),
                "low_p50": percentile(low, 0.5), "low_p90": percentile(low, 0.9), "low_max": max(low),
                "mean": statistics.fmean(high + low)}
    finally:
        frontend.stop(timeout=10)
        for w in workers:
            w.stop(timeout=10)


async def amain(args) -> None:
    with running_servers() as (etcd, nats_server):
        print(f"{args.requests} streaming completions at {args.rate}/s, {args.high_share:.0%} high priority; "
              f"{args.workers} mock workers x {args.max_num_seqs} slots, {args.token_latency_ms} ms/token, "
              f"{args.max_tokens} tokens each", flush=True)
        print("| run | high TTFT p50 / p90 (ms) | low TTFT p50 / p90 (ms) | p50 ratio | p90 ratio | low worst (ms) "
              "| statuses |")
        print("|---|---|---|---|---|---|---|")
        for name, queue, engine in RUNS:
            if args.only and name not in args.only:
                continue
            r = await run(name, queue, engine, args, etcd, nats_server)
            print(f"| {r['name']} | {r['high_p50'] * 1000:.0f} / {r['high_p90'] * 1000:.0f} | "
                  f"{r['low_p50'] * 1000:.0f} / {r['low_p90'] * 1000:.0f} | {r['low_p50'] / r['high_p50']:.1f}x | "
                  f"{r['low_p90'] / r['high_p90']:.1f}x | {r['low_max'] * 1000:.0f} | {r['statuses']} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rate", type=float, default=40.0, help="arrivals per second")
    parser.add_argument("--high-share", type=float, default=0.25)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=2)
    parser.add_argument("--token-latency-ms", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None, help="run only these (baseline, engine, 'router queue', both)")
    asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    main()
