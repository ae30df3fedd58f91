"""A bounded abuse run against the frontend: do well-behaved streams keep flowing while others misbehave?

Usage: .venv/bin/python bench/abuse_bench.py [--streams 8] [--fuzz 1000]

Real etcd and nats-server on loopback, one mock worker (5 ms per token), one ``python -m frontend``
(--body-timeout 3, --write-timeout 3). While ``--streams`` clients stream completions and record the
gap between consecutive chunks, other clients send, all at once:
  1. a 3.5 MB body of 700,000 one-letter prompts, and a chat of 100,000 empty messages;
  2. 10 uploads that declare 1,000 bytes, send 10 and disconnect;
  3. 8 uploads that trickle a byte a second (held open past the body timeout);
  4. 3 streaming requests (n = 8, 2,000 tokens, logprobs 20) whose client never reads;
  5. ``--fuzz`` random and mutated request bodies.
Case ``startup`` first starts services wrongly (missing model paths, a negative lease TTL, an unknown
TANDEM_LOG_LEVEL, a bad flag, NATS and etcd refusing connections) and reports, per case, the exit status,
the number of output lines and the seconds to exit (target: non-zero, one line, under 5 s).
Then (case ``wipe``) etcd is killed, its data deleted and started again empty, while plain requests keep
coming; every worker stays alive, so every answer must be a 200 while the workers register again.
Reports the longest gap a well-behaved stream saw beyond its token interval (target < 250 ms), the
frontend's RSS before and after, and the status codes (target: no 5xx).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.support import http as http_support  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, free_port, start_servers  # noqa: E402

TOKEN_MS = 5


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def good_stream(url: str, gaps: list[float], stop: asyncio.Event) -> int:
    body = {"model": "mock", "prompt": "a well-behaved client", "max_tokens": 200, "stream": True}
    streams = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                last = None
                async for _ in resp.aiter_lines():
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
            streams += 1
    return streams


async def raw(port: int, data: bytes, hold: float = 0.0, trickle: bool = False) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if trickle:
            for _ in range(int(hold)):
                await asyncio.sleep(1)
                writer.write(b" ")
                await writer.drain()
        elif hold:
            await asyncio.sleep(hold)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def never_reader(port: int):
    return http_support.raw_completion(port, {"model": "mock", "prompt": "x", "n": 8, "max_tokens": 2000,
                                            "stream": True, "logprobs": 20})


def fuzz_bodies(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    values = [None, True, -1, 0, 1, 2**70, 1e308, float("nan"), "", "x" * 1000, "\udcff", [], {}, [1, "a"],
              {"a": [None]}, -0.5, 3.7, "mock"]
    fields = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop",
              "logprobs", "seed", "stream_options", "response_format", "tools", "min_tokens", "ignore_eos", "echo",
              "best_of", "logit_bias", "user", "max_completion_tokens", "top_logprobs", "stop_token_ids"]
    out = []
    for i in range(n):
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        kind = rng.random()
        if kind < 0.1:
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        else:
            base = ({"model": "mock", "prompt": "hi", "max_tokens": 3} if path.endswith("/completions") and
                    "chat" not in path else {"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 3})
            for _ in range(rng.randrange(1, 4)):
                value = rng.choice(values)
                base[rng.choice(fields)] = value if not (isinstance(value, float) and value != value) else "nan"
            try:
                body = json.dumps(base, allow_nan=False).encode("utf-8", "surrogatepass")
            except ValueError:
                body = b"{" + str(i).encode()
        out.append((path, body))
    return out


STARTUP_FAILURES = [
    ("target, missing model path", ["workers.target", "--model", "/nonexistent/model"], {}),
    ("draft, missing model path", ["workers.draft", "--method", "draft_model", "--draft-model", "/nonexistent/m"], {}),
    ("mock, negative --lease-ttl", ["workers.mock", "--lease-ttl", "-1"], {}),
    ("frontend, negative --lease-ttl", ["frontend", "--lease-ttl", "-1"], {}),
    ("router, unknown TANDEM_LOG_LEVEL", ["router"], {"TANDEM_LOG_LEVEL": "LOUD"}),
    ("frontend, bad flag", ["frontend", "--no-such-flag"], {}),
    ("mock, NATS refuses", ["workers.mock"], {"TANDEM_NATS": "nats://127.0.0.1:{dead}"}),
    ("mock, etcd refuses", ["workers.mock"], {"TANDEM_ETCD": "http://127.0.0.1:{dead}"}),
]


def startup_failures(env: dict[str, str]) -> bool:
    """Run every start-up failure; print one row each; True when all are one line, non-zero, < 5 s."""
    import subprocess

    dead, ok = free_port(), True
    for name, argv, extra in STARTUP_FAILURES:
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env={**env, **{k: v.format(dead=dead) for k, v in extra.items()}})
        seconds = time.perf_counter() - began
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        good = done.returncode != 0 and len(lines) == 1 and seconds < 5
        ok &= good
        print(f"start-up failure {name:34s} exit {done.returncode}  {len(lines)} line(s)  {seconds:4.1f}s  "
              f"{'ok' if good else 'FAIL'}: {lines[-1][-110:] if lines else ''}")
    return ok


async def etcd_wipe(url: str, etcd, worker: ManagedProcess) -> Counter:
    """Kill etcd, delete its data, start it again; the statuses of plain requests sent meanwhile
    until the worker has registered again (and a second more)."""
    statuses: Counter = Counter()
    stop = asyncio.Event()

    load = [asyncio.create_task(http_support.completion_load(url, statuses, stop, "across an etcd wipe"))
            for _ in range(4)]
    await asyncio.sleep(0.5)
    registered = worker.logs().count("registering again")
    await asyncio.to_thread(etcd.stop, True)
    etcd.wipe()
    await asyncio.sleep(1.0)
    await asyncio.to_thread(etcd.start)
    deadline = time.monotonic() + 30
    while worker.logs().count("registering again") == registered and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*load)
    return statuses


async def amain(args) -> None:
    etcd, nats_server = start_servers()
    env = env_for(etcd, nats_server, "abuse")
    startup_ok = startup_failures(env) if "startup" in args.cases else True
    port = free_port()
    worker = ManagedProcess("workers.mock", ["--token-latency-ms", str(TOKEN_MS), "--num-speculative-tokens", "0"],
                            env, "mock").start()
    frontend = ManagedProcess("frontend", ["--http-port", str(port), "--body-timeout", "3", "--write-timeout", "3"],
                              env, "frontend").start()
    url = f"http://127.0.0.1:{port}"
    try:
        frontend.wait_for_log("frontend ready", timeout=60)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for _ in range(600):
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            await client.post("/v1/completions", json={"model": "mock", "prompt": "warm", "max_tokens": 2})
        rss_before = rss_mb(frontend.pid)
        gaps: list[float] = []
        stop = asyncio.Event()
        good = [asyncio.create_task(good_stream(url, gaps, stop)) for _ in range(args.streams)]
        await asyncio.sleep(1.0)
        gaps.clear()  # measure from here on: every well-behaved stream is running
        statuses: Counter = Counter()
        started = time.perf_counter()
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def post(path: str, content: bytes) -> None:
                try:
                    r = await client.post(path, content=content, headers={"content-type": "application/json"})
                    statuses[r.status_code] += 1
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1

            big = json.dumps({"model": "mock", "prompt": ["a"] * 700_000}).encode()
            many = json.dumps({"model": "mock", "messages": [{"role": "user", "content": ""}] * 100_000}).encode()
            partial = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
            readers = [never_reader(port) for _ in range(3)] if "readers" in args.cases else []
            tasks = [post("/v1/completions", big), post("/v1/chat/completions", many)] if "bodies" in args.cases else []
            if "uploads" in args.cases:
                tasks += [raw(port, partial) for _ in range(10)]
                tasks += [raw(port, partial, hold=5, trickle=True) for _ in range(8)]
            sem = asyncio.Semaphore(32)

            async def fuzz(path: str, body: bytes) -> None:
                async with sem:
                    await post(path, body)

            tasks += [fuzz(p, b) for p, b in fuzz_bodies(args.fuzz if "fuzz" in args.cases else 0)]
            await asyncio.gather(*tasks)
            await asyncio.sleep(4)  # the never-reading clients' streams get dropped meanwhile
            for sock in readers:
                sock.close()
        abuse_s = time.perf_counter() - started
        wipe = await etcd_wipe(url, etcd, worker) if "wipe" in args.cases else None
        stop.set()
        streams = sum(await asyncio.gather(*good))
        rss_after = rss_mb(frontend.pid)
        text = httpx.get(url + "/metrics", timeout=5).text
        server_5xx = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("tandem_frontend_requests_total{") and 'status="5' in line)
        longest = max(gaps) if gaps else 0.0
        print(f"abuse phase {abuse_s:.1f}s; {args.streams} well-behaved streams completed {streams} streams "
              f"({len(gaps)} chunk gaps)")
        print(f"longest gap between chunks of a well-behaved stream: {1e3 * longest:.0f} ms "
              f"(token interval {TOKEN_MS} ms; p99 {1e3 * sorted(gaps)[int(0.99 * len(gaps))]:.0f} ms)")
        print(f"frontend RSS {rss_before:.0f} MB before, {rss_after:.0f} MB after")
        print(f"client-side statuses: {dict(sorted(statuses.items(), key=str))}; frontend-counted 5xx: {server_5xx:.0f}")
        if not startup_ok:
            sys.exit("a start-up failure was not one line, non-zero and under 5 s")
        if wipe is not None:
            print(f"etcd wipe under load: {dict(wipe)} ({sum(v for k, v in wipe.items() if k != 200)} non-200)")
            if set(wipe) != {200}:
                sys.exit("non-200 answers across the etcd wipe")
        if any(isinstance(k, int) and k >= 500 for k in statuses) or server_5xx:
            sys.exit("5xx answers seen")
    finally:
        frontend.stop()
        worker.stop()
        etcd.cleanup()
        nats_server.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--fuzz", type=int, default=1000)
    ap.add_argument("--cases", type=lambda v: set(v.split(",")), default={"bodies", "uploads", "readers", "fuzz", "wipe", "startup"},
                    help="which abuse to send: bodies, uploads, readers, fuzz, wipe, startup (default all)")
    asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    main()
