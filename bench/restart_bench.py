"""How long ``tandem up`` takes to serve again after one of its children is SIGKILLed.

Usage: .venv/bin/python bench/restart_bench.py [--rounds 3] [--children etcd,nats,target-0,frontend]
                                               [--baseline-tree PATH]

Each round starts ``tandem up --mock`` (mock target at 2 ms a token) on free ports, waits until it
serves, then kills each named child once with SIGKILL (a child killed twice within 30 s would wait
out the supervisor's backoff) and times the first chat completion that succeeds after the kill,
requests sent back to back; after NATS it waits out the blip grace (``BLIP_GRACE_S``: a dead
target's "no responders" right after a NATS blip means "not resubscribed yet"), and before the
frontend, where the checkout keeps a spare frontend, until that spare has loaded. For the frontend
it also reports the CPU seconds the new frontend process used up to that answer (a spare's loading,
done ahead of the kill, included), and the connections refused meanwhile.
``--baseline-tree`` names another checkout (e.g. ``git worktree add /tmp/base <commit>``) whose
``tandem up`` runs in alternate rounds, so that both are measured under the same load.
Target: every child serving again within 3 s.
"""

from __future__ import annotations

import argparse
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

from runtime.request_plane import BLIP_GRACE_S  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serving_again(url: str, timeout: float = 60.0) -> tuple[float, int]:
    """Seconds until a chat completion succeeds, and the connections refused until then."""
    started, refused = time.monotonic(), 0
    while time.monotonic() - started < timeout:
        try:
            resp = httpx.post(f"{url}/v1/chat/completions", timeout=timeout,
                              json={"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            if resp.status_code == 200:
                return time.monotonic() - started, refused
        except httpx.ConnectError:
            refused += 1
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"not serving {timeout}s after the kill")


def one_round(tree: Path, children: list[str]) -> dict[str, tuple[float, int, float | None]]:
    http_port = free_port()
    log = Path(tempfile.mkstemp(prefix="restart-bench-", suffix=".log")[1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-m", "deploy.cli", "up", "--mock", "--mock-token-latency-ms", "2", "--http-port",
            str(http_port), "--etcd-port", str(free_port()), "--nats-port", str(free_port()),
            "--namespace", f"rb{os.getpid()}"]
    up = subprocess.Popen(argv, cwd=tree, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http_port}"
    out = {}
    try:
        deadline = time.monotonic() + 180
        while "Tandem is ready" not in log.read_text(errors="replace"):
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tandem up did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        serving_again(url)
        for name in children:
            time.sleep(1.0)
            logs = log.read_text(errors="replace")
            if name == "frontend" and "prepared a spare frontend" in logs:  # a checkout with spares
                while not re.search(r"spare frontend \(pid \d+\) loaded", log.read_text(errors="replace")):
                    time.sleep(0.1)
            pid = int(re.findall(rf"started {name} \(pid (\d+)\)", log.read_text(errors="replace"))[-1])
            os.kill(pid, signal.SIGKILL)
            took, refused = serving_again(url)
            cpu = None
            if name == "frontend":
                new = re.findall(r"started frontend \(pid (\d+)\)", log.read_text(errors="replace"))
                cpu = cpu_seconds(int(new[-1])) if len(new) > 1 else None
            out[name] = (took, refused, cpu)
            if name == "nats":  # a dead target's "no responders" right after a NATS blip waits out the grace
                time.sleep(BLIP_GRACE_S)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        log.unlink(missing_ok=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--children", default="etcd,nats,target-0,frontend")
    parser.add_argument("--baseline-tree", type=Path, default=None, help="another checkout, run in alternate rounds")
    args = parser.parse_args()
    children = args.children.split(",")
    trees = {"this": ROOT} if args.baseline_tree is None else {"baseline": args.baseline_tree.resolve(), "this": ROOT}
    results: dict[str, dict[str, list[tuple[float, int, float | None]]]] = {t: {c: [] for c in children} for t in trees}
    for r in range(args.rounds):
        for label, tree in trees.items():
            load = os.getloadavg()[0]
            got = one_round(tree, children)
            line = ", ".join(f"{c} {t:.2f}s" + (f" (cpu {cpu:.2f}s, refused {n})" if c == "frontend" else "")
                             for c, (t, n, cpu) in got.items())
            print(f"round {r + 1} {label} (load {load:.1f}): {line}", flush=True)
            for c, v in got.items():
                results[label][c].append(v)
    for label, per_child in results.items():
        for c, values in per_child.items():
            took = [v[0] for v in values]
            cpu = [v[2] for v in values if v[2] is not None]
            extra = f"; cpu median {statistics.median(cpu):.2f}s" if cpu else ""
            print(f"{label} {c}: median {statistics.median(took):.2f}s, max {max(took):.2f}s, runs "
                  f"{' '.join(f'{t:.2f}' for t in took)}{extra}; refused {sum(v[1] for v in values)}")


if __name__ == "__main__":
    main()
