"""A target killed with SIGKILL mid-stream: no stream fails, no request fails, ``/ping`` never lies.

``tandem up --mock`` with one target (the launcher restarts it) and with two, four streams in
flight, a new request every 0.25 s, and ``/ping`` polled beside them. The streams' outputs are
compared with the same requests on the healthy stack: the mock's greedy tokens are a function of
the prompt and the position, so a lost or repeated token shows up as a different text.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.support.launcher import Launcher, launcher  # noqa: F401  (the fixture)

pytestmark = pytest.mark.e2e

PROMPTS = [f"Tell me about bicycle number {i} and its gears, wheels and bell." for i in range(4)]
STREAM_TOKENS = 60


def stream_text(url: str, prompt: str, started: threading.Event | None = None) -> dict:
    """One streamed chat completion: its text, finish reason and any error frame."""
    body = {"model": "mock", "messages": [{"role": "user", "content": prompt}], "max_tokens": STREAM_TOKENS,
            "temperature": 0, "stream": True}
    text, finish, errors, chunks = "", None, [], 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
                continue
            for choice in event.get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
            chunks += 1
            if started is not None and chunks >= 5:
                started.set()
    return {"text": text, "finish": finish, "errors": errors}


class Traffic:
    """New short requests every 0.25 s and /ping polled beside them, until stopped."""

    def __init__(self, url: str):
        self.url = url
        self.results: list[tuple[float, int, float]] = []  # (sent at, status, seconds)
        self.pings: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._requests), threading.Thread(target=self._ping)]
        self._inflight: list[threading.Thread] = []

    def _one(self) -> None:
        sent = time.monotonic()
        try:
            r = httpx.post(f"{self.url}/v1/chat/completions", timeout=60,
                           json={"model": "mock", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4})
            status = r.status_code
        except httpx.HTTPError:
            status = -1
        self.results.append((sent, status, time.monotonic() - sent))

    def _requests(self) -> None:
        while not self._stop.is_set():
            t = threading.Thread(target=self._one)
            t.start()
            self._inflight.append(t)
            self._stop.wait(0.25)

    def _ping(self) -> None:
        while not self._stop.is_set():
            try:
                status = httpx.get(f"{self.url}/ping", timeout=5).status_code
            except httpx.HTTPError:
                status = -1
            self.pings.append((time.monotonic(), status))
            self._stop.wait(0.1)

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads + self._inflight:
            t.join(90)


def target_pids(up: Launcher) -> list[int]:
    return [int(p) for p in re.findall(r"started target-\d+ \(pid (\d+)\)", up.logs())]


def kill_mid_stream(up: Launcher, victim: int) -> tuple[list[dict], Traffic]:
    """Four streams; once each has tokens, SIGKILL ``victim``; traffic and pings throughout."""
    started = [threading.Event() for _ in PROMPTS]
    out: list[dict | None] = [None] * len(PROMPTS)

    def run(i: int) -> None:
        try:
            out[i] = stream_text(up.url, PROMPTS[i], started[i])
        except Exception as exc:  # reported by the assertion below
            out[i] = {"text": "", "finish": None, "errors": [repr(exc)]}
            started[i].set()

    with Traffic(up.url) as traffic:
        time.sleep(0.5)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(30)
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(120)
        time.sleep(1.0)
    return out, traffic


def check(up: Launcher, want: list[dict], got: list[dict], traffic: Traffic) -> None:
    for w, g in zip(want, got):
        assert g["errors"] == [], f"{g['errors']}\n{up.logs()[-4000:]}"
        assert g["finish"] == "length" and g["text"] == w["text"], (g, w)
    failed = [r for r in traffic.results if r[1] != 200]
    assert not failed, f"{failed}\n{up.logs()[-4000:]}"
    # /ping said 200 only while requests were served: no request failed, so any answer is true; a
    # 503 is allowed only while no target was live (then requests waited for the restart)
    assert traffic.pings and all(status in (200, 503) for _, status in traffic.pings), traffic.pings


def test_the_only_target_killed_mid_stream_loses_no_stream_and_no_request(launcher):
    up = launcher("--mock", "--mock-token-latency-ms", "40", "--targets", "1")
    up.wait_ready()
    want = [stream_text(up.url, p) for p in PROMPTS]
    (victim,) = target_pids(up)
    got, traffic = kill_mid_stream(up, victim)
    check(up, want, got, traffic)
    longest = max(seconds for _, _, seconds in traffic.results)
    print(f"longest wait of a new request: {longest:.2f}s; pings 503: "
          f"{sum(1 for _, s in traffic.pings if s == 503)} of {len(traffic.pings)}")
    assert re.search(r"target-0 exited with -9; restarting it", up.logs())


def test_one_of_two_targets_killed_mid_stream_costs_no_request_a_wait(launcher):
    up = launcher("--mock", "--mock-token-latency-ms", "40", "--targets", "2")
    up.wait_ready()
    want = [stream_text(up.url, p) for p in PROMPTS]
    with Traffic(up.url) as before:
        time.sleep(3)
    baseline = max(seconds for _, _, seconds in before.results)
    victim = target_pids(up)[0]
    got, traffic = kill_mid_stream(up, victim)
    check(up, want, got, traffic)
    longest = max(seconds for _, _, seconds in traffic.results)
    print(f"longest wait: {longest:.2f}s after the kill, {baseline:.2f}s before")
    assert longest <= baseline + 1.0, sorted(traffic.results, key=lambda r: -r[2])[:5]
    # the other target served throughout: /ping never said 503
    assert all(status == 200 for _, status in traffic.pings), traffic.pings
