"""How long a SIGKILLed worker keeps being routed to: the time from the kill to the last request sent to it.

Usage: .venv/bin/python bench/failover_bench.py [--workers 3] [--clients 8] [--router-mode kv round_robin]

Real etcd and nats-server on loopback, ``--workers`` mock workers (5 ms a token, etcd lease 10 s, so
the dead one stays registered for up to 10 s), one ``python -m frontend``. ``--clients`` clients send
short completions back to back; after ``--before`` seconds one worker is killed with SIGKILL and the
load goes on for ``--after`` seconds. A request routed to the dead worker after the kill gets "no
responders" from NATS and the frontend logs its migration; the last such line, against the kill time,
is the figure (target < 1 s). Requests the worker was serving when it died are reported apart: they
move when a probe of their silent stream finds nobody (or, failing that, when it stalls, 5 s). All
requests must get 200.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, free_port, running_servers  # noqa: E402

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def stamped(log: str, needle: str) -> list[float]:
    """Epoch seconds of the log lines that contain ``needle``."""
    times = []
    for line in log.splitlines():
        match = STAMP.match(line)
        if match and needle in line:
            times.append(datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return times


async def client(url: str, stop: asyncio.Event, statuses: Counter) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        i = 0
        while not stop.is_set():
            resp = await http.post("/v1/completions", json={"model": "mock", "prompt": f"request {i}", "max_tokens": 4})
            statuses[resp.status_code] += 1
            i += 1


def wait_instances(url: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            models = {m["id"]: m["instances"] for m in httpx.get(url + "/v1/models", timeout=2).json()["data"]}
            if models.get("mock", 0) >= count:
                httpx.post(url + "/v1/completions", json={"model": "mock", "prompt": "warm", "max_tokens": 1}, timeout=60)
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the frontend never saw {count} workers")


async def run(mode: str, args, etcd, nats_server) -> dict:
    env = env_for(etcd, nats_server, f"failover-{mode.replace('_', '-')}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    workers = [ManagedProcess("workers.mock", ["--token-latency-ms", "5", "--num-speculative-tokens", "0",
                                               "--lease-ttl", "10"], env, f"mock{i}").start()
               for i in range(args.workers)]
    frontend = ManagedProcess("frontend", ["--http-port", str(port), "--router-mode", mode], env, "frontend").start()
    try:
        frontend.wait_for_log("frontend ready", timeout=60)
        wait_instances(url, args.workers)
        victim = workers[0]
        victim.wait_for_log("ready: model", timeout=10)
        victim_id = re.search(r"mock worker (\w+) ready", victim.logs()).group(1)
        stop, statuses = asyncio.Event(), Counter()
        tasks = [asyncio.create_task(client(url, stop, statuses)) for _ in range(args.clients)]
        await asyncio.sleep(args.before)
        before = sum(statuses.values())
        killed_at = time.time()
        victim.kill()
        await asyncio.sleep(args.after)
        stop.set()
        await asyncio.gather(*tasks)
        log = frontend.logs()
        gone = f"worker {victim_id} failed (instance {victim_id} is gone: "
        routed = stamped(log, gone + "no responders on its subject")  # sent after the kill
        moved = stamped(log, gone + "no responders to a probe") + stamped(log, gone + "stream stalled")  # under way
        return {
            "mode": mode,
            "requests": sum(statuses.values()),
            "after_kill": sum(statuses.values()) - before,
            "statuses": dict(statuses),
            "routed_after_kill": len(routed),
            "last_routed_ms": (max(routed) - killed_at) * 1000 if routed else None,
            "first_routed_ms": (min(routed) - killed_at) * 1000 if routed else None,
            "in_flight_moved": len(moved),
            "in_flight_moved_s": (max(moved) - killed_at) if moved else None,
        }
    finally:
        frontend.stop(timeout=10)
        for w in workers:
            w.stop(timeout=10)


async def amain(args) -> None:
    with running_servers() as (etcd, nats_server):
        for mode in args.router_mode:
            r = await run(mode, args, etcd, nats_server)
            last = "none" if r["last_routed_ms"] is None else f"{r['last_routed_ms']:.0f} ms"
            first = "none" if r["first_routed_ms"] is None else f"{r['first_routed_ms']:.0f} ms"
            moved = "" if r["in_flight_moved_s"] is None else f" (the last {r['in_flight_moved_s'] * 1000:.0f} ms after)"
            print(f"router {r['mode']}: {r['requests']} requests ({r['after_kill']} after the kill), statuses "
                  f"{r['statuses']}; routed to the dead worker after the kill: {r['routed_after_kill']} "
                  f"(first {first}, last {last} after SIGKILL); requests it was serving, moved to another worker: "
                  f"{r['in_flight_moved']}{moved}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--before", type=float, default=2.0, help="seconds of load before the kill")
    parser.add_argument("--after", type=float, default=6.0, help="seconds of load after the kill")
    parser.add_argument("--router-mode", nargs="+", default=["kv", "round_robin"])
    asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    main()
