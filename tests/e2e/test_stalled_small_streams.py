"""A client that never reads a stream small enough to fit in the socket buffers (every write of the
frontend completes) is still dropped after --write-timeout, and its worker work cancelled, rather than
holding the worker to the end: what counts is whether the client takes the bytes, not whether a write
returned."""

from __future__ import annotations

import time

import pytest

from tests.e2e.test_frontend_openai import FrontendStack
from tests.support.http import raw_completion

pytestmark = pytest.mark.e2e

CANCELLED = "cancelled after client left"


@pytest.fixture(scope="module")
def stack(servers):
    s = FrontendStack(servers)
    worker = s.worker("--token-latency-ms", "50", "--num-speculative-tokens", "0")
    s.frontend("--write-timeout", "2")
    s.wait_healthy()
    yield s, worker
    s.stop()


def test_a_client_that_never_reads_a_small_stream_is_dropped_and_its_worker_cancelled(stack):
    s, worker = stack
    before = worker.logs().count(CANCELLED)
    # 400 tokens at 50 ms: a 20 s stream of about 60 KB, which the socket buffers on both sides and
    # the server's write buffer hold without a write ever waiting
    sock = raw_completion(s.port, {"model": "mock", "prompt": "x", "max_tokens": 400, "stream": True})
    try:
        started = time.monotonic()
        while worker.logs().count(CANCELLED) == before:
            assert time.monotonic() - started < 12, "the worker kept generating for a client that reads nothing"
            time.sleep(0.1)
        assert time.monotonic() - started < 12
    finally:
        sock.close()


def test_a_slow_but_reading_client_is_not_dropped(stack):
    s, worker = stack
    before = worker.logs().count(CANCELLED)
    sock = raw_completion(s.port, {"model": "mock", "prompt": "x", "max_tokens": 80, "stream": True})
    got = b""
    sock.settimeout(15)
    try:
        while b"data: [DONE]" not in got:  # a little at a time, with pauses shorter than the timeout
            chunk = sock.recv(512)
            assert chunk, "the stream was cut"
            got += chunk
            time.sleep(0.05)
    finally:
        sock.close()
    assert got.count(b'"finish_reason":"length"') == 1 or b'"finish_reason": "length"' in got
    assert worker.logs().count(CANCELLED) == before
