"""A target SIGKILLed mid-stream, repeated: failed streams, failed requests, the longest wait, /ping.

Usage: .venv/bin/python bench/crash_window_bench.py [--repetitions 10] [--targets 1 2] [--token-latency-ms 40]

For each ``--targets`` count: one ``tandem up --mock`` (``--mock-token-latency-ms``), then per
repetition four streamed chat completions (60 tokens) with a new 4-token request every 0.25 s and
``/ping`` polled every 0.1 s beside them; once every stream has tokens, one target is SIGKILLed (the
launcher restarts it). Reported per repetition: streams ending in an error frame or with another
text than on the healthy stack (a lost or repeated token), new requests that failed, the longest
wait of a new request (and, before the first kill, the longest with nobody killed), and /ping answers
that were 200 while a request failed. Between repetitions it waits until every target serves again.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.test_deploy_up import Launcher  # noqa: E402
from tests.e2e.test_worker_crash_window import PROMPTS, Traffic, kill_mid_stream, stream_text, target_pids  # noqa: E402


def live_targets(up: Launcher, count: int) -> list[int]:
    """The newest pid of each target-i once each has (re)started and the stack serves."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        newest = {}
        for name, pid in re.findall(r"started (target-\d+) \(pid (\d+)\)", up.logs()):
            newest[name] = int(pid)
        if len(newest) == count and "Tandem is ready" in up.logs():
            return list(newest.values())
        time.sleep(0.2)
    raise TimeoutError(up.logs()[-3000:])


def run(targets: int, repetitions: int, latency_ms: float) -> list[dict]:
    up = Launcher("--mock", "--mock-token-latency-ms", str(latency_ms), "--targets", str(targets))
    rows = []
    try:
        up.wait_ready(120)
        want = [stream_text(up.url, p) for p in PROMPTS]
        with Traffic(up.url) as before:
            time.sleep(3)
        baseline = max(s for _, _, s in before.results)
        for rep in range(repetitions):
            pids = live_targets(up, targets)
            time.sleep(2.0)  # the restarted target registered and took traffic
            got, traffic = kill_mid_stream(up, pids[rep % len(pids)])
            failed_at = [t for t, status, _ in traffic.results if status != 200]
            row = {"targets": targets, "rep": rep,
                   "stream_errors": sum(bool(g["errors"]) for g in got),
                   "streams_changed": sum(g["text"] != w["text"] for g, w in zip(got, want)),
                   "requests": len(traffic.results), "requests_failed": len(failed_at),
                   "longest_wait_s": round(max(s for _, _, s in traffic.results), 2),
                   "baseline_wait_s": round(baseline, 2),
                   "ping_503": sum(1 for _, s in traffic.pings if s == 503), "pings": len(traffic.pings),
                   "ping_200_while_failing": sum(1 for t, s in traffic.pings if s == 200 and any(abs(t - f) < 0.25 for f in failed_at))}
            rows.append(row)
            print(row, flush=True)
            while len(re.findall(r"started target-\d+ \(pid \d+\)", up.logs())) < targets + rep + 1:
                time.sleep(0.2)
    finally:
        up.cleanup()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repetitions", type=int, default=10)
    ap.add_argument("--targets", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--token-latency-ms", type=float, default=40.0)
    args = ap.parse_args()
    for targets in args.targets:
        rows = run(targets, args.repetitions, args.token_latency_ms)
        bad = sum(r["stream_errors"] + r["streams_changed"] + r["requests_failed"] for r in rows)
        print(f"targets {targets}: {len(rows)} kills, {bad} failures; longest wait "
              f"{max(r['longest_wait_s'] for r in rows):.2f}s (before any kill {rows[0]['baseline_wait_s']:.2f}s); "
              f"/ping 200 while a request failed: {sum(r['ping_200_while_failing'] for r in rows)}", flush=True)


if __name__ == "__main__":
    main()
