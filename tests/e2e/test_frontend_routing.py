"""The frontend with the KV-aware router over two mock workers, and its SIGTERM drain: real
``python -m frontend`` / ``python -m workers.mock`` processes over real etcd and NATS."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.test_frontend_openai import FrontendStack
from tests.support.procs import ManagedProcess
from tests.support.servers import free_port

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


def test_a_frontend_can_route_through_the_shared_router_service(stack):
    router = ManagedProcess("router", ["--mode", "kv", "--lease-ttl", "3"], stack.env, "router").start()
    port = free_port()
    frontend = ManagedProcess("frontend", ["--http-port", str(port), "--remote-router"], stack.env, "frontend-remote").start()
    stack.procs += [router, frontend]
    frontend.wait_for_log("frontend ready", timeout=60)
    body = {"model": "mock", "messages": [{"role": "user", "content": "another shared prefix " * 20}], "max_tokens": 2}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        deadline = time.monotonic() + 60
        while True:  # until the router service is registered and the tokenizer loaded
            resp = http.post("/v1/chat/completions", json=body)
            if resp.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert resp.status_code == 200, resp.text
        cached = [http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for _ in range(3)]
    assert all(c >= 64 for c in cached), cached
    frontend.stop()
    router.stop()


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
