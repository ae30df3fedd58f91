"""Slow and stalled clients: uploads hold no in-flight slot and get a 408 after --body-timeout; trickled
headers and idle connections are closed after --header-timeout / --idle-timeout; a stream whose client
reads nothing is dropped after --write-timeout, or as soon as its waiting output passes
--max-stream-buffer-bytes, and its worker work is cancelled."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.e2e.test_frontend_openai import FrontendStack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(servers):
    s = FrontendStack(servers)
    s.worker("--token-latency-ms", "0", "--num-speculative-tokens", "0")
    s.frontend("--max-inflight", "2", "--body-timeout", "2", "--write-timeout", "2", "--header-timeout", "1",
               "--idle-timeout", "2")
    s.wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def capped(servers):
    """A frontend whose write timeout is too long to matter here: only the buffer cap can drop a stream."""
    s = FrontendStack(servers)
    worker = s.worker("--token-latency-ms", "2", "--num-speculative-tokens", "0")
    s.frontend("--write-timeout", "120", "--max-stream-buffer-bytes", "65536")
    s.wait_healthy()
    yield s, worker
    s.stop()


def test_trickled_headers_and_idle_connections_are_closed_and_hold_no_slot(stack):
    sockets = []
    try:
        began = time.monotonic()
        for i in range(6):  # more than --max-inflight: half of them mid-headers, half idle
            sock = socket.create_connection(("127.0.0.1", stack.port))
            if i % 2:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")  # and never the rest
            sock.settimeout(10)
            sockets.append(sock)
        ok = httpx.post(stack.url + "/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200, ok.text
        for i, sock in enumerate(sockets):
            if i % 2:
                sock.sendall(b"X-Slow: 1\r\n")  # bytes keep coming: the header deadline still holds
            assert sock.recv(4096) == b""  # closed by the server, with no answer
        assert time.monotonic() - began < 4  # --header-timeout 1, --idle-timeout 2
    finally:
        for sock in sockets:
            sock.close()


def test_trickling_uploads_hold_no_slot_and_get_408(stack):
    sockets = []
    try:
        for _ in range(4):  # more stalled uploads than --max-inflight
            sock = socket.create_connection(("127.0.0.1", stack.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
            sockets.append(sock)
        time.sleep(0.3)
        ok = httpx.post(stack.url + "/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200, ok.text  # not 429: the stalled uploads are not in flight
        started = time.monotonic()
        for sock in sockets:
            sock.settimeout(10)
            answer = b""
            while b"request_timeout" not in answer:  # headers and body may come in separate reads
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"request_timeout" in answer, answer
        assert time.monotonic() - started < 5
    finally:
        for sock in sockets:
            sock.close()


def _count(stack, prefix: str, needle: str = "") -> float:
    text = httpx.get(stack.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix) and needle in line)


def test_a_client_that_never_reads_its_stream_is_dropped_after_the_write_timeout(stack):
    import json

    before = _count(stack, "tandem_frontend_requests_total{", 'status="499"')
    body = json.dumps({"model": "mock", "prompt": "hi " * 10, "n": 8, "max_tokens": 2000, "stream": True,
                       "logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client's buffers fill quickly
    sock.connect(("127.0.0.1", stack.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sock.recv(256)  # the status line, then read nothing more
        deadline = time.monotonic() + 20
        while _count(stack, "tandem_frontend_requests_total{", 'status="499"') == before:
            assert time.monotonic() < deadline, "the stalled stream was never dropped"
            time.sleep(0.2)
        assert _count(stack, "tandem_frontend_inflight_requests{") == 0
    finally:
        sock.close()


def test_a_stream_over_its_output_cap_is_dropped_and_its_worker_work_cancelled(capped):
    import json

    stack, worker = capped
    before = _count(stack, "tandem_frontend_streams_dropped_total", 'reason="buffer"')
    body = json.dumps({"model": "mock", "prompt": "hi " * 10, "n": 4, "max_tokens": 2000, "stream": True,
                       "logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", stack.port))
    began = time.monotonic()
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: bufcap\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sock.recv(256)  # the status line, then read nothing more
        while _count(stack, "tandem_frontend_streams_dropped_total", 'reason="buffer"') == before:
            assert time.monotonic() - began < 20, "the stream was never dropped"
            time.sleep(0.1)
        assert time.monotonic() - began < 60  # long before the 120 s write timeout
        worker.wait_for_log("request bufcap-", timeout=10)
        worker.wait_for_log("cancelled after client left", timeout=10)
        assert _count(stack, "tandem_frontend_inflight_requests{") == 0
        assert _count(stack, "tandem_frontend_requests_total{", 'status="499"') >= 1
        log = next(p for p in stack.procs if p.name == "frontend").logs()
        assert "does not read (cap 65536): stream dropped" in log
        assert "ASGI callable returned" not in log and "Traceback" not in log
    finally:
        sock.close()
