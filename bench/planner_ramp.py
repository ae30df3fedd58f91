"""A load ramp against ``tandem up --mock --planner``, then the same ramp against a fixed deployment
sized for the peak: SLA attainment, worker-seconds and failed requests, with a plot of replicas and
load over time.

Usage: python bench/planner_ramp.py [--duration 600] [--peak 32] [--out docs/planner_ramp.svg]
       python bench/planner_ramp.py --quick        (120 s per run)

The ramp: clients in flight go 1 -> ``--peak`` -> 1 linearly (a triangle) over ``--duration`` seconds;
each client streams completions of ``--max-tokens`` back to back. Mock targets (no simulated speculation, so one
step is one token) take
``--token-ms`` per token plus ``--per-running-ms`` for each other request they run (a batched
engine's step grows with its batch), so one worker cannot hold the ITL SLA at the peak.
A request meets the SLA when the 90th percentile of its own inter-token gaps is within ``--itl-sla-ms``.
Worker-seconds: the integral of registered target workers over the run (etcd, sampled every second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.servers import free_port  # noqa: E402


def clients_at(t: float, duration: float, peak: int) -> int:
    """The triangle: 1 at the start and end, ``peak`` in the middle."""
    half = duration / 2
    frac = t / half if t < half else max(0.0, (duration - t) / half)
    return max(1, round(1 + (peak - 1) * frac))


async def stream_one(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[bool, list[float]]:
    body = {"model": "mock", "prompt": f"ramp client {i} at {time.time()}", "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    gaps, last, got = [], None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return False, []
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return False, []
                text = "".join(c.get("text", "") for c in chunk.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    got = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError:
        return False, []
    return got == max_tokens, gaps


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else (xs[0] if xs else 0.0)


def live_targets(etcd_port: int, namespace: str) -> int:
    out = subprocess.run([str(Path(sys.executable).parent / "etcdctl") if (Path(sys.executable).parent / "etcdctl").exists()
                          else "etcdctl", "--endpoints", f"http://127.0.0.1:{etcd_port}", "get", "--prefix", "--keys-only",
                          f"tandem/{namespace}/instances/target/"], capture_output=True, text=True)
    return sum(1 for line in out.stdout.splitlines() if line.strip())


async def run(args, planner: bool, targets: int, label: str) -> dict:
    port, etcd_port, nats_port = free_port(), free_port(), free_port()
    namespace = f"ramp{os.getpid()}{label}"
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--mock", "--http-port", str(port), "--etcd-port", str(etcd_port),
           "--nats-port", str(nats_port), "--namespace", namespace, "--targets", str(targets), "--num-speculative-tokens", "0",
           "--mock-token-latency-ms", f"{args.token_ms:g}", "--mock-token-latency-per-running-ms",
           f"{args.per_running_ms:g}", "--drain-timeout", "30", "--log-level", "WARNING"]
    if planner:
        cmd += ["--planner", "--planner-args", f"--itl-p90 {args.itl_sla_ms:g}ms --max-targets {args.max_targets} "
                f"--adjustment-interval 2 --latency-window 6 --up-cooldown 4 --down-cooldown 10"]
    log = tempfile.NamedTemporaryFile(prefix=f"planner-ramp-{label}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    timeline: list[tuple[float, int, int]] = []  # (t, clients, live targets)
    ok = failed = 0
    per_request_p90: list[float] = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                     limits=httpx.Limits(max_connections=args.peak * 2)) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if (await client.get("/health")).status_code == 200 and (await client.get("/v1/models")).json()["data"]:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, Path(log.name).read_text()[-3000:]
                await asyncio.sleep(0.5)
            start = time.monotonic()
            wanted = 0
            tasks: list[asyncio.Task] = []

            async def loop(i: int) -> None:
                nonlocal ok, failed
                while i < wanted and time.monotonic() - start < args.duration:
                    good, gaps = await stream_one(client, i, args.max_tokens)
                    if good:
                        ok += 1
                        per_request_p90.append(p90(gaps))
                    else:
                        failed += 1

            while (t := time.monotonic() - start) < args.duration:
                wanted = clients_at(t, args.duration, args.peak)
                while len(tasks) < wanted:
                    tasks.append(asyncio.create_task(loop(len(tasks))))
                tasks = [task for task in tasks if not task.done()] if wanted < len(tasks) else tasks
                n = await asyncio.to_thread(live_targets, etcd_port, namespace)
                timeline.append((t, wanted, n))
                await asyncio.sleep(1.0)
            wanted = 0
            await asyncio.gather(*tasks)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
    worker_seconds = sum(n for _, _, n in timeline)  # one sample a second
    met = sum(1 for x in per_request_p90 if x <= args.itl_sla_ms / 1000)
    logtext = Path(log.name).read_text()
    decisions = re.findall(r"pool target: (\d+) -> (\d+) \((\w+)\)", logtext)
    return {"label": label, "ok": ok, "failed": failed, "attainment": met / max(1, len(per_request_p90)),
            "worker_seconds": worker_seconds, "peak_targets": max(n for _, _, n in timeline),
            "itl_p90_median_ms": 1e3 * statistics.median(per_request_p90) if per_request_p90 else None,
            "timeline": timeline, "decisions": decisions, "log": log.name}


def write_svg(path: Path, runs: list[dict], duration: float, peak: int) -> None:
    """Clients in flight (grey) and target workers (colour per run) against time."""
    width, height, pad = 640, 340, 50
    top = max(peak, max(r["peak_targets"] for r in runs) * 4)

    def xy(t: float, y: float, scale: float = 1.0) -> str:
        return f"{pad + t / duration * (width - 2 * pad):.1f},{height - pad - y * scale / top * (height - 2 * pad):.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">seconds</text>',
             f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">'
             'clients in flight; target workers x4</text>']
    for k in range(5):
        y = top * k / 4
        py = height - pad - y / top * (height - 2 * pad)
        parts.append(f'<text x="{pad - 6}" y="{py + 4:.1f}" text-anchor="end">{y:.0f}</text>')
        parts.append(f'<line x1="{pad}" y1="{py:.1f}" x2="{width - pad}" y2="{py:.1f}" stroke="#eee"/>')
        t = duration * k / 4
        parts.append(f'<text x="{pad + t / duration * (width - 2 * pad):.1f}" y="{height - pad + 16}" '
                     f'text-anchor="middle">{t:.0f}</text>')
    load = " ".join(xy(t, c) for t, c, _ in runs[0]["timeline"])
    parts.append(f'<polyline points="{load}" fill="none" stroke="#999" stroke-width="2"/>')
    parts.append(f'<text x="{width - pad - 150}" y="{pad}" fill="#999">clients in flight</text>')
    for n, (run, color) in enumerate(zip(runs, ("#1f77b4", "#d62728"))):
        pts = " ".join(xy(t, w, 4.0) for t, _, w in run["timeline"])
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{width - pad - 150}" y="{pad + 14 * (n + 1)}" fill="{color}">targets: {run["label"]}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


async def amain(args) -> None:
    planned = await run(args, True, 1, "planner")
    print(json.dumps({k: v for k, v in planned.items() if k != "timeline"}, indent=1), flush=True)
    fixed = await run(args, False, planned["peak_targets"], f"fixed-{planned['peak_targets']}")
    print(json.dumps({k: v for k, v in fixed.items() if k != "timeline"}, indent=1), flush=True)
    if args.out:
        write_svg(Path(args.out), [planned, fixed], args.duration, args.peak)
    print(f"| run | requests ok | failed | SLA attainment (request ITL p90 <= {args.itl_sla_ms:g} ms) | "
          f"median request ITL p90 | peak targets | target worker-seconds |")
    print("|---|---|---|---|---|---|---|")
    for r in (planned, fixed):
        print(f"| {r['label']} | {r['ok']} | {r['failed']} | {100 * r['attainment']:.1f}% | "
              f"{r['itl_p90_median_ms']:.1f} ms | {r['peak_targets']} | {r['worker_seconds']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of the ramp (each run)")
    p.add_argument("--quick", action="store_true", help="120 s per run")
    p.add_argument("--peak", type=int, default=32, help="clients in flight at the top of the ramp")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--token-ms", type=float, default=10.0)
    p.add_argument("--per-running-ms", type=float, default=3.0)
    p.add_argument("--itl-sla-ms", type=float, default=40.0)
    p.add_argument("--max-targets", type=int, default=6)
    p.add_argument("--out", default=None, help="write the SVG plot here")
    args = p.parse_args()
    if args.quick:
        args.duration = 120.0
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
