"""Frontend benchmark: a 16-token chat request through ``python -m frontend`` next to the bare
runtime call to the same mock worker, in the same run.

Usage: .venv/bin/python bench/frontend_bench.py [--requests 600] [--seconds 5] [--concurrency 16]

Starts a real etcd and nats-server on loopback, one ``python -m workers.mock`` at zero token
latency (no simulated speculation, so 16 tokens are 16 stream frames) and one ``python -m frontend``.
Measures, alternating the two paths in blocks of 50 so they share the machine's noise:

- sequential latency (median, p99) of a non-streaming chat completion of ``max_tokens`` tokens at
  temperature 0, against ``EndpointClient.call`` of the same token ids (the prompt the chat
  template produces) to the same worker, collected to its END frame;
- requests/s with ``--concurrency`` clients, each on its own keep-alive connection, for both paths.

The HTTP client is a minimal keep-alive HTTP/1.1 client on asyncio streams, so that the numbers
measure the frontend rather than a client library's overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from frontend.tokenizer import Tokenizer  # noqa: E402
from runtime import Runtime, RuntimeConfig  # noqa: E402
from runtime.messages import GenerateRequest, SamplingParams, TokenDelta  # noqa: E402
from runtime.request_plane import collect  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, free_port, start_servers  # noqa: E402

NAMESPACE = "fbench"
MESSAGES = [{"role": "user", "content": "Hello! Could you tell me a short story about a fox?"}]


class HttpConnection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads Content-Length answers."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> HttpConnection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return int(status_line.split()[1]), await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args: argparse.Namespace, cfg: RuntimeConfig, http_port: int) -> dict:
    async with Runtime.connect(cfg) as rt:
        client = await rt.client("target", "generate")
        [inst] = await client.wait_for_instances(1, timeout=60)
        card = next(c for c in (await rt.models()).values() if c.name == "mock")
        tok = await asyncio.to_thread(Tokenizer.load, card.tokenizer_path, card.chat_template, card.eos_token_ids)
        ids = tok.encode_chat(MESSAGES)
        bare_request = GenerateRequest(ids, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), "mock")
        body = json.dumps({"model": "mock", "messages": MESSAGES, "max_tokens": args.max_tokens, "temperature": 0}).encode()

        async def bare() -> None:
            deltas = await collect(await client.call(inst.instance_id, bare_request, TokenDelta))
            assert sum(len(d.token_ids) for d in deltas) == args.max_tokens

        async def front(conn: HttpConnection) -> None:
            status, answer = await conn.post("/v1/chat/completions", body)
            assert status == 200, answer
            assert json.loads(answer)["usage"]["completion_tokens"] == args.max_tokens

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("frontend not healthy")
            await asyncio.sleep(0.1)
        conn = await HttpConnection("127.0.0.1", http_port).open()
        for _ in range(50):  # warm up: tokenizer load, first-call paths, connections
            await front(conn)
            await bare()

        lat = {"bare": [], "frontend": []}
        block = 50
        for _ in range(max(1, args.requests // block)):
            for _ in range(block):
                t = time.perf_counter()
                await bare()
                lat["bare"].append(time.perf_counter() - t)
            for _ in range(block):
                t = time.perf_counter()
                await front(conn)
                lat["frontend"].append(time.perf_counter() - t)
        conn.close()

        async def throughput(kind: str) -> float:
            stop = time.monotonic() + args.seconds
            done = 0
            conns = [await HttpConnection("127.0.0.1", http_port).open() for _ in range(args.concurrency)] if kind == "frontend" else []

            async def worker(i: int) -> None:
                nonlocal done
                while time.monotonic() < stop:
                    await (front(conns[i]) if conns else bare())
                    done += 1

            start = time.monotonic()
            await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
            elapsed = time.monotonic() - start
            for c in conns:
                c.close()
            return done / elapsed

        rps = {"bare": [], "frontend": []}
        for _ in range(args.rounds):  # alternate, so both see the same noise
            for kind in ("bare", "frontend"):
                rps[kind].append(await throughput(kind))

    out = {}
    for kind in ("bare", "frontend"):
        out[kind] = {"median_ms": statistics.median(lat[kind]) * 1e3, "p99_ms": pct(lat[kind], 0.99) * 1e3,
                     "rps": statistics.median(rps[kind])}
    out["overhead_median_ms"] = out["frontend"]["median_ms"] - out["bare"]["median_ms"]
    out["prompt_tokens"] = len(ids)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600, help="sequential requests per path")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one throughput round")
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds per path (median reported)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    etcd, nats_ = start_servers()
    env = env_for(etcd, nats_, NAMESPACE)
    http_port = free_port()
    procs = [
        ManagedProcess("workers.mock", ["--token-latency-ms", "0", "--num-speculative-tokens", "0",
                                        "--stats-interval", "1"], env, "mock").start(),
        ManagedProcess("frontend", ["--http-port", str(http_port), "--log-level", "warning"], env, "frontend").start(),
    ]
    cfg = RuntimeConfig(etcd_url=etcd.url, nats_url=nats_.url, namespace=NAMESPACE, handle_signals=False)
    try:
        import uvloop

        result = uvloop.run(run(args, cfg, http_port))
    finally:
        for proc in procs:
            proc.stop()
        etcd.cleanup()
        nats_.cleanup()
    if args.json:
        print(json.dumps(result, indent=2))
        return
    b, f = result["bare"], result["frontend"]
    print(f"{args.max_tokens}-token chat request, prompt {result['prompt_tokens']} tokens, mock worker at 0 ms/token")
    print(f"| measure | frontend (HTTP) | bare runtime call | difference |")
    print(f"|---|---|---|---|")
    print(f"| sequential latency, median | {f['median_ms']:.2f} ms | {b['median_ms']:.2f} ms | +{f['median_ms'] - b['median_ms']:.2f} ms |")
    print(f"| sequential latency, p99 | {f['p99_ms']:.2f} ms | {b['p99_ms']:.2f} ms | +{f['p99_ms'] - b['p99_ms']:.2f} ms |")
    print(f"| requests/s, {args.concurrency} concurrent clients | {f['rps']:.0f} | {b['rps']:.0f} | {f['rps'] / b['rps']:.2f}x |")


if __name__ == "__main__":
    main()
