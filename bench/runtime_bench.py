"""Request-plane benchmark: the runtime's round trip and streaming rate next to bare nats-py.

Usage: .venv/bin/python bench/runtime_bench.py [--round-trips 3000] [--frames 50000]

Starts a real etcd and nats-server on loopback, and a server process that hosts both a runtime
endpoint and a bare nats-py responder, so both paths cross the same processes and sockets. Round
trips alternate between the two paths in blocks to share the machine's noise; the ratio is the
result. Streaming compares one runtime stream of N frames with a bare publisher sending N messages
to one subscriber.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from runtime import Runtime, RuntimeConfig  # noqa: E402
from runtime.messages import GenerateRequest, SamplingParams, TokenDelta  # noqa: E402
from runtime.request_plane import collect  # noqa: E402
from tests.support.servers import env_for, start_servers  # noqa: E402

NAMESPACE = "bench"


# ---------------------------------------------------------------------------------------- server


async def serve(cfg: RuntimeConfig) -> None:
    async def echo(request: GenerateRequest, ctx):
        yield TokenDelta(token_ids=request.token_ids[:1], finish_reason="length")

    async def stream(request: GenerateRequest, ctx):
        delta = TokenDelta(token_ids=[7])
        for _ in range(request.sampling.max_tokens):
            yield delta

    async with Runtime.connect(cfg) as rt:
        raw = await nats.connect(cfg.nats_url)

        async def raw_reply(msg):
            await raw.publish(msg.reply, msg.data)

        async def raw_stream(msg):
            n = int(msg.data)
            payload = b"x" * 16
            for _ in range(n):
                await raw.publish(msg.reply, payload)
            await raw.publish(msg.reply, b"")

        await raw.subscribe("bench.raw", cb=raw_reply)
        await raw.subscribe("bench.raw_stream", cb=raw_stream)
        await raw.flush()
        await rt.serve("bench", "echo", echo, GenerateRequest)
        await rt.serve("bench", "stream", stream, GenerateRequest)
        await rt.wait_for_shutdown()
        await raw.close()


# ---------------------------------------------------------------------------------------- client


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def measure(cfg: RuntimeConfig, round_trips: int, frames: int) -> dict:
    async with Runtime.connect(cfg) as rt:
        raw = await nats.connect(cfg.nats_url)
        echo = await rt.client("bench", "echo")
        [inst] = await echo.wait_for_instances(1, timeout=30)
        streamer = await rt.client("bench", "stream")
        await streamer.wait_for_instances(1, timeout=30)
        request = GenerateRequest([1, 2, 3, 4], SamplingParams(max_tokens=1))
        payload = b"x" * len(request.token_ids)

        async def one_runtime() -> float:
            t = time.perf_counter()
            await collect(await echo.call(inst.instance_id, request, TokenDelta))
            return time.perf_counter() - t

        async def one_raw() -> float:
            t = time.perf_counter()
            await raw.request("bench.raw", payload, timeout=5)
            return time.perf_counter() - t

        for _ in range(200):  # warm up both paths
            await one_runtime()
            await one_raw()
        rt_times, raw_times = [], []
        block = 100
        for _ in range(round_trips // block):
            rt_times += [await one_runtime() for _ in range(block)]
            raw_times += [await one_raw() for _ in range(block)]

        # Streaming: one runtime stream of `frames` frames vs a bare publisher of `frames` messages.
        t = time.perf_counter()
        got = 0
        async with await streamer.call(inst.instance_id, GenerateRequest([1], SamplingParams(max_tokens=frames)), TokenDelta) as s:
            async for _ in s:
                got += 1
        rt_stream = time.perf_counter() - t
        assert got == frames, got

        done = asyncio.Event()
        count = 0
        inbox = raw.new_inbox()

        async def on_msg(msg):
            nonlocal count
            if msg.data:
                count += 1
            else:
                done.set()

        sub = await raw.subscribe(inbox, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
        t = time.perf_counter()
        await raw.publish("bench.raw_stream", str(frames).encode(), reply=inbox)
        await asyncio.wait_for(done.wait(), 120)
        raw_stream = time.perf_counter() - t
        await sub.unsubscribe()
        await raw.close()
        return {
            "rt_median_us": statistics.median(rt_times) * 1e6,
            "rt_p99_us": pct(rt_times, 0.99) * 1e6,
            "raw_median_us": statistics.median(raw_times) * 1e6,
            "raw_p99_us": pct(raw_times, 0.99) * 1e6,
            "rt_frames_per_s": frames / rt_stream,
            "raw_frames_per_s": count / raw_stream,
            "round_trips": len(rt_times),
            "frames": frames,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--frames", type=int, default=50_000)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        import uvloop

        uvloop.run(serve(RuntimeConfig.from_env(handle_signals=True)))
        return

    etcd, nats_server = start_servers()
    server = subprocess.Popen([sys.executable, __file__, "--serve"], env=env_for(etcd, nats_server, NAMESPACE))
    try:
        import uvloop

        cfg = RuntimeConfig(etcd_url=etcd.url, nats_url=nats_server.url, namespace=NAMESPACE, handle_signals=False)
        r = uvloop.run(measure(cfg, args.round_trips, args.frames))
    finally:
        server.terminate()
        server.wait(30)
        etcd.cleanup()
        nats_server.cleanup()
    print(f"round trip ({r['round_trips']} each, sequential, 1 frame):")
    print(f"  runtime      median {r['rt_median_us']:8.1f} us   p99 {r['rt_p99_us']:8.1f} us")
    print(f"  raw nats-py  median {r['raw_median_us']:8.1f} us   p99 {r['raw_p99_us']:8.1f} us")
    print(f"  ratio        median {r['rt_median_us'] / r['raw_median_us']:.2f}x   p99 {r['rt_p99_us'] / r['raw_p99_us']:.2f}x")
    print(f"streaming ({r['frames']} frames, one stream):")
    print(f"  runtime      {r['rt_frames_per_s']:10.0f} frames/s")
    print(f"  raw nats-py  {r['raw_frames_per_s']:10.0f} msgs/s")


if __name__ == "__main__":
    main()
