"""HTTP helpers for end-to-end tests."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter

import httpx


async def wait_http_ok(url: str, timeout: float = 60.0, interval: float = 0.2) -> None:
    """Poll ``url`` until it answers 200; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url, timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(interval)
    raise TimeoutError(url)


async def wait_for_model(base_url: str, model: str, timeout: float = 60.0, interval: float = 0.2) -> None:
    """Poll a frontend's ``/health`` until it lists ``model`` (a frontend is ready before any worker
    serves: readiness means it takes traffic); TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                r = await client.get(f"{base_url}/health", timeout=2)
                if r.status_code == 200 and model in r.json().get("models", []):
                    return
            except (httpx.TransportError, ValueError):
                pass
            await asyncio.sleep(interval)
    raise TimeoutError(f"{base_url}/health never listed {model!r}")


async def completion_load(url: str, statuses: Counter, stop: asyncio.Event, prompt: str = "load",
                          max_tokens: int = 4) -> None:
    """Send ``/v1/completions`` requests one after another until ``stop``, counting each answer's
    status (or the transport error's name) in ``statuses``."""
    body = {"model": "mock", "prompt": prompt, "max_tokens": max_tokens}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            try:
                statuses[(await client.post("/v1/completions", json=body)).status_code] += 1
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
            await asyncio.sleep(0.01)


def raw_completion(port: int, body: dict) -> socket.socket:
    """A raw socket with a small receive buffer that has POSTed ``body`` to ``/v1/completions``; the
    caller reads the answer slowly, or never (a stalled client)."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


async def good_stream(url: str, gaps: list[float], stop: asyncio.Event, max_tokens: int = 200) -> int:
    """A well-behaved streaming client: completions of ``max_tokens`` one after another until ``stop``,
    each gap between two streamed lines appended to ``gaps``; returns the streams it finished."""
    body = {"model": "mock", "prompt": "a well-behaved client", "max_tokens": max_tokens, "stream": True}
    streams = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                last = None
                async for _ in resp.aiter_lines():
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
            streams += 1
    return streams
