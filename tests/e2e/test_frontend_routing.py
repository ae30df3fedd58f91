"""The frontend with the KV-aware router over two mock workers, and its SIGTERM drain: real
``python -m frontend`` / ``python -m workers.mock`` processes over real etcd and NATS."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from tests.e2e.test_frontend_openai import FrontendStack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(servers):
    s = FrontendStack(servers)
    for i in range(2):
        s.worker("--token-latency-ms", "20", "--num-speculative-tokens", "0", name=f"mock{i}")
    s.frontend("--router-mode", "kv")
    s.wait_healthy()
    yield s
    s.stop()


def test_kv_routing_sends_a_repeated_prompt_to_the_worker_that_cached_it(stack):
    body = {"model": "mock", "messages": [{"role": "user", "content": "a shared prefix " * 20}], "max_tokens": 2}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        cached = [http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for _ in range(4)]
    # Round robin would alternate between the two workers; the KV router keeps hitting the cache.
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached


def test_sigterm_lets_an_open_stream_finish_then_exits_0(stack):
    frontend = next(p for p in stack.procs if p.name == "frontend")
    body = {"model": "mock", "prompt": "drain me", "max_tokens": 60, "stream": True, "temperature": 0}
    lines: list[str] = []
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            events = resp.iter_lines()
            while not any(line.startswith("data: {") for line in lines):
                lines.append(next(events))
            threading.Timer(0.1, frontend.signal, (signal.SIGTERM,)).start()
            lines.extend(events)
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert [line for line in lines if line][-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # all 60 tokens, though SIGTERM came early
    assert frontend.wait(20) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(stack.url + "/live")
