"""Frontend readiness and its health port: /health means "this frontend takes traffic" on both ports
(no target is a 503 with Retry-After on requests, not a frontend out of its Service), and the health
port's /metrics asks for the API key when the main port's does."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.support.procs import ManagedProcess
from tests.support.servers import env_for, free_port

pytestmark = pytest.mark.e2e

KEY = "sk-readiness"


@pytest.fixture
def frontend(servers, namespace):
    port, health = free_port(), free_port()
    proc = ManagedProcess("frontend", ["--http-port", str(port), "--health-port", str(health), "--lease-ttl", "3",
                                       "--api-key", KEY, "--metrics-require-key", "--drain-timeout", "3"],
                          env_for(*servers, namespace), "frontend").start()
    proc.wait_for_log("frontend ready", timeout=60)
    yield proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{health}"
    proc.stop(timeout=10)


def test_a_frontend_without_targets_is_ready_and_answers_503_with_retry_after(frontend):
    _, url, health_url = frontend
    for base in (url, health_url):
        r = httpx.get(base + "/health", timeout=5)
        assert r.status_code == 200, (base, r.text)
    assert httpx.get(url + "/health", timeout=5).json()["models"] == []
    r = httpx.post(url + "/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "no_workers"


def test_the_health_port_metrics_need_the_key_too(frontend):
    _, url, health_url = frontend
    for base in (url, health_url):
        assert httpx.get(base + "/metrics", timeout=5).status_code == 401, base
        r = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        assert r.status_code == 200 and "# TYPE" in r.text, base
        assert httpx.get(base + "/live", timeout=5).status_code == 200


def test_a_draining_frontend_is_not_ready(frontend):
    proc, _, health_url = frontend
    with httpx.Client(timeout=10) as client:
        proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while True:
            try:
                codes = {client.get(health_url + "/health").status_code}
            except httpx.HTTPError:
                break  # the health server is already gone: not ready either
            if codes == {503}:
                break
            assert time.monotonic() < deadline, "the health port still says ready while draining"
            time.sleep(0.02)
